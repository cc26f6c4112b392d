"""Stochastic rounding on the plain paths is a function of (updates, state, params).

``pf.apply_updates``, ``pf.compile``'s plain flat step, gradient release's plain apply and
Muon's torch route draw their noise from ``pgs.func.apply.sr_noise``: the 8-bit kernels' hash
stream (``blockwise8.sr_noise``) in torch ops, seeded by the chain state's step count and the
tensor's index.  Here: the same bits whatever torch's global generator did; unbiased over
steps (and round to nearest fails the same bound); the torch stream equals the Triton kernels'
(``kernels/small.py``'s ``stochastic_round_``, in Triton's interpreter on a CPU); another step,
another tensor or another seed draws other noise; a slabbed apply equals the whole one.
"""

from __future__ import annotations

import os

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func.apply import sr_noise, sr_seeds, step_count, stochastic_round_fp32

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _python_noise(seed: int, offset: int) -> int:
    """``blockwise8.sr_noise`` written out in Python integers (uint32 arithmetic by masking)."""
    m = 0xFFFFFFFF

    def h(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m
        x ^= x >> 15
        x = (x * 0x846CA68B) & m
        return x ^ (x >> 16)

    key = h((seed & m) ^ h(((seed >> 32) & m) ^ 0x9E3779B9))
    return h((offset & m) ^ key) >> 16


def _perturb_global(seed: int) -> None:
    torch.manual_seed(seed)
    torch.rand(999)
    torch.randint(0, 10, (77,))


def test_noise_is_the_kernels_hash_in_integers():
    """``sr_noise`` against the kernel's formula in Python integers: seeds with a high word,
    leaf offsets past 2^31 (leaf ≥ 128: the int32 offsets wrap as the kernel's do), a start."""
    for seed in (0, 7, 5 * 1_000_003 + 3 * 7919, (1 << 40) + 9, (1 << 62) + 12345):
        for leaf, start, n in ((0, 0, 300), (3, 11, 200), (200, 0, 100), (255, (1 << 24) - 50, 100)):
            got = sr_noise(torch.tensor([seed], dtype=torch.int64), n, leaf=leaf, start=start).tolist()
            want = [_python_noise(seed, leaf * (1 << 24) + start + e) for e in range(n)]
            assert got == want, f"seed {seed}, leaf {leaf}, start {start}"


@pytest.mark.skipif(not TRITON, reason="needs CUDA or Triton's interpreter")
def test_torch_noise_equals_the_triton_kernels_stream(monkeypatch):
    """``stochastic_round_fp32(x, seed=, leaf=)`` equals ``stochastic_round_([x], seed, first=leaf)``
    word for word (±inf, NaN included), for leaves past 2^31 in offset, over the launch split
    (``MAX_LAUNCH``, shrunk here: launch k > 0 has its own seed), and slab by slab (``start``)."""
    from pgs.func import kernels as K
    from pgs.func.kernels import small as S

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, generator=gen) * 3).to(DEV)
    x[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    for seed_value, leaf in ((3, 0), (5 * 1_000_003 + 4 * 7919, 2), ((1 << 45) + 1, 200)):
        seed = torch.tensor([seed_value], dtype=torch.int64, device=DEV)
        want = x.clone()
        S.stochastic_round_([want], seed, first=leaf)
        got = stochastic_round_fp32(x, seed=seed, leaf=leaf)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"leaf {leaf}"
    monkeypatch.setattr(K, "MAX_LAUNCH", 1024)
    seed = torch.tensor([99], dtype=torch.int64, device=DEV)
    want = x.clone()
    S.stochastic_round_([want], seed)
    got = stochastic_round_fp32(x, seed=seed)
    slabs = torch.cat([stochastic_round_fp32(x[lo:lo + 700], seed=seed, start=lo) for lo in range(0, 3000, 700)])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(slabs.view(torch.int32), want.view(torch.int32))


def _sgd_problem(n=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": (torch.randn(n, generator=gen) * 4).bfloat16(), "b": torch.randn(37, generator=gen).bfloat16()}
    grads = {k: torch.randn(v.shape, generator=gen).bfloat16() for k, v in params.items()}
    return params, grads


def test_apply_updates_ignores_the_global_generator_and_follows_the_step():
    """One (params, updates, state): the same bits after the global generator is reseeded and
    drawn from; the next step's state (count + 1), another first tensor index or the same step
    again with the other leaf order draws other noise."""
    params, grads = _sgd_problem()
    opt = pf.sgd(3e-3)
    u, s1 = opt.update(grads, opt.init(params), params)
    _perturb_global(0)
    a = pf.apply_updates(params, u, memory=pf.MemoryOptions(stochastic_rounding=True), state=s1)
    _perturb_global(1)
    b = pf.apply_updates(params, u, memory=pf.MemoryOptions(stochastic_rounding=True), state=s1)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in params)
    _, s2 = opt.update(grads, s1, params)
    assert int(step_count(s1)) == 1 and int(step_count(s2)) == 2
    c = pf.apply_updates(params, u, memory=pf.MemoryOptions(stochastic_rounding=True), state=s2)
    d = pf.apply_updates(params, u, memory=pf.MemoryOptions(stochastic_rounding=True), state=s1, first=5)
    near = pf.apply_updates(params, u)
    for k in params:
        assert not torch.equal(a[k], c[k]), f"{k}: step 2 drew step 1's noise"
        assert not torch.equal(a[k], d[k]), f"{k}: another tensor index drew the same noise"
        assert not torch.equal(a[k], near[k]), f"{k}: no rounding was decided"
    # the seeds themselves: one per (count, index), as the fused steps make them; leaf i of the
    # tree rounds as stochastic_round_fp32 with seed i does
    seeds = sr_seeds(step_count(s1), 0, 2)
    assert seeds.tolist() == [1_000_003 + 7919, 1_000_003 + 2 * 7919]
    assert not torch.equal(sr_noise(seeds[0], 512), sr_noise(seeds[1], 512))
    for i, k in enumerate(T.paths(params)):
        alone = stochastic_round_fp32(params[k].float() + u[k].float(), seed=seeds[i]).bfloat16()
        assert torch.equal(alone.view(torch.int16), a[k].view(torch.int16)), k


def _neighbours(x: torch.Tensor):
    lo = (x.view(torch.int32) & -65536).view(torch.float32)
    away = torch.full_like(x, float("inf")).copysign(x).bfloat16()
    hi = torch.nextafter(lo.bfloat16(), away).float()
    return lo, hi, (hi - lo).abs().double()


def test_apply_updates_is_unbiased_over_steps():
    """The same fp32 value θ + u rounded at 96 consecutive steps (the seed follows the chain's
    count): every result one of the two bf16 neighbours, and the mean within a few standard
    errors of θ + u.  Round to nearest, held to the same bound, fails it (it is off by ~¼ ulp)."""
    params, grads = _sgd_problem(seed=1)
    grads = {k: g.float() * 1.37 for k, g in grads.items()}  # fp32 u: θ + u rarely a bf16 value
    opt = pf.sgd(0.1)  # u of a few ulps: the discarded fractions spread over [0, 1)
    state = opt.init(params)
    u0, _ = opt.update(grads, state, params)  # the same direction at every step (no momentum)
    exact = {k: params[k].float() + u0[k].float() for k in params}
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in exact.items()}
    draws = 96
    for t in range(draws):
        u, state = opt.update(grads, state, params)
        _perturb_global(t)
        new = pf.apply_updates(params, u, memory=pf.MemoryOptions(stochastic_rounding=True), state=state)
        for k, x in exact.items():
            lo, hi, _ = _neighbours(x)
            y = new[k].float()
            assert bool(((y == lo) | (y == hi)).all()), f"{k}: a result is not a neighbour of θ + u"
            total[k] += y.double()
    assert int(step_count(state)) == draws
    for k, x in exact.items():
        lo, _, ulp = _neighbours(x)
        moved = lo != x
        assert float(moved.float().mean()) > 0.9
        err = ((total[k] / draws - x.double()).abs() / ulp)[moved]
        nearest = ((x.bfloat16().double() - x.double()).abs() / ulp)[moved]
        # E|mean − x| ≤ ulp·√(f(1−f)/96)·√(2/π) ≤ 0.041 ulp per element
        assert float(err.mean()) < 0.09, f"{k}: biased, mean |error| {float(err.mean()):.3f} ulp"
        assert float(nearest.mean()) > 0.09, "the bound does not tell rounding to nearest apart"


