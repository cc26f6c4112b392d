"""The fused step of ``chain(adagc, mona, scale_by_lion8bit, hyperball)`` (``pgs.func.fused_chain8bit``).

On CPU the three Triton passes run in Triton's interpreter (the root conftest sets
``TRITON_INTERPRET=1``); the lion stage asks for ``backend="triton"``.  The reference is the
generic flat path (``pf.compile(..., jit=False, fused=False)``).

Why the comparisons are exact: the fused passes reproduce every cast of the generic path
(ĝ, MONA's output and the hyperball delta rounded to the gradient's dtype, the buffers to
theirs, the parameter round-to-nearest), and the interpreter computes in fp32 without FMA
contraction, as torch's CPU kernels do.  What differs is the *order* of the per-tensor
sums (Σg² per block in Triton vs torch; ‖θ̃‖² expanded as ‖θ‖² − 2c⟨θ,u⟩ + c²‖u‖² instead
of summed from θ̃): a per-tensor scalar may move by an ulp (AdaGC's γ, tested with
rtol 1e-6), and an element then changes only when its fp32 value lies within that ulp of a
bf16 rounding boundary (probability ~1e-5 per element and step: one element of 23 000 in
the first test).  Such an element then stays apart by a random walk of single-ulp roundings
(θ and θ + ulp take the same steps but round independently): the bound below is 4 bf16 ulps
on ≤ 0.1% of the elements, ±1 code on ≤ 0.1% of the codes, one bf16 ulp of MONA's buffers
on ≤ 0.1% of their elements.  The small tensors' fp32 Lion momentum is ``torch.lerp`` in the reference, which
the CPU vectorises with an FMA: an ulp of its terms (1e-6 of the largest value).
"""

from __future__ import annotations

import attrs
import pytest
import torch

import pgs.func as pf
from pgs.func import fused_chain8bit as C
from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func.step import StepContext

pytestmark = pytest.mark.skipif(not K.triton_importable(), reason="needs triton")
#: on a GPU machine the same tests run the compiled kernels (FMA contraction on both sides:
#: the bounds below hold there too, with the fp32 test allowing rare outliers)
DEV = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = {
    "a.weight": (64, 96),  # 8-bit momentum, on the sphere
    "b.weight": (128, 64),
    "e.weight": (100, 63),  # 6300 elements: not a multiple of the 256-element block
    "s.weight": (16, 20),  # small matrix: fp32 momentum, on the sphere
    "n.weight": (64,),  # 1-D: fp32 momentum, not constrained (θ − η u)
    "big1d": (2000,),  # 1-D, 8-bit momentum, not constrained
}


def _stack(backend="triton", lr=1e-2, warmup_steps=2, mask=None, **mona_kw):
    return pf.chain(pf.adagc(warmup_steps=warmup_steps), pf.mona(**mona_kw),
                    pf.scale_by_lion8bit(min_8bit_size=1024, backend=backend), pf.hyperball(lr, mask=mask))


def _params(dtype=torch.bfloat16, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype).to(DEV) for k, s in shapes.items()}


def _grads(params, t, seed=1):
    g = torch.Generator().manual_seed(seed + 1000 * t)
    scale = 0.1 if t < 3 else 10.0  # after warmup: 10× the norms AdaGC remembers → clipped
    return {k: (torch.randn(v.shape, generator=g) * scale).to(v.dtype).to(DEV) for k, v in params.items()}


def _run(opt, params, steps, *, fused, donate=False, sr=False, seed=1):
    fast = pf.compile(opt, jit=False, fused=fused, donate=donate, memory=pf.MemoryOptions(stochastic_rounding=sr))
    p = {k: v.clone() for k, v in params.items()}
    s = fast.init(p)
    ran = _count_fused(fast)
    for t in range(steps):
        p, s = fast.step(_grads(params, t, seed), s, p)
    return p, s, len(ran)


def _count_fused(fast) -> list:
    """Wrap ``fast``'s fused plan so that every step it served is recorded; returns the record."""
    ran: list = []
    if fast.plan is not None:
        inner = fast.plan.step

        def counted(*a, **k):
            out = inner(*a, **k)
            if out is not None:
                ran.append(1)
            return out

        fast.plan = attrs.evolve(fast.plan, step=counted)
    return ran


def _assert_params_close(a, b, frac=1e-3, ulps=4):
    for k in a:
        x, y = a[k].float(), b[k].float()
        d = (x - y).abs()
        ulp = torch.maximum(x.abs(), y.abs()) * 2.0**-7  # ≥ one bf16 ulp
        assert bool((d <= ulps * ulp).all()), k
        assert (d > 0).float().mean().item() <= frac, k


