"""``pgs.func.kernels.small``: Lion on the small fp32-state leaves, several leaves per launch.

Runs in Triton's CPU interpreter here (the root conftest sets TRITON_INTERPRET=1 without CUDA)
and on a GPU when there is one.  Reference: the torch ops of the 8-bit chains' small-leaf path
(``lerp``, ``sign``, ``p − η(u + λp)`` in fp32, then the cast).
"""

import pytest
import torch

from pgs.func.kernels import small as S

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not S.HAVE_TRITON, reason="needs triton")


def _leaves(shapes, pdtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gs = [torch.randn(s, generator=gen).to(pdtype).to(DEV) for s in shapes]
    ps = [torch.randn(s, generator=gen).to(pdtype).to(DEV) for s in shapes]
    ms = [(torch.randn(s, generator=gen) * 0.1).to(DEV) for s in shapes]
    return gs, ps, ms


def _reference(gs, ps, ms, b1, b2, lr, wd):
    out_p, out_m, out_x = [], [], []
    for g, p, m in zip(gs, ps, ms):
        g32 = g.float()
        u = m.lerp(g32, 1 - b1).sign()
        out_m.append(m.lerp(g32, 1 - b2))
        p32 = p.float()
        x = p32 - lr * (u + wd * p32)
        out_x.append(x)
        out_p.append(x.to(p.dtype))
    return out_p, out_m, out_x


def _hp(b1, b2, lr, wd):
    return torch.tensor([1 - b1, 1 - b2, lr, wd], dtype=torch.float64).float().to(DEV)


# five leaves: two launches (MAX_LEAVES = 4); sizes across BLOCK boundaries; a 1-element leaf
SHAPES = [(128,), (32,), (2560,), (3, 700), (1,)]


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b1", [0.9, 0.3])  # 1 − β1 below and above ½: both formulas of lerp
def test_matches_torch_reference(pdtype, b1):
    gs, ps, ms = _leaves(SHAPES, pdtype)
    gs[2][5] = float("nan")  # a NaN gradient: c is NaN, sign gives 0, m becomes NaN
    want_p, want_m, _ = _reference(gs, ps, ms, b1, 0.99, 1e-2, 0.1)
    P, M = [p.clone() for p in ps], [m.clone() for m in ms]
    assert S.usable(gs, P, M)
    S.lion_small_(gs, P, M, _hp(b1, 0.99, 1e-2, 0.1), None)
    for a, b, m, g in zip(M, want_m, ms, gs):
        # an ulp of the terms (the interpreter does not contract a·b + c into an fma; m + w(g − m)
        # may cancel, so the bound is on the operands' size, not the result's)
        bound = 2.4e-7 * (m.abs() + g.float().abs())
        same_nan = a.isnan() == b.isnan()
        assert bool(same_nan.all()) and bool(((a - b).abs() <= bound)[~a.isnan()].all())
    for i, (a, b) in enumerate(zip(P, want_p)):
        if pdtype == torch.bfloat16:
            assert torch.equal(a, b), f"leaf {i}: bf16 parameters differ from round-to-nearest"
        else:  # fp32: FMA contraction of η(u + λp) on a GPU (H200: 4.5e-7 relative, 2.9e-10 absolute)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert not torch.equal(P[0], ps[0])


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    shapes = [(4096,), (1000,)]
    gs, ps, ms = _leaves(shapes, seed=1)
    _, _, want_x = _reference(gs, ps, ms, 0.9, 0.99, 3e-3, 0.0)
    total = [torch.zeros(s, dtype=torch.float64, device=DEV) for s in shapes]
    draws = 64
    for k in range(draws):
        P, M = [p.clone() for p in ps], [m.clone() for m in ms]
        S.lion_small_(gs, P, M, _hp(0.9, 0.99, 3e-3, 0.0), torch.tensor([1000 + k], dtype=torch.int64, device=DEV))
        for t, p, x in zip(total, P, want_x):
            lo = (x.view(torch.int32) & -65536).view(torch.float32)  # toward zero
            hi = torch.where(x >= 0, torch.nextafter(lo.bfloat16(), torch.tensor(float("inf"), device=DEV).bfloat16()).float(),
                             torch.nextafter(lo.bfloat16(), torch.tensor(-float("inf"), device=DEV).bfloat16()).float())
            pf = p.float()
            exact = lo == x
            assert bool(((pf == lo) | ((pf == hi) & ~exact)).all()), "a rounded value is not a neighbour of x"
            t += pf.double()
    for t, x in zip(total, want_x):
        err = (t / draws - x.double()).abs()
        ulp = (torch.nextafter(x.bfloat16(), torch.tensor(float("inf"), device=DEV).bfloat16()).float() - x.bfloat16().float()).abs().double()
        # mean of 64 draws: within ~4 standard errors (ulp/2/sqrt(64)) on average over the leaf
        assert float((err / ulp).mean()) < 0.15, "stochastic rounding is biased"


def test_seed_and_leaf_index_pick_the_noise():
    gs, ps, ms = _leaves([(2048,)] * 2, seed=2)
    hp = _hp(0.9, 0.99, 3e-3, 0.0)

    def run(seed, first):
        P, M = [p.clone() for p in ps], [m.clone() for m in ms]
        S.lion_small_(gs, P, M, hp, torch.tensor([seed], dtype=torch.int64, device=DEV), first=first)
        return P

    a, b, c = run(1, 0), run(1, 0), run(2, 0)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "same seed, same leaves: another draw"
    assert not torch.equal(a[0], c[0]), "another seed drew the same noise"
    d = run(1, 1)  # leaf 0 now draws leaf 1's stream
    assert torch.equal(d[0], a[1]) is False and not torch.equal(d[0], a[0])


def test_usable_refuses_what_it_cannot_step():
    gs, ps, ms = _leaves([(16,), (8,)])
    assert S.usable(gs, ps, ms)
    assert not S.usable(gs, ps, [m.bfloat16() for m in ms]), "non-fp32 moments"
    assert not S.usable(gs, [ps[0], ps[1].float()], ms), "mixed parameter dtypes"
    assert not S.usable([gs[0].t() if gs[0].dim() > 1 else gs[0][::2], gs[1]], ps, ms), "non-contiguous / shape"
    assert not S.usable([], [], [])


def test_stochastic_round_draws_the_small_kernels_noise():
    """``stochastic_round_`` (the 8-bit chains' torch route for small leaves) rounds the fp32
    values ``lion_small_`` computes exactly as ``lion_small_`` rounds them: the same seed, the
    same per-leaf offsets (and first-leaf index), over more leaves than one launch takes."""
    shapes = [(128,), (32,), (2560,), (3, 700), (1,)]
    gs, ps, ms = _leaves(shapes, seed=3)
    _, _, want_x = _reference(gs, ps, ms, 0.9, 0.99, 3e-3, 0.1)
    for first in (0, 2):
        seed = torch.tensor([77 + first], dtype=torch.int64, device=DEV)
        P, M = [p.clone() for p in ps], [m.clone() for m in ms]
        S.lion_small_(gs, P, M, _hp(0.9, 0.99, 3e-3, 0.1), seed, first=first)
        xs = [x.clone() for x in want_x]
        S.stochastic_round_(xs, seed, first=first)
        for i, (x, p, x0) in enumerate(zip(xs, P, want_x)):
            assert torch.equal(x, x.bfloat16().float()), f"leaf {i}: not a bf16 value"
            # equal words except where the kernel's fp32 value before rounding is another
            # (FMA contraction on a GPU: rare); none on the interpreter
            same = (x.bfloat16().view(torch.int16) == p.view(torch.int16)).float().mean().item()
            assert same >= (0.99 if DEV == "cuda" else 1.0), f"leaf {i}, first {first}: {same:.4f} equal"
            assert not torch.equal(x, x0)


def test_stochastic_round_is_unbiased_and_follows_the_seed():
    """Mean over 128 seeds within a few standard errors of the exact fp32 value (round to
    nearest is off by ~¼ ulp on average and fails this; truncation by ~½), each result one of
    the two bf16 neighbours; a non-contiguous buffer is rounded in place like a contiguous one."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3000, generator=gen) * 4).to(DEV)
    x[:5] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, 1.0])
    lo = (x.view(torch.int32) & -65536).view(torch.float32)
    ulp = (torch.nextafter(lo.abs().bfloat16(), torch.tensor(float("inf"), device=DEV).bfloat16()).float()
           - lo.abs()).double()
    draws, total = 128, torch.zeros_like(x, dtype=torch.float64)
    for s in range(draws):
        y = x.clone()
        S.stochastic_round_([y], torch.tensor([s], dtype=torch.int64, device=DEV))
        fin = torch.isfinite(x)
        assert bool(((y == lo) | ((y - lo).abs().double() == ulp))[fin].all()), "not a neighbour"
        assert torch.equal(y[:5].isnan(), x[:5].isnan()) and torch.equal(y[:2], x[:2])
        total += y.double()
        if s == 0:
            first = y.clone()
    assert not torch.equal(first, y)  # another seed, another draw
    err = ((total / draws - x.double()).abs() / ulp)[5:]
    # E|mean − x| ≤ ulp·√(f(1−f)/128)·√(2/π) ≤ 0.036 ulp per element
    assert float(err.mean()) < 0.08, f"biased: mean |error| {float(err.mean()):.3f} ulp"
    # the same seed twice: the same bits; a transposed (non-contiguous) view: rounded in place
    a, b = x.clone(), x.clone()
    seed = torch.tensor([9], dtype=torch.int64, device=DEV)
    S.stochastic_round_([a], seed)
    S.stochastic_round_([b], seed)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    m = x[5:2980].reshape(35, 85).clone().t()
    c = m.contiguous()
    S.stochastic_round_([m], seed)
    S.stochastic_round_([c], seed)
    assert torch.equal(m, c) and not torch.equal(m, x[5:2980].reshape(35, 85).t())


def test_stochastic_round_splits_a_tensor_over_max_launch(monkeypatch):
    """A tensor over ``MAX_LAUNCH`` elements (int32 offsets) is rounded in pieces: the first
    piece draws what an unsplit launch draws, the later ones their own streams
    (``_chunk_seed``); every value stays a bf16 neighbour, next to a small tensor in the same call."""
    from pgs.func import kernels as K

    gen = torch.Generator().manual_seed(5)
    big, small = torch.randn(5000, generator=gen).to(DEV), torch.randn(300, generator=gen).to(DEV)
    seed = torch.tensor([11], dtype=torch.int64, device=DEV)
    whole = [big.clone(), small.clone()]
    S.stochastic_round_(whole, seed)
    monkeypatch.setattr(K, "MAX_LAUNCH", 2048)
    parts = [big.clone(), small.clone()]
    S.stochastic_round_(parts, seed)
    assert torch.equal(parts[0][:2048], whole[0][:2048]) and torch.equal(parts[1], whole[1])
    assert not torch.equal(parts[0][2048:], whole[0][2048:])
    for x, y in ((big, parts[0]), (small, parts[1])):
        assert torch.equal(y, y.bfloat16().float())
        assert bool(((y - x).abs() <= x.abs() * 2.0**-7).all())
    again = [big.clone(), small.clone()]
    S.stochastic_round_(again, seed)
    assert all(torch.equal(a, b) for a, b in zip(again, parts))
