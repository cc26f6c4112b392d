"""AdamW8bit's fused step rounds its small leaves from the state's seed, not torch's generator.

With bf16 parameters and stochastic rounding, ``pf.adamw8bit``'s fused step keeps leaves under
``min_8bit_size`` elements (norm weights) in fp32 state and steps them with torch ops; their
rounding into bf16 draws from the seed made of the state's step count (``sr_seeds``) through
``kernels/small.py``'s ``stochastic_round_``, the noise Lion8bit's small-leaf kernel draws.
Here: that rounding is unbiased over steps, the seed advances with the count (and nothing else
moves it), and the flat-layout step of ``pf.compile`` ignores the global generator too.
(property_tests/test_8bit_sr_seed_props.py: any shapes, both chains, resume.)

On CPU the kernels run in Triton's interpreter (the root conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

import pgs.func as pf
from pgs.func.step import StepContext

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or Triton's interpreter")
SHAPES = {"n1": (1000,), "n2": (3, 300)}  # under min_8bit_size: fp32 state, the torch route


def _memoryless(lr=1e-3, wd=0.0):
    """β1 = β2 = 0: m = g, v = g² and both bias corrections 1, so from the same parameters and
    gradients every step computes the same fp32 values and only its rounding can differ."""
    return pf.adamw8bit(lr, b1=0.0, b2=0.0, weight_decay=wd, backend="triton")


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in SHAPES.items()}
    grads = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in SHAPES.items()}
    return params, grads


def _step(opt, g, state, p, sr=True):
    return opt.fused_step(g, state, {k: v.clone() for k, v in p.items()}, ctx=StepContext(), donate=False,
                          memory=pf.MemoryOptions(stochastic_rounding=sr))


def _neighbours(x: torch.Tensor):
    """(the bf16 value toward zero, the one away from zero, their distance) of fp32 ``x``."""
    lo = (x.view(torch.int32) & -65536).view(torch.float32)
    away = torch.full_like(x, float("inf")).copysign(x).bfloat16()
    hi = torch.nextafter(lo.bfloat16(), away).float()
    return lo, hi, (hi - lo).abs().double()


def _count(state) -> int:
    return int(state[next(iter(state))].count)


def test_small_leaves_round_unbiased_over_steps():
    """The same fp32 value x rounded at 96 consecutive steps (96 seeds from the count): each
    result is one of x's bf16 neighbours and their mean is within a few standard errors of x
    (round to nearest would be ¼ ulp off on average, truncation ½)."""
    params, grads = _problem()
    opt = _memoryless()
    exact, _ = _step(opt, grads, opt.init({k: v.float() for k, v in params.items()}),
                     {k: v.float() for k, v in params.items()}, sr=False)
    state = opt.init(params)
    total = {k: torch.zeros(s, dtype=torch.float64, device=DEV) for k, s in SHAPES.items()}
    draws = 96
    for _ in range(draws):
        p, state = _step(opt, grads, state, params)
        for k, x in exact.items():
            lo, hi, _ = _neighbours(x)
            y = p[k].float()
            assert bool(((y == lo) | (y == hi)).all()), f"{k}: a rounded value is not a neighbour of x"
            total[k] += y.double()
    assert _count(state) == draws
    for k, x in exact.items():
        lo, _, ulp = _neighbours(x)
        moved = lo != x  # elements x that bf16 does not hold exactly
        assert float(moved.float().mean()) > 0.9
        err = ((total[k] / draws - x.double()).abs() / ulp)[moved]
        # E|mean − x| ≤ ulp·√(f(1−f)/96)·√(2/π) ≤ 0.041 ulp per element
        assert float(err.mean()) < 0.09, f"{k}: biased, mean |error| {float(err.mean()):.3f} ulp"


def test_seed_advances_with_the_count_and_only_with_it():
    """From one state the step is the same bits whatever the global generator did; the next
    step (count + 1, the same fp32 values) draws other noise; a state whose count is set back
    draws the first step's noise again."""
    params, grads = _problem(1)
    opt = _memoryless()
    s0 = opt.init(params)
    torch.manual_seed(0)
    a, s1 = _step(opt, grads, s0, params)
    torch.manual_seed(123)
    torch.rand(10_000)
    b, _ = _step(opt, grads, s0, params)
    assert all(torch.equal(a[k], b[k]) for k in SHAPES), "the global generator moved the rounding"
    assert _count(s0) == 0 and _count(s1) == 1
    c, s2 = _step(opt, grads, s1, params)
    assert _count(s2) == 2
    for k in SHAPES:
        assert not torch.equal(a[k], c[k]), f"{k}: step 2 drew step 1's noise"
    back = pf.state_from_dict(s0, {k: (v if not k.endswith("count") else torch.zeros_like(v))
                                   for k, v in pf.state_to_dict(s2).items()})
    d, _ = _step(opt, grads, back, params)
    assert all(torch.equal(a[k], d[k]) for k in SHAPES), "the count does not decide the seed"


def compiled_run(fast, params: dict, grads: list, global_seed: int):
    """``(parameters, state dict)`` (copies) after ``fast.step`` over ``grads`` from
    ``fast.init(params)``, torch's global generator reseeded (``global_seed + i``) and drawn
    from before step i.  Also used by test_muon_fast."""
    p = {k: v.clone() for k, v in params.items()}
    state = fast.init(p)
    for i, g in enumerate(grads):
        torch.manual_seed(global_seed + i)
        torch.rand(777)
        p, state = fast.step(g, state, p)
    return ({k: v.detach().cpu().clone() for k, v in p.items()},
            {k: v.detach().cpu().clone() for k, v in pf.state_to_dict(state).items()})


def test_compiled_flat_step_ignores_the_global_generator():
    """``pf.compile(adamw8bit, stochastic_rounding=True).step`` (the bound optimizer's path): an
    8-bit matrix and small leaves on the flat layout, twice from one state with the generator
    reseeded and drawn from in between: the same parameters and state."""
    gen = torch.Generator().manual_seed(2)
    shapes = {"w": (64, 80), **SHAPES}
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()} for _ in range(2)]
    fast = pf.compile(pf.adamw8bit(3e-3, weight_decay=0.1, backend="triton"), jit=False, donate=True,
                      memory=pf.MemoryOptions(stochastic_rounding=True))
    (pa, sa), (pb, sb) = compiled_run(fast, params, grads, 0), compiled_run(fast, params, grads, 1000)
    for k in shapes:
        assert torch.equal(pa[k].view(torch.int16), pb[k].view(torch.int16)), k
        assert not torch.equal(pa[k], params[k].cpu()), k
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