def _assert_state_close(sa, sb, code_frac=1e-3):
    others = dict(T.leaves_with_paths(sb))
    for (path, x), (_, y) in zip(T.leaves_with_paths(sa), T.leaves_with_paths(sb)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        if x.dtype == torch.uint8:  # 8-bit codes
            d = (x.int() - y.int()).abs()
            assert int(d.max()) <= 1 and (d > 0).float().mean().item() <= code_frac, path
        elif x.dtype in (torch.int32, torch.int64, torch.float64) or "radius" in path:
            assert torch.equal(x, y), path  # counts, lr, hyperball radius
        elif x.dtype == torch.bfloat16:  # MONA buffers
            d = (x.float() - y.float()).abs()
            big = torch.maximum(x.float().abs(), y.float().abs())
            if DEV == "cpu":  # a bf16 ulp of the larger value (a rounding may cross a binade)
                assert bool((d <= big * 2.0**-7 + 1e-30).all()), path
                assert (d > 0).float().mean().item() <= 1e-3, path
            else:
                # on a GPU the kernel contracts β·A + (1−β)·Δ into an FMA and torch does not:
                # an ulp of the terms' fp32 rounding where the sum cancels (2^-22 of the buffer's
                # scale), carried through 5 steps of A (up to 4 bf16 ulps, as the parameters).
                # And where ĝ sits on a bf16 rounding boundary, an ulp of ĝ's fp32 value flips
                # ``prev = bf16(ĝ)`` by one bf16 ulp of ĝ: Δ = ĝ − prev then moves by up to
                # 2^-8·|ĝ|, and A by (1−β) of it per step (measured on an H200: 0.04% of A's
                # elements, off by 3.5e-6 where A = 6.9e-6).  Those outliers: ≤ 1e-3 of the
                # elements, each within 2 bf16 ulps of the largest stored ĝ (``prev``).
                floor = 2.0**-22 * float(big.max())
                over = d - 4 * big * 2.0**-7 - floor
                frac = (d > 0).float().mean().item()
                outliers = over > 0
                prev = others.get(path.replace(".acc.", ".prev."))
                flip = 2.0**-7 * float(prev.float().abs().max()) if prev is not None else 0.0
                why = (f"{path}: worst excess {float(over.max()):.3g} (d {float(d.flatten()[over.argmax()]):.3g}, "
                       f"value {float(big.flatten()[over.argmax()]):.3g}, floor {floor:.3g}, flip bound {flip:.3g}), "
                       f"{frac:.4f} of elements differ, {outliers.float().mean().item():.5f} beyond the ulp bound")
                assert outliers.float().mean().item() <= 1e-3, why
                assert bool((d[outliers] <= flip).all()), why
                assert frac <= 1e-2, why
        else:  # AdaGC γ, absmax, fp32 momenta (lerp's FMA: an ulp of the largest term)
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6 * float(x.abs().max()), msg=path)


@pytest.mark.parametrize("donate", [False, True], ids=["new-buffers", "donate"])
def test_fused_equals_generic_flat_path(donate):
    params = _params()
    opt = _stack()
    p_ref, s_ref, n_ref = _run(opt, params, 5, fused=False)
    p_fus, s_fus, n_fus = _run(opt, params, 5, fused=True, donate=donate)
    assert n_ref == 0 and n_fus == 5  # the fused path ran every step
    _assert_params_close(p_fus, p_ref)
    _assert_state_close(s_fus, s_ref)
    for k in params:
        assert not torch.equal(p_fus[k], params[k])


def test_hyperball_invariant_and_adagc_branches():
    """Constrained matrices keep ‖W_0‖; AdaGC clips in warmup (global norm > λ_abs = 1) and
    after it (10× larger gradients than γ remembers): ĝ = MONA's stored ``prev``."""
    params = _params()
    opt = _stack(warmup_steps=3)  # warmup: t = 0, 1
    fast = pf.compile(opt, jit=False)
    ran = _count_fused(fast)
    p = {k: v.clone() for k, v in params.items()}
    s = fast.init(p)
    flat_prev_key = "1_mona"
    for t in range(5):
        g = _grads(params, t)
        p, s = fast.step(g, s, p)
        prev = fast.unflatten(s[flat_prev_key].prev)
        ratio = {k: (prev[k].float().norm() / g[k].float().norm()).item() for k in g}
        if t < 2:  # warmup: one global factor λ_abs/‖g‖ < 1 for every tensor
            gn = sum(float(x.float().pow(2).sum()) for x in g.values()) ** 0.5
            assert gn > 1.0
            for r in ratio.values():
                assert r == pytest.approx(1.0 / gn, rel=1e-2)
        if t == 3:  # after warmup, the jump by 10× is clipped per tensor to ≤ λ_rel γ
            assert all(r < 0.5 for r in ratio.values())
        for k in params:
            if params[k].ndim >= 2:
                torch.testing.assert_close(p[k].float().norm(), params[k].float().norm(), rtol=2e-3, atol=0)
    assert len(ran) > 0


def test_fp32_params_and_unconstrained_matrix():
    params = _params(torch.float32, {"a.weight": (32, 40), "b.weight": (48, 30), "n": (50,)})
    opt = _stack(mask=lambda path, p: path != "b.weight", buffer_dtype=None)  # fp32 MONA buffers
    p_ref, s_ref, _ = _run(opt, params, 4, fused=False)
    p_fus, s_fus, n = _run(opt, params, 4, fused=True)
    assert n == 4
    for k in params:
        if DEV == "cpu":
            torch.testing.assert_close(p_fus[k], p_ref[k], rtol=1e-6, atol=1e-7)
        else:  # FMA contraction can flip the sign of a c ≈ 0: rare outliers
            bad = (p_fus[k] - p_ref[k]).abs() > 1e-5 * p_ref[k].abs() + 1e-6
            assert bad.float().mean().item() <= 1e-3, k
    if DEV == "cpu":
        _assert_state_close(s_fus, s_ref)