def test_flat_step_ignores_the_global_generator_and_follows_the_count():
    """``pf.compile``'s plain flat step (a chain without a fused plan): the same parameters from
    one state whatever the global generator did; the next step rounds with other noise."""
    params, grads = _sgd_problem(seed=2)
    fc = pf.compile(pf.sgd(1e-3, momentum=0.9), jit=False, memory=pf.MemoryOptions(stochastic_rounding=True))
    state = fc.init(params)
    _perturb_global(0)
    a, s1 = fc.step(grads, state, params)
    _perturb_global(1)
    b, _ = fc.step(grads, state, params)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in params)
    plain = pf.compile(pf.sgd(1e-3, momentum=0.9), jit=False)
    near, _ = plain.step(grads, plain.init(params), params)
    assert any(not torch.equal(a[k], near[k]) for k in params)
    c, _ = fc.step(grads, s1, a)
    d, _ = fc.step(grads, s1, a)
    assert all(torch.equal(c[k], d[k]) for k in params)


def test_missing_seed_source_is_refused():
    params, grads = _sgd_problem()
    with pytest.raises(InvalidArgument, match="state="):
        pf.apply_updates(params, grads, memory=pf.MemoryOptions(stochastic_rounding=True))
    with pytest.raises(InvalidArgument, match="no 'count'"):
        pf.apply_updates(params, grads, memory=pf.MemoryOptions(stochastic_rounding=True), state={"mini_step": torch.tensor(3)})
    with pytest.raises(InvalidArgument, match="exactly one"):
        stochastic_round_fp32(params["w"].float())
    # fp32 parameters need no seed; an explicit generator is still taken
    assert pf.apply_updates({"w": params["w"].float()}, {"w": grads["w"]}, memory=pf.MemoryOptions(stochastic_rounding=True))["w"].dtype \
        == torch.float32
    out = pf.apply_updates(params, grads, memory=pf.MemoryOptions(stochastic_rounding=True), generator=torch.Generator().manual_seed(0))
    assert out["w"].dtype == torch.bfloat16
    # accumulate's mini_step is not the step counter: the inner chain's count is
    acc = pf.accumulate(pf.sgd(1e-3), every=2)
    assert step_count(acc.init(params)) is not None


