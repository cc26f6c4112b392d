"""Invariants of the research transforms (A1-A3, A6-A11: the labels of docs/techniques/README.md), as hypothesis properties.

Each test names the invariant it checks.  Matrices are small (≤ 24 per side) so that the
folder stays fast on 2 CPU cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.func.muon_direction import newton_schulz

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

seeds = st.integers(0, 2**31 - 1)
dims = st.integers(2, 24)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(seed, *shape, dtype=F32):
    return torch.randn(*shape, generator=gen(seed), dtype=F64).to(dtype)


# ----------------------------------------------------------------------------------------
# A1 Hyperball


def _hb_run(opt, params, grads):
    state = opt.init(params)
    history = []
    for g in grads:
        u, state = opt.update(g, state, params)
        params = pf.apply_updates(params, u)
        history.append(params)
    return history


@given(seed=seeds, m=dims, n=dims, lr=st.sampled_from([1e-3, 0.01, 0.1, 0.5]),
       scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3, 1e6]), base=st.sampled_from(["raw", "adam", "lion"]))
def test_hyperball_norm_stays_R_after_every_step(seed, m, n, lr, scale, base):
    """A1.1: ‖W_t‖_F == R after every step, for any gradient sequence (scaled by 1e±6)."""
    params = {"w": randn(seed, m, n), "b": randn(seed + 1, n)}
    R = params["w"].norm()
    first = {"raw": pf.identity(), "adam": pf.scale_by_adam(), "lion": pf.scale_by_lion()}[base]
    opt = pf.chain(first, pf.hyperball(lr))
    grads = [{"w": randn(seed + 2 + i, m, n) * scale, "b": randn(seed + 9 + i, n) * scale} for i in range(5)]
    for p in _hb_run(opt, params, grads):
        torch.testing.assert_close(p["w"].norm(), R, rtol=2e-6, atol=0)


@given(seed=seeds, m=dims, n=dims, k=st.integers(-20, 20), c=st.floats(1e-3, 1e3))
def test_hyperball_update_scale_invariance(seed, m, n, k, c):
    """A1.2: u → c·u (c > 0) gives the same W_{t+1}; bit-identical for c a power of two."""
    W = {"w": randn(seed, m, n)}
    u = {"w": randn(seed + 1, m, n)}
    hb = pf.hyperball(0.05)
    s = hb.init(W)
    ref, _ = hb.update(u, s, W)
    two, _ = hb.update({"w": u["w"] * 2.0**k}, s, W)
    assert torch.equal(two["w"], ref["w"])
    anyc, _ = hb.update({"w": u["w"] * c}, s, W)
    torch.testing.assert_close(anyc["w"], ref["w"], rtol=0, atol=1e-6 * float(W["w"].abs().max()))


@given(seed=seeds, m=dims, n=dims, c=st.floats(1e-3, 1e3), sign=st.sampled_from([1.0, -1.0]),
       lr=st.floats(0.0, 0.9))
def test_hyperball_radial_update_is_a_no_op(seed, m, n, c, sign, lr):
    """A1.3: u = c·W (η < 1) leaves W unchanged."""
    W = {"w": randn(seed, m, n)}
    hb = pf.hyperball(lr)
    u, _ = hb.update({"w": W["w"] * (sign * c)}, hb.init(W), W)
    assert float(u["w"].abs().max()) <= 1e-6 * float(W["w"].abs().max())


@given(seed=seeds, m=dims, n=dims, lr=st.floats(1e-4, 2.0))
def test_hyperball_tangent_step_rotates_by_arctan_lr(seed, m, n, lr):
    """A1.4/5: the pre-projection step has length ηR; a tangent u rotates W by arctan(η)."""
    W = randn(seed, m, n, dtype=F64)
    u = randn(seed + 1, m, n, dtype=F64)
    u = u - (u * W).sum() / (W * W).sum() * W  # ⟨u, W⟩ = 0
    hb = pf.hyperball(lr)
    d, _ = hb.update({"w": u}, hb.init({"w": W}), {"w": W})
    W1 = W + d["w"]
    cos = (W1 * W).sum() / (W1.norm() * W.norm())
    assert abs(math.acos(min(1.0, float(cos))) - math.atan(lr)) < 1e-6


@given(seed=seeds, m=dims, n=dims)
def test_hyperball_zero_lr_never_moves_and_vectors_follow_the_base_rule(seed, m, n):
    """A1.6: η = 0 leaves W unchanged.  A1.7: non-matrix leaves get −η u exactly."""
    P = {"w": randn(seed, m, n), "b": randn(seed + 1, n)}
    G = {"w": randn(seed + 2, m, n), "b": randn(seed + 3, n)}
    hb0 = pf.hyperball(0.0)
    u0, _ = hb0.update(G, hb0.init(P), P)
    assert torch.equal(u0["w"], torch.zeros_like(u0["w"]))
    hb = pf.hyperball(0.03, mask=lambda path, p: path != "w")
    u, _ = hb.update(G, hb.init(P), P)
    assert torch.equal(u["b"], (G["b"] * -torch.tensor(0.03, dtype=F64).to(F32)))
    assert torch.equal(u["w"], (G["w"] * -torch.tensor(0.03, dtype=F64).to(F32)))  # masked out


# ----------------------------------------------------------------------------------------
# A3 Muon: Newton-Schulz


@given(seed=seeds, m=dims, n=dims, k=st.integers(-10, 10), c=st.floats(1e-3, 1e3))
def test_ns_scale_invariance(seed, m, n, k, c):
    """A3.1: NS5(cG) == NS5(G) (bitwise in bf16 for c = 2^k; to 1e-4 in fp32 for any c > 0)."""
    G = randn(seed, m, n)
    assert torch.equal(newton_schulz(G * 2.0**k), newton_schulz(G))
    torch.testing.assert_close(newton_schulz(G * c, dtype=F32), newton_schulz(G, dtype=F32), rtol=0, atol=1e-4)


@given(seed=seeds, m=dims, n=dims, dtype=st.sampled_from([BF16, F32]))
def test_ns_transpose_equivariance(seed, m, n, dtype):
    """A3.2: NS5(Gᵀ) == NS5(G)ᵀ."""
    G = randn(seed, m, n)
    # non-square: the implementation takes the same wide orientation, so bf16 is bitwise;
    # square: X Xᵀ vs Xᵀ X round differently in bf16 (the ~1e-2 of docs/techniques/README.md)
    atol = 1e-5 if dtype == F32 else (0.0 if m != n else 3e-2)
    torch.testing.assert_close(newton_schulz(G.T.contiguous(), dtype=dtype), newton_schulz(G, dtype=dtype).T,
                               rtol=0, atol=atol)


@given(seed=seeds, m=dims, n=dims)
def test_ns_orthogonal_equivariance(seed, m, n):
    """A3.3: NS5(P G Q) == P NS5(G) Q for orthogonal P, Q (fp32 iteration)."""
    G = randn(seed, m, n)
    P, _ = torch.linalg.qr(randn(seed + 1, m, m, dtype=F64))
    Q, _ = torch.linalg.qr(randn(seed + 2, n, n, dtype=F64))
    P, Q = P.float(), Q.float()
    lhs = newton_schulz(P @ G @ Q, dtype=F32)
    rhs = P @ newton_schulz(G, dtype=F32) @ Q
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=2e-4)


@given(seed=seeds, m=dims, n=dims, dtype=st.sampled_from([BF16, F32]), cond=st.sampled_from([1.0, 1e2, 1e4]))
def test_ns_singular_values_in_0_1_21(seed, m, n, dtype, cond):
    """A3.4: singular values of NS5(G) lie in (0, 1.21]; singular vectors are G's."""
    U, _ = torch.linalg.qr(randn(seed, m, m, dtype=F64))
    V, _ = torch.linalg.qr(randn(seed + 1, n, n, dtype=F64))
    k = min(m, n)
    s = torch.logspace(0, -math.log10(cond), k, dtype=F64)
    G = (U[:, :k] * s) @ V[:, :k].T
    O = newton_schulz(G.float(), dtype=dtype).double()
    sv = torch.linalg.svdvals(O)
    assert float(sv.max()) <= 1.21
    assert float(sv[:k].min()) > 0
    if dtype == F32:  # same singular vectors: Uᵀ O V is diagonal
        D = U[:, :k].T @ O @ V[:, :k]
        off = D - torch.diag(torch.diagonal(D))
        assert float(off.abs().max()) < 1e-4