def _assert_identical(p1, s1, p2, s2):
    """Parameters and every state leaf bit for bit."""
    for k in p1:
        assert torch.equal(p1[k], p2[k]), k
    for (path, x), (_, y) in zip(T.leaves_with_paths(s1), T.leaves_with_paths(s2)):
        assert torch.equal(x, y), path


def test_chunked_launches_equal_one_launch(monkeypatch):
    """Groups above ``MAX_LAUNCH`` elements run as several launches over views (block_seg,
    partials and absmax sliced with them): same result as one launch."""
    params = _params()
    opt = _stack()
    p1, s1, _ = _run(opt, params, 3, fused=True)
    monkeypatch.setattr(K, "MAX_LAUNCH", 1024)
    p2, s2, n = _run(opt, params, 3, fused=True)
    assert n == 3
    _assert_identical(p1, s1, p2, s2)


def test_stochastic_rounding_brackets_nearest():
    """One step with stochastic rounding: every element is the round-to-nearest result or
    its bf16 neighbour; the same seed repeats, and some elements round the other way."""
    params = _params()
    opt = _stack()
    p_rn, _, _ = _run(opt, params, 1, fused=True)
    p_sr, _, n = _run(opt, params, 1, fused=True, sr=True)
    p_sr2, _, _ = _run(opt, params, 1, fused=True, sr=True)
    assert n == 1
    moved = 0
    for k in params:
        assert torch.equal(p_sr[k], p_sr2[k])
        d = (p_sr[k].float() - p_rn[k].float()).abs()
        assert bool((d <= p_rn[k].float().abs() * 2.0**-7 + 1e-30).all()), k
        moved += int((d > 0).sum())
    assert moved > 0


def test_falls_back_where_it_cannot_fuse():
    params = _params()
    # backend "auto" on CPU (no CUDA): the generic path, same result as fused=False
    if not torch.cuda.is_available():
        opt = _stack(backend="auto")
        p_a, _, n = _run(opt, params, 2, fused=True)
        p_b, _, _ = _run(opt, params, 2, fused=False)
        assert n == 0
        for k in params:
            assert torch.equal(p_a[k], p_b[k])
    # the torch backend, fp16 parameters: matched, but the step returns None
    assert _run(_stack(backend="torch"), params, 1, fused=True)[2] == 0
    half = _params(torch.float16, {"a.weight": (32, 40)})
    assert _run(_stack(), half, 1, fused=True)[2] == 0
    # not the pattern: no fused step at all
    assert C.match(_stack()) is not None
    assert C.match(pf.chain(pf.mona(), pf.adagc(), pf.scale_by_lion8bit(), pf.hyperball(1e-2))) is None
    assert C.match(pf.chain(pf.adagc(), pf.mona(), pf.scale_by_lion8bit(), pf.hyperball(1e-2),
                            pf.identity())) is None
    assert C.match(pf.chain(pf.adagc(), pf.mona(alpha=torch.tensor(0.9)), pf.scale_by_lion8bit(),
                            pf.hyperball(1e-2))) is None
    assert C.match(pf.chain(pf.adagc(), pf.mona(), pf.scale_by_lion8bit(quantize=False),
                            pf.hyperball(1e-2))) is None
    assert pf.compile(_stack(), fused=False).plan is None
    # a sharded binding (reduce_sum) or a layout whose align is not the block size
    step = C.match(_stack())
    fast = pf.compile(_stack(), jit=False)
    p = {k: v.clone() for k, v in params.items()}
    s = fast.init(p)
    fg, fp = fast.flatten(_grads(params, 0)), fast.flatten(p)
    assert step(fg, s, fp, ctx=StepContext(layout=fast.layout, reduce_sum=lambda x: x), donate=False,
                memory=pf.MemoryOptions(stochastic_rounding=False)) is None
    wide = pf.compile(_stack(), jit=False, align=512)
    s = wide.init(p)
    assert step(wide.flatten(_grads(params, 0)), s, wide.flatten(p), ctx=StepContext(layout=wide.layout),
                donate=False, memory=pf.MemoryOptions(stochastic_rounding=False)) is None


def test_schedule_learning_rate():
    """hyperball's η may be a schedule: read from its state's count, as the generic path does."""
    params = _params(shapes={"a.weight": (64, 40), "n": (40,)})
    opt = _stack(lr=pf.cosine_schedule(peak=1e-2, warmup=2, total=6))
    p_ref, s_ref, _ = _run(opt, params, 3, fused=False)
    p_fus, s_fus, n = _run(opt, params, 3, fused=True)
    assert n == 3
    _assert_params_close(p_fus, p_ref)
    _assert_state_close(s_fus, s_ref)
