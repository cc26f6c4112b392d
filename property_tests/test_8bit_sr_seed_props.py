"""The 8-bit chains' fused step with stochastic rounding is a function of (updates, state, params).

Every rounding draw of ``pf.adamw8bit`` / ``pf.lion8bit``'s fused step (bf16 parameters,
``stochastic_rounding=True``) comes from a seed made of the optimizer state's step count and
the leaf's index (``sr_seeds``): the 8-bit leaves in their kernel, the small fp32-state leaves
(norm weights) in ``kernels/small.py``.  So for any leaf shapes, gradients and hyperparameters:

1. two runs from one state give the same bits, however torch's global generator was seeded
   or drawn from before and between their steps;
2. a run saved after its first step (``state_to_dict``, parameters copied) and resumed from
   the copies, with the generator disturbed in between, equals the run that went straight on.

On CPU the kernels run in Triton's interpreter, so the examples are small and few.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pgs.func as pf
from pgs.func import kernels as K
from pgs.func.step import StepContext

pytestmark = pytest.mark.skipif(not K.triton_importable(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 64
MIN8 = 256


@st.composite
def problems(draw):
    shapes = {}
    for i in range(draw(st.integers(0, 2))):  # 8-bit leaves (≥ MIN8 elements)
        shapes[f"w{i}"] = (draw(st.integers(4, 12)), draw(st.integers(64, 90)))
    shapes["n0"] = (128,)  # a small leaf large enough that some of its elements always move
    for i in range(1, draw(st.integers(1, 6))):  # small fp32-state leaves: more than one launch's 4
        shapes[f"n{i}"] = (draw(st.integers(1, 200)),) if draw(st.booleans()) else (draw(st.integers(1, 9)), 7)
    return dict(
        shapes=shapes,
        alias=draw(st.sampled_from(["adamw8bit", "lion8bit"])),
        wd=draw(st.sampled_from([0.0, 0.1])),
        donate=draw(st.booleans()),
        small_kernel=draw(st.booleans()),
        sr_offset=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
        global_seeds=draw(st.lists(st.integers(0, 2**31 - 1), min_size=3, max_size=3, unique=True)),
    )


def _opt(alias, wd):
    lr = 1e-3 if alias == "lion8bit" else 3e-3  # updates of a fraction of a bf16 ulp: the rounding decides
    return getattr(pf, alias)(lr, weight_decay=wd, block_size=BLOCK, min_8bit_size=MIN8, backend="triton")


def _disturb(seed):
    """Reseed torch's global generators and draw from them (as data loading or dropout would)."""
    torch.manual_seed(seed)
    torch.rand(1000)
    torch.randint(0, 7, (seed % 97 + 1,))
    if torch.cuda.is_available():
        torch.rand(1000, device="cuda")


def _step(opt, g, state, p, pr):
    return opt.fused_step(g, state, p, ctx=StepContext(sr_offset=pr["sr_offset"]), donate=pr["donate"],
                          memory=pf.MemoryOptions(stochastic_rounding=True))


def _bits(p: dict, state) -> dict:
    """A copy (``donate`` steps overwrite the tensors in place)."""
    out = {"p." + k: v.detach().cpu().clone().view(torch.int16) for k, v in p.items()}
    out.update({"s." + k: v.detach().cpu().clone() for k, v in pf.state_to_dict(state).items()})
    return out


def _assert_same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {differ}"


@given(problems())
def test_fused_8bit_step_ignores_the_global_generator(pr):
    """``small_kernel``: Lion8bit's small leaves through its Triton kernel or the torch route
    (AdamW8bit's always take the torch route and ``stochastic_round_``)."""
    with K.using(K.CONFIG.evolve(small_kernel=pr["small_kernel"])):
        _check(pr)


def _check(pr):
    gen = torch.Generator().manual_seed(pr["seed"])
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in pr["shapes"].items()}
    grads = [{k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in pr["shapes"].items()}
             for _ in range(2)]
    opt = _opt(pr["alias"], pr["wd"])

    def straight(global_seed):
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        _disturb(global_seed)
        p, state = _step(opt, grads[0], state, p, pr)
        saved = _bits(p, state)
        _disturb(global_seed + 1)
        p, state = _step(opt, grads[1], state, p, pr)
        return saved, _bits(p, state)

    one_a, two_a = straight(pr["global_seeds"][0])
    one_b, two_b = straight(pr["global_seeds"][1])
    _assert_same(one_a, one_b, "first step, another global generator")
    _assert_same(two_a, two_b, "second step, another global generator")

    # resume: the first step's parameters and state copied out and back, then another generator
    p = {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    p, state = _step(opt, grads[0], state, p, pr)
    saved_p = {k: v.detach().clone() for k, v in p.items()}
    saved_s = {k: v.clone() for k, v in pf.state_to_dict(state).items()}
    p, state = None, pf.state_from_dict(opt.init({k: v.clone() for k, v in params.items()}), saved_s)
    _disturb(pr["global_seeds"][2])
    p, state = _step(opt, grads[1], state, saved_p, pr)
    _assert_same(two_a, _bits(p, state), "resumed after the first step")
    # the rounding did decide something: the small leaf moved
    assert not torch.equal(two_a["p.n0"], params["n0"].cpu().view(torch.int16))