def test_release_plain_path_is_pure_and_slabs_round_as_one():
    """GradientRelease's plain path (``fused=False``) with bf16 weights and stochastic rounding:
    two trainings with the global generator reseeded and drawn from differently give the same
    bits, with the apply in 100-element slabs or whole (each slab draws its part of the
    tensor's stream); and the rounding decided something (round to nearest differs)."""
    from test_release import batches, loss_of, tiny_model

    from pgs.runtime.optim.release import GradientRelease

    def train(global_seed, sr=True, **kw):
        model = tiny_model(torch.bfloat16)
        rel = GradientRelease(pf.lion(1e-3, weight_decay=0.1), model, memory=pf.MemoryOptions(stochastic_rounding=sr), fused=False, **kw)
        for i, ids in enumerate(batches(3)):
            _perturb_global(global_seed + i)
            loss_of(model, ids).backward()
        assert rel.plain_group_steps > 0 and rel.fused_group_steps == 0
        rel.remove()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b, near = train(0), train(50, apply_chunk=100), train(0, sr=False)
    for n in a:
        assert torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)), n
    assert any(not torch.equal(a[n], near[n]) for n in a)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or Triton's interpreter")
def test_muon_torch_route_rounds_as_the_triton_route(monkeypatch):
    """``muon.round_to_bf16`` where no Triton runs (torch ops) gives the words the Triton route
    (``stochastic_round_``) gives, for the same seed and leaf."""
    import pgs.func.muon_direction as M
    from pgs.func.kernels import small as S
    from pgs.func.kernels.fused_transform import sr_seed

    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)).to(DEV) * 2
    seed = sr_seed(torch.tensor(7, dtype=torch.int32, device=DEV), 1)
    via_triton = M.round_to_bf16(x.clone(), seed, 2)
    monkeypatch.setattr(S, "usable_for", lambda t: False)
    _perturb_global(4)
    via_torch = M.round_to_bf16(x.clone(), seed, 2)
    assert torch.equal(via_triton.view(torch.int16), via_torch.view(torch.int16))
    assert not torch.equal(via_torch, x.bfloat16())