@given(seed=seeds, m=dims, n=dims, adjust=st.sampled_from(["original", "match_rms_adamw"]))
def test_muon_without_momentum_is_r_times_ns(seed, m, n, adjust):
    """A3.6: μ = 0, nesterov = False gives u = r·NS5(g) (and the batch equals one-at-a-time)."""
    g = {"a": randn(seed, m, n), "b": randn(seed + 1, m, n), "c": randn(seed + 2, n, m)}
    t = pf.scale_by_muon(momentum=0.0, nesterov=False, adjust_lr=adjust)
    u, _ = t.update(g, t.init(g))
    for k, x in g.items():
        rows, cols = x.shape
        ratio = math.sqrt(max(1, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
        torch.testing.assert_close(u[k], newton_schulz(x).float() * ratio, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# A2 MONA


@given(seed=seeds, m=dims, n=dims, beta=st.floats(0.0, 0.99), steps=st.integers(1, 4))
def test_mona_alpha_zero_is_the_base_transform(seed, m, n, beta, steps):
    """A2: α = 0 reduces exactly to the base (here Muon); so does a constant gradient (fp32 buffers)."""
    p = {"w": randn(seed, m, n)}
    grads = [{"w": randn(seed + i + 1, m, n)} for i in range(steps)]
    base = pf.scale_by_muon()
    off = pf.chain(pf.mona(0.0, beta), pf.scale_by_muon())
    const = pf.chain(pf.mona(0.7, beta, buffer_dtype=None), pf.scale_by_muon())
    sb, so, sc = base.init(p), off.init(p), const.init(p)
    for g in grads:
        ub, sb = base.update(g, sb)
        uo, so = off.update(g, so)
        assert torch.equal(ub["w"], uo["w"])
    sb = base.init(p)
    for _ in range(steps):
        ub, sb = base.update(grads[0], sb)
        uc, sc = const.update(grads[0], sc)
        assert torch.equal(ub["w"], uc["w"])


# ----------------------------------------------------------------------------------------
# A6 AdamC


@given(seed=seeds, lr=st.floats(1e-5, 1e-1), wd=st.floats(0.0, 0.5))
def test_adamc_constant_schedule_is_adamw(seed, lr, wd):
    """A6.1/2: a constant schedule gives AdamW bit for bit; non-normalized leaves are AdamW always."""
    p = {"h.w": randn(seed, 6, 5), "b": randn(seed + 1, 5), "embed": randn(seed + 2, 9, 5)}
    grads = [{k: randn(seed + 3 + i, *v.shape) for k, v in p.items()} for i in range(3)]
    for lr_arg in (lr, pf.constant_schedule(lr)):
        a, b = pf.adamc(lr_arg, weight_decay=wd, peak_lr=lr), pf.adamw(lr, weight_decay=wd)
        sa, sb = a.init(p), b.init(p)
        for g in grads:
            ua, sa = a.update(g, sa, p)
            ub, sb = b.update(g, sb, p)
            for k in p:
                assert torch.equal(ua[k], ub[k])
    sched = pf.cosine_schedule(peak=lr, warmup=2, total=6)
    a = pf.adamc(sched, weight_decay=wd, peak_lr=lr)
    b = pf.adamw(sched, weight_decay=wd)
    sa, sb = a.init(p), b.init(p)
    for g in grads:
        ua, sa = a.update(g, sa, p)
        ub, sb = b.update(g, sb, p)
        assert torch.equal(ua["b"], ub["b"]) and torch.equal(ua["embed"], ub["embed"])


def test_adamc_peak_from_schedule_and_refusal():
    sched = pf.cosine_schedule(peak=3e-4, warmup=10, total=100)
    assert abs(pf.schedule_peak(sched, horizon=100) - 3e-4) < 1e-12
    with pytest.raises(InvalidArgument):
        pf.adamc(sched)


# ----------------------------------------------------------------------------------------
# A7 SAGE


@given(seed=seeds, v=st.integers(2, 30), d=st.integers(1, 12), k=st.integers(-8, 8), steps=st.integers(1, 4))
def test_sage_damper_bounded_and_scale_invariant(seed, v, d, k, steps):
    """A7.1: 0 ≤ H ≤ 1 so |u| ≤ 1; A7.2: S is [1, d] for an embedding; A7.5: g → 2^k g is invariant."""
    p = {"embed": randn(seed, v, d), "b": randn(seed + 1, d)}
    t = pf.scale_by_sage(eps=1e-12)  # invariance holds up to ε
    s1, s2 = t.init(p), t.init(p)
    assert s1.s["embed"].shape == (1, d) and s1.s["b"].shape == (d,)
    for i in range(steps):
        g = {"embed": randn(seed + 2 + i, v, d) * (torch.rand(v, 1, generator=gen(seed + i)) < 0.5),
             "b": randn(seed + 9 + i, d)}
        u1, s1 = t.update(g, s1)
        u2, s2 = t.update({kk: x * 2.0**k for kk, x in g.items()}, s2)
        for kk in p:
            assert float(u1[kk].abs().max()) <= 1.0
            torch.testing.assert_close(u1[kk], u2[kk], rtol=1e-6, atol=1e-6)  # exact but for ε


@given(seed=seeds, v=st.integers(2, 20), d=st.integers(1, 8), steps=st.integers(1, 4))
def test_sage_equal_columns_is_lion(seed, v, d, steps):
    """A7.3: equal column statistics give H ≡ 1 (up to ε): canon SAGE equals Lion."""
    p = {"embed": torch.zeros(v, d)}
    sage, lion = pf.scale_by_sage(eps=0.0), pf.scale_by_lion(0.9, 0.99)
    ss, sl = sage.init(p), lion.init(p)
    for i in range(steps):
        signs = torch.where(torch.rand(v, d, generator=gen(seed + i)) < 0.5, -1.0, 1.0)
        g = {"embed": signs * float(i + 1)}  # every column has mean |g| = i + 1
        us, ss = sage.update(g, ss)
        ul, sl = lion.update(g, sl)
        torch.testing.assert_close(us["embed"], ul["embed"], rtol=0, atol=1e-6)  # H = 1 to rounding


# ----------------------------------------------------------------------------------------
# A8 AdaGC


@given(seed=seeds, spikes=st.lists(st.floats(1e-3, 1e3), min_size=6, max_size=6), j=st.floats(1e-3, 1e3))
def test_adagc_clip_bound_growth_and_per_tensor_independence(seed, spikes, j):
    """A8.1-3, 5: ‖ĝ‖ ≤ ‖g‖; after warmup ‖ĝ_i‖ ≤ λ_rel γ_{t−1} and γ_t ≤ (β+(1−β)λ_rel) γ_{t−1};
    rescaling one tensor's gradient does not change another's (after warmup)."""
    lam, beta = 1.05, 0.9
    t = pf.adagc(lambda_rel=lam, beta=beta, warmup_steps=3)
    shapes = {"a": (5, 4), "b": (7,)}
    p = {k: torch.zeros(s) for k, s in shapes.items()}
    s = t.init(p)
    for i, c in enumerate(spikes):
        g = {k: randn(seed + 10 * i + n, *sh) * (c if k == "a" else 1.0) for n, (k, sh) in enumerate(shapes.items())}
        u, s2 = t.update(g, s)
        after_warmup = i + 1 >= 3
        for k in shapes:
            nu, ng = float(u[k].norm()), float(g[k].norm())
            assert nu <= ng * (1 + 1e-6)
            if after_warmup:
                assert nu <= lam * float(s.gamma[k]) * (1 + 1e-5)
                assert float(s2.gamma[k]) <= (beta + (1 - beta) * lam) * float(s.gamma[k]) * (1 + 1e-5)
        if after_warmup:
            other, _ = t.update({"a": g["a"] * j, "b": g["b"]}, s)
            assert torch.equal(other["b"], u["b"])
        s = s2


# ----------------------------------------------------------------------------------------
# A9 ZClip


@given(seed=seeds, mags=st.lists(st.floats(0.1, 100.0), min_size=8, max_size=8), mode=st.sampled_from(["clip", "skip"]))
def test_zclip_untouched_below_threshold_clipped_above(seed, mags, mode):
    """A9.1-5: warmup and z ≤ z_thr pass through; a spike is rescaled below μ + z_thr σ
    (direction kept) or, in skip mode, zeroed with μ, σ untouched."""
    zt = 1.0
    t = pf.zclip(alpha=0.9, z_thresh=zt, warmup_steps=3, mode=mode)
    p = {"w": torch.zeros(4, 3)}
    s = t.init(p)
    for i, c in enumerate(mags):
        g = {"w": randn(seed + i, 4, 3)}
        g = {"w": g["w"] / g["w"].norm() * c}
        u, s2 = t.update(g, s)
        if i < 3:
            assert torch.equal(u["w"], g["w"]) and not bool(s2.spike)
        else:
            mu, sd = float(s.mean), math.sqrt(float(s.var))
            z = (c - mu) / (sd + 1e-6)
            if z <= zt - 1e-4:
                assert torch.equal(u["w"], g["w"]) and not bool(s2.spike)
            elif z > zt + 1e-4:
                assert bool(s2.spike)
                if mode == "skip":
                    assert torch.equal(u["w"], torch.zeros_like(u["w"]))
                    assert float(s2.mean) == float(s.mean) and float(s2.var) == float(s.var)
                    assert int(s2.skipped) == int(s.skipped) + 1
                else:
                    assert float(u["w"].norm()) < mu + zt * sd + 1e-4
                    cos = (u["w"] * g["w"]).sum() / (u["w"].norm() * g["w"].norm())
                    assert float(cos) > 1 - 1e-5
                    g_star = mu + zt * zt * sd / z
                    assert abs(float(s2.mean) - (0.9 * mu + 0.1 * g_star)) < 1e-4 * max(1.0, mu)
        s = s2


# ----------------------------------------------------------------------------------------
# A10 EMA


@given(seed=seeds, decay=st.floats(0.0, 1.0), steps=st.integers(1, 6))
def test_ema_copy_init_convexity_and_extremes(seed, decay, steps):
    """A10.1-3: δ = 0 copies, δ = 1 freezes; the EMA stays within [min_s θ_s, max_s θ_s]."""
    thetas = [{"w": randn(seed + i, 3, 4)} for i in range(steps)]
    e = pf.ema(decay)
    s = e.init(thetas[0])
    for th in thetas:
        avg, s = e.update(th, s)
    stack = torch.stack([t["w"] for t in thetas])
    out = pf.ema_params(s)["w"]
    assert bool((out >= stack.min(0).values - 1e-6).all() and (out <= stack.max(0).values + 1e-6).all())
    if decay == 0.0:
        assert torch.equal(out, thetas[-1]["w"])
    if decay == 1.0:
        assert torch.equal(out, thetas[0]["w"])  # copy-init, then frozen


@given(seed=seeds, decay=st.floats(0.5, 0.999), steps=st.integers(1, 6))
def test_ema_debiased_equals_weighted_average_and_constant_is_fixed(seed, decay, steps):
    """A10.2/4: the bias-corrected zero-init EMA is Σ(1−δ)δ^{t−s}θ_s/(1−δ^t); constant θ gives θ."""
    thetas = [randn(seed + i, 5, dtype=F64) for i in range(steps)]
    e = pf.ema(decay, debias=True)
    s = e.init({"w": thetas[0]})
    for th in thetas:
        _, s = e.update({"w": th}, s)
    t = len(thetas)
    want = sum((1 - decay) * decay ** (t - 1 - i) * th for i, th in enumerate(thetas)) / (1 - decay**t)
    torch.testing.assert_close(pf.ema_params(s)["w"].double(), want, rtol=1e-5, atol=1e-5)
    for debias in (False, True):
        e = pf.ema(decay, debias=debias)
        s = e.init({"w": thetas[0]})
        for _ in range(steps):
            _, s = e.update({"w": thetas[0]}, s)
        torch.testing.assert_close(pf.ema_params(s)["w"].double(), thetas[0].float().double(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# A11 merge-back


@given(seed=seeds, n=st.integers(2, 40), t=st.floats(0.0, 1.0))
def test_slerp_endpoints_symmetry_and_norm(seed, n, t):
    """A11.2-5: endpoints, slerp(t,a,b) = slerp(1−t,b,a), slerp(t,a,a) = a, norm kept for ‖a‖ = ‖b‖."""
    a, b = randn(seed, n), randn(seed + 1, n)
    torch.testing.assert_close(pf.slerp(0.0, a, b), a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pf.slerp(1.0, a, b), b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pf.slerp(t, a, b), pf.slerp(1.0 - t, b, a), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pf.slerp(t, a, a), a, rtol=1e-6, atol=1e-6)
    bn = b / b.norm() * a.norm()
    d = float((a / a.norm() * (bn / bn.norm())).sum())
    assume(abs(d) < 0.999)
    torch.testing.assert_close(pf.slerp(t, a, bn).norm(), a.norm(), rtol=1e-5, atol=0)


@given(seed=seeds, beta=st.floats(0.0, 1.0), method=st.sampled_from(["linear", "slerp"]))
def test_merge_back_identity_reset_and_linear_distance(seed, beta, method):
    """A11.1/6: β = 0 is the identity, β = 1 resets; linear: ‖θ' − θ_o‖ = (1−β)‖θ − θ_o‖."""
    theta = {"w": randn(seed, 4, 5), "b": randn(seed + 1, 5).to(BF16)}
    base = {"w": randn(seed + 2, 4, 5), "b": randn(seed + 3, 5).to(BF16)}
    same = pf.merge_back(theta, base, 0.0, method)
    reset = pf.merge_back(theta, base, 1.0, method)
    for k in theta:
        torch.testing.assert_close(same[k], theta[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reset[k], base[k], rtol=1e-5, atol=1e-6)
        assert same[k].dtype == theta[k].dtype
    if method == "linear":
        new = pf.merge_back(theta, base, beta, "linear")
        torch.testing.assert_close((new["w"] - base["w"]).norm(), (1 - beta) * (theta["w"] - base["w"]).norm(),
                                   rtol=1e-5, atol=1e-5)
