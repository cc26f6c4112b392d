"""How many kernels one decoder-layer group step of gradient release launches (issue #8).

The memory-lean runs are host-bound inside backward's release hooks: every kernel launch of a
group step (and every dispatcher call) is time the GPU waits.  A ``TorchDispatchMode`` counts
the aten ops of one layer group's step on the CPU (the 8-bit kernels run in Triton's
interpreter; their own internals are not counted, the kernels are counted apart), split into
ops that launch a kernel on a GPU and host-only ops (views, splits, allocations).  The bounds
are what the group step costs now, with a little room; the code before these cuts (09aeee2)
launched 88 (lion8bit) and 113 (adamw8bit) per group with the grad norm on (counted with this
module's ``group_step_ops`` on that commit's pgs).  A ``torch._foreach_*`` op counts once.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pgs.func as pf
from pgs.func.step import StepContext
from pgs.runtime.optim.release import GradientRelease
from tiny import tiny_model

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
counting = pytest.mark.skipif(not INTERPRET, reason="counts the CPU path with the 8-bit kernels in Triton's interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

HOST_ONLY = frozenset({
    "view", "_unsafe_view", "view_as", "alias", "detach", "split", "split_with_sizes", "unbind", "select",
    "slice", "as_strided", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze", "reshape",
    "_reshape_alias", "empty", "empty_like", "empty_strided", "promote_types", "result_type", "is_same_size",
})
#: ops that would synchronise the host with the GPU (a .item() / bool() on a device tensor)
SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})


class _Count(TorchDispatchMode):
    def __init__(self, paused):
        super().__init__()
        self.ops = collections.Counter()
        self.paused = paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused[0]:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counting_run(run):
    """``(InterpretedFunction.run wrapped, Counter of Triton kernel runs by name, pause flag
    set while one runs)``: the dispatch counter skips the ops inside a kernel."""
    kernels, paused = collections.Counter(), [0]

    def counted(self, *a, **k):
        paused[0] += 1
        kernels[self.fn.__name__] += 1
        try:
            return run(self, *a, **k)
        finally:
            paused[0] -= 1

    return counted, kernels, paused


@pytest.fixture
def triton_runs(monkeypatch):
    """(Counter of Triton kernel runs, pause flag set while one runs)."""
    import triton.runtime.interpreter as TI

    counted, kernels, paused = counting_run(TI.InterpretedFunction.run)
    monkeypatch.setattr(TI.InterpretedFunction, "run", counted)
    return kernels, paused


def _model():
    # the 4B's leaf structure in one layer: q/k/v/o and gate/up/down ≥ 4096 elements (8-bit
    # state, a Triton kernel each), input/post-attention norms and q/k norms below (fp32 state)
    return tiny_model(seed=0, dtype=torch.bfloat16, mode=None, hidden_size=64, intermediate_size=192,
                      num_hidden_layers=1, head_dim=32, vocab_size=256, tie_word_embeddings=True)


def group_step_ops(model, chain, triton_runs, *, track_grad_norm=True, stochastic_rounding=True):
    """``(release, {group: (aten op Counter, Triton kernel Counter)})`` of the second backward's
    group steps (the first fills the caches: hyperparameter vectors, seed offsets)."""
    kernels, paused = triton_runs
    rel = GradientRelease(chain, model, memory=pf.MemoryOptions(stochastic_rounding=stochastic_rounding), track_grad_norm=track_grad_norm)
    x = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    seen = {}
    step = rel._step_group

    def counted(group):
        kernels.clear()
        with _Count(paused) as c:
            step(group)
        seen[group] = (c.ops, collections.Counter(kernels))

    for i in range(2):
        loss = model(x, labels=x, use_cache=False).loss
        if i == 1:
            rel._arrivals.on_complete = counted
        loss.backward()
    return rel, seen


def launching(ops: collections.Counter) -> int:
    """Aten ops that launch a kernel on a GPU (a multi-tensor op counts once)."""
    return sum(n for op, n in ops.items() if op not in HOST_ONLY)


def _layer_step_ops(chain, triton_runs, *, track_grad_norm=True):
    rel, seen = group_step_ops(_model(), chain, triton_runs, track_grad_norm=track_grad_norm)
    assert rel.fused_group_steps == 2 * len(rel.groups)  # every group took the fused path
    if track_grad_norm:
        assert rel.metrics().grad_norm > 0
    return seen["model.layers.0"]


# (chain, launching ops, host-only ops per layer group with the grad norm on, Triton kernels;
# before these cuts: 88 + 80 (lion8bit) and 113 + 107 (adamw8bit); after the multi-tensor
# cuts 15 + 48 and 29 + 66; Lion's small leaves in one Triton launch (kernels/small.py): 4 + 37;
# AdamW8bit's small leaves rounded by the seeded kernel (kernels/small.py) instead of
# torch.randint and three elementwise ops: 24 + 62)
BOUNDS = {
    "lion8bit": (lambda: pf.lion8bit(1e-5, backend="triton"), 5, 40, {"lion8bit_kernel": 7, "lion_small_kernel": 1}),
    "adamw8bit": (lambda: pf.adamw8bit(1e-5, weight_decay=0.01, backend="triton"), 26, 66,
                  {"adam8bit_kernel": 7, "sr_round_kernel": 1}),
}


@counting
@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_layer_group_step_launches_at_most(name, triton_runs):
    make, bound, host_bound, want_kernels = BOUNDS[name]
    ops, kernels = _layer_step_ops(make(), triton_runs)
    launching_ops = {op: n for op, n in ops.items() if op not in HOST_ONLY}
    n = launching(ops)
    # one fused kernel per 8-bit weight (Lion: and one for the four small leaves), nothing else
    assert dict(kernels) == want_kernels, kernels
    assert not SYNCS & set(ops), ops  # no host synchronisation inside backward
    assert n <= bound, f"{name}: {n} kernel-launching aten ops in one layer group step (bound {bound}): {launching_ops}"
    # per-leaf work is gone: no op runs once per parameter (11 in the layer) or per 8-bit weight (7)
    assert max(launching_ops.values()) <= 4, launching_ops
    # host-only dispatcher calls too (most are the 8-bit launchers' views: 5 (Lion) or 7 (AdamW)
    # per weight)
    assert sum(ops.values()) - n <= host_bound, ops


@counting
def test_grad_norm_costs_one_op_per_group(triton_runs):
    """track_grad_norm adds one multi-tensor norm per group (the per-tensor norm, square and
    add, reduced at once when the metrics are read)."""
    make = BOUNDS["lion8bit"][0]
    on, _ = _layer_step_ops(make(), triton_runs, track_grad_norm=True)
    off, _ = _layer_step_ops(make(), triton_runs, track_grad_norm=False)
    diff = on - off
    assert sum(diff.values()) == 1 and set(diff) == {"_foreach_norm"}, diff


# -- the cuts are exact: each cheaper formulation against the one it replaced ------------------


def test_sr_seeds_equal_per_leaf_seeds_and_stay_aligned():
    from pgs.func.kernels.fused_transform import sr_seed, sr_seeds

    for c in (0, 1, 12345, 2**31 - 2, 2**31 - 1):
        count = torch.tensor(c, dtype=torch.int32)
        for first in (0, 7, 400):
            seeds = sr_seeds(count, first, 11)
            assert torch.equal(seeds, torch.cat([sr_seed(count, first + i) for i in range(11)]))
            # one aligned pointer per seed, as a tensor per seed had (Triton specialises on it)
            assert all(s.data_ptr() % 16 == 0 for s in seeds.unbind(0))


def test_increment_pair_saturates_like_increment():
    from pgs.func._common import increment
    from pgs.func.kernels.fused_transform import increment_pair

    for a, b in ((0, 0), (5, 9), (2**31 - 2, 2**31 - 1), (2**31 - 1, 0)):
        ta, tb = torch.tensor(a, dtype=torch.int32), torch.tensor(b, dtype=torch.int32)
        na, nb = increment_pair(ta, tb)
        assert torch.equal(na, increment(ta)) and torch.equal(nb, increment(tb))
        assert na.dtype == nb.dtype == torch.int32 and na.shape == nb.shape == ()


def test_stochastic_rounding_equals_the_isfinite_formulation():
    """``x == x`` in place of ``isfinite``, and the cast left to a copy: the same bf16 words for
    every input, NaN payloads, ±inf and the largest finite values included."""
    from pgs.func.apply import stochastic_round_fp32, stochastic_round_to_bf16

    words = torch.tensor([0x7F800000, 0xFF800000 - 2**32, 0x7F7FFFFF, 0xFF7FFFFF - 2**32, 0x7FFFFFFF,
                          0x7F800001, 0xFF800001 - 2**32, 0x7FC00000, -1, 0, -2**31, 1, 0x7F7F8000],
                         dtype=torch.int32).view(torch.float32)
    x = torch.cat([words.repeat(500), torch.randn(4000) * 1e30, torch.randn(4000)])

    def before(x, gen):
        bits = x.view(torch.int32)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen)
        rounded = ((bits + noise) & -65536).view(torch.float32)
        return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)

    for seed in range(3):
        ref = before(x, torch.Generator().manual_seed(seed)).view(torch.int16)
        assert torch.equal(stochastic_round_to_bf16(x, torch.Generator().manual_seed(seed)).view(torch.int16), ref)
        y = x.clone()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        out.copy_(stochastic_round_fp32(y, torch.Generator().manual_seed(seed), inplace=True))
        assert torch.equal(out.view(torch.int16), ref)


def test_hp_tensor_takes_vector_values():
    from pgs.func.kernels.fused_transform import hp_tensor

    bc = torch.tensor([0.1, 0.0019], dtype=torch.float64)
    lr = torch.tensor(3e-5, dtype=torch.float64)
    got = hp_tensor(torch.device("cpu"), 0.1, 0.999, bc, lr, 0.01)
    want = torch.tensor([0.1, 0.999, 0.1, 0.0019, 3e-5, 0.01], dtype=torch.float64).to(torch.float32)
    assert torch.equal(got, want)


@pytest.mark.skipif(DEV == "cpu" and not INTERPRET, reason="needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("alias", ["lion8bit", "adamw8bit"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("lr", ["constant", "schedule"])
def test_small_leaves_in_place_equal_out_of_place(alias, wd, lr, monkeypatch):
    """With ``donate`` the small (fp32-state) leaves take the in-place multi-tensor route
    (Lion: ``small_inplace``; one multi-tensor copy in and out), without it the concatenated
    reference: the same bf16 parameters and moments bit for bit, stochastic rounding included
    (the same seeded draw per leaf), next to 8-bit leaves.  On a GPU this compares the
    multi-tensor kernels with the per-tensor ones.  (Lion's Triton route for small leaves,
    ``KernelConfig.small_kernel``, is off here: its arithmetic may contract into FMAs;
    test_small_kernel_route_matches.)  The global generator is reseeded between the two runs:
    the rounding must not read it."""
    from pgs.func import kernels as K

    monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(small_kernel=False))
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (64, 80), "n1": (100,), "n2": (3, 7), "n3": (32,)}
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()}
    steps = [{k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()} for _ in range(3)]
    rate = 1e-2 if lr == "constant" else (lambda c: 1e-2 / (1.0 + c.to(torch.float64)))
    opt = getattr(pf, alias)(rate, weight_decay=wd, backend="triton")

    def run(donate):
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        torch.manual_seed(5 + donate)
        for i, g in enumerate(steps):
            p, state = opt.fused_step(g, state, p, ctx=StepContext(sr_offset=2), donate=donate,
                                      memory=pf.MemoryOptions(stochastic_rounding=True))
        return p, pf.state_to_dict(state)

    (pa, sa), (pb, sb) = run(False), run(True)
    for k in shapes:
        assert torch.equal(pa[k].view(torch.int16), pb[k].view(torch.int16)), k
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="Triton: a GPU or the interpreter")
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_small_kernel_route_matches(wd, monkeypatch):
    """Lion's small leaves through one Triton launch (``KernelConfig.small_kernel``, in place) against the
    multi-tensor torch route: moments to an ulp of their operands (FMA contraction), bf16
    parameters bit for bit without stochastic rounding except where c = m + (1−β1)(g − m)
    sits within that ulp of 0 (sign flips: rare); with stochastic rounding the same: both
    routes draw the same noise (the step's seed, per-leaf offsets: ``stochastic_round_``), so
    the parameters differ only where those fp32 values do, by a bf16 ulp at most."""
    from pgs.func import kernels as K

    gen = torch.Generator().manual_seed(1)
    shapes = {"w": (64, 80), "n1": (100,), "n2": (3, 7), "n3": (32,), "n4": (5,)}  # 5 small: 2 launches
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()}
    steps = [{k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()} for _ in range(3)]
    opt = pf.lion8bit(1e-2, weight_decay=wd, backend="triton")

    def run(kernel, sr, n=3):
        monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(small_kernel=kernel))
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        for g in steps[:n]:
            p, state = opt.fused_step(g, state, p, ctx=StepContext(sr_offset=0), donate=True,
                                      memory=pf.MemoryOptions(stochastic_rounding=sr))
        return p, pf.state_to_dict(state)

    (pa, sa), (pb, sb) = run(False, False), run(True, False)
    small = [k for k in shapes if k != "w"]
    for k in small:
        diff = (pa[k].float() != pb[k].float()).float().mean().item()
        assert diff <= 0.02, f"{k}: {diff:.3f} of the parameters differ"
    for key in sa:
        if sa[key].dtype == torch.float32 and any(f".{k}" in key or key.endswith(k) for k in small):
            torch.testing.assert_close(sb[key], sa[key], rtol=1e-5, atol=1e-6)
    assert torch.equal(pa["w"], pb["w"])  # the 8-bit weight's kernel is the same either way
    (pc, _), (pd, _) = run(False, True), run(True, True)
    for k in small:
        assert not torch.equal(pd[k], params[k])
        diff = (pc[k].float() != pd[k].float()).float().mean().item()
        assert diff <= 0.02, f"{k}: {diff:.3f} of the stochastically rounded parameters differ"
        step = (pc[k].float() - pd[k].float()).abs()
        ulp = pc[k].float().abs() * 2.0**-7 + 1e-30
        assert bool((step <= 2 * ulp).all()), f"{k}: a stochastically rounded value is not a neighbour"