def test_compiled_noise_equals_eager():
    """Under ``torch.compile`` (``pf.compile(jit=True)``'s plain flat step) the int32 hash fuses
    into one kernel and still draws the eager words: wrapping multiplication, masked shifts."""
    seed = torch.tensor([3 * 1_000_003 + 7919], dtype=torch.int64)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6)) * 3
    eager = stochastic_round_fp32(x, seed=seed, start=123)
    compiled = torch.compile(lambda x, s: stochastic_round_fp32(x, seed=s, start=123), fullgraph=True)(x, seed)
    assert torch.equal(eager.view(torch.int32), compiled.view(torch.int32))


def test_sharded_apply_rounds_each_shard_as_the_whole_tensor():
    """``bind_sharded``'s plain apply on FSDP2's Shard(0) pieces (rank r: rows from r·⌈rows/world⌉,
    torch.chunk's split, the last rank short or empty) draws each shard's part of the whole
    tensor's stream: the ranks' results put together equal one process's ``apply_updates``.
    The ranks are simulated in one process (the binder's apply reads only rank, world, shapes)."""
    from pgs.runtime.optim.sharded_bind import ShardedBoundOptimizer

    gen = torch.Generator().manual_seed(8)
    shapes = {"a": (7, 5), "b": (3, 4), "c": (10,)}
    full = {k: (torch.randn(s, generator=gen) * 3).bfloat16() for k, s in shapes.items()}
    ups = {k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()}
    opt = pf.sgd(1e-3)
    state = opt.init(full)
    _, state = opt.update(ups, state, full)
    want = pf.apply_updates(full, ups, memory=pf.MemoryOptions(stochastic_rounding=True), state=state)
    world = 4
    pieces: dict[str, list] = {k: [] for k in shapes}
    for rank in range(world):
        binder = ShardedBoundOptimizer.__new__(ShardedBoundOptimizer)
        binder.params, binder.memory = full, pf.MemoryOptions(stochastic_rounding=True)
        binder.group, binder.world, binder.rank = object(), world, rank
        local = {k: v.chunk(world)[rank] if rank < len(v.chunk(world)) else v[:0] for k, v in full.items()}
        local_u = {k: v.chunk(world)[rank] if rank < len(v.chunk(world)) else v[:0] for k, v in ups.items()}
        got = binder._apply(local, local_u, state)
        for k in shapes:
            pieces[k].append(got[k])
    for k in shapes:
        assert torch.equal(torch.cat(pieces[k]).view(torch.int16), want[k].view(torch.int16)), k


def test_release_plain_path_resumes_exactly_from_a_state_dict():
    """bf16 weights, stochastic rounding, the plain path: two steps, ``state_dict``, a fresh
    release on a fresh model loaded from it, a third step (the global generator drawn from
    differently) equals three uninterrupted steps bit for bit: the counts in the state are
    the whole seed."""
    from test_release import batches, loss_of, tiny_model

    from pgs.runtime.optim.release import GradientRelease

    def chain():
        return pf.lion(1e-3, weight_decay=0.1)

    data = batches(3)
    a, b = tiny_model(torch.bfloat16), tiny_model(torch.bfloat16)
    rel_a = GradientRelease(chain(), a, memory=pf.MemoryOptions(stochastic_rounding=True), fused=False)
    for i, ids in enumerate(data):
        _perturb_global(i)
        loss_of(a, ids).backward()
    rel_b = GradientRelease(chain(), b, memory=pf.MemoryOptions(stochastic_rounding=True), fused=False)
    for ids in data[:2]:
        loss_of(b, ids).backward()
    saved, weights = rel_b.state_dict(), {k: v.clone() for k, v in b.state_dict().items()}
    rel_a.remove()
    rel_b.remove()
    c = tiny_model(torch.bfloat16, seed=5)
    c.load_state_dict(weights)
    resumed = GradientRelease(chain(), c, memory=pf.MemoryOptions(stochastic_rounding=True), fused=False)
    resumed.load_state_dict(saved)
    _perturb_global(99)
    loss_of(c, data[2]).backward()
    assert resumed.plain_group_steps > 0
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), n
