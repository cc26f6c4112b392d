"""Each research transform against a direct fp64 transcription of its equations (docs/techniques/; the
section labels A1-A11 are those of docs/techniques/README.md),
and ``pf.muon`` against ``torch.optim.Muon``."""

from __future__ import annotations

import math

import pytest
import torch

import pgs.func as pf

F64 = torch.float64


def rnd(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------- A3


def ns5_ref(G, a=3.4445, b=-4.7750, c=2.0315, eps=1e-7):
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / max(float(X.norm()), eps)
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


@pytest.mark.parametrize("nesterov", [True, False])
def test_scale_by_muon_matches_fp64_transcription(nesterov):
    shapes = {"q": (6, 10), "k": (10, 6), "conv": (4, 3, 2, 2)}
    params = {k: rnd(1, *s) for k, s in shapes.items()}
    t = pf.scale_by_muon(momentum=0.9, nesterov=nesterov, ns_dtype=F64, adjust_lr="original")
    s = t.init(params)
    B = {k: torch.zeros(*s_, dtype=F64) for k, s_ in shapes.items()}
    for step in range(4):
        g = {k: rnd(10 + step * 7 + i, *sh) for i, (k, sh) in enumerate(shapes.items())}
        u, s = t.update(g, s)
        for k in shapes:
            B[k] = 0.9 * B[k] + 0.1 * g[k]
            U = (0.1 * g[k] + 0.9 * B[k]) if nesterov else B[k]
            M = U.reshape(U.shape[0], -1)
            r = math.sqrt(max(1, M.shape[0] / M.shape[1]))
            close(u[k], (r * ns5_ref(M)).reshape(U.shape), 1e-9)


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_muon_matches_torch_optim_muon_over_20_steps(adjust):
    torch.manual_seed(0)
    shapes = {"layers.0.q": (32, 16), "layers.0.o": (16, 32), "layers.1.q": (32, 16), "layers.1.sq": (24, 24)}
    init = {k: torch.randn(*s) for k, s in shapes.items()}
    p = {k: v.clone() for k, v in init.items()}
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = pf.muon(0.02, weight_decay=0.1, adjust_lr=adjust)
    ref = torch.optim.Muon(list(tp.values()), lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    s = opt.init(p)
    for _ in range(20):
        g = {k: torch.randn_like(v) for k, v in p.items()}
        u, s = opt.update(g, s, p)
        p = pf.apply_updates(p, u)
        for k in tp:
            tp[k].grad = g[k].clone()
        ref.step()
    for k in p:  # bf16 Newton-Schulz on both sides; batching may round differently
        torch.testing.assert_close(p[k], tp[k].detach(), rtol=1e-2, atol=1e-3)


def test_muon_route():
    r = pf.muon_route
    assert r("model.layers.0.mlp.down_proj.weight", torch.empty(4, 8)) == "muon"
    assert r("model.layers.0.conv.weight", torch.empty(4, 3, 2)) == "muon"
    for path, shape in [("model.embed_tokens.weight", (9, 4)), ("lm_head.weight", (9, 4)), ("transformer.wte.weight", (9, 4)),
                        ("transformer.wpe.weight", (9, 4)), ("model.norm.weight", (4,)), ("layers.0.bias", (4,))]:
        assert r(path, torch.empty(shape)) == "fallback"


# ---------------------------------------------------------------------------------------- A1


def test_hyperball_matches_fp64_transcription():
    W = {"w": rnd(1, 5, 7), "b": rnd(2, 7)}
    R = float(W["w"].norm())
    hb = pf.hyperball(0.07)
    s = hb.init(W)
    for step in range(3):
        u = {"w": rnd(3 + step, 5, 7), "b": rnd(9 + step, 7)}
        d, s = hb.update(u, s, W)
        Wt = W["w"] - 0.07 * R * u["w"] / u["w"].norm()
        close(d["w"], R * Wt / Wt.norm() - W["w"], 1e-6)  # per-tensor norms are fp32
        close(d["b"], -0.07 * u["b"])
        W = pf.apply_updates(W, d)


# ---------------------------------------------------------------------------------------- A2


def test_mona_matches_fp64_transcription():
    alpha, beta = 0.6, 0.8
    t = pf.mona(alpha, beta, buffer_dtype=None)
    g0 = {"w": rnd(0, 4, 3)}
    s = t.init(g0)
    A = torch.zeros(4, 3, dtype=F64)
    prev = None
    for step in range(4):
        g = {"w": rnd(step + 1, 4, 3)}
        u, s = t.update(g, s)
        delta = torch.zeros_like(A) if prev is None else g["w"] - prev
        A = beta * A + (1 - beta) * delta
        close(u["w"], g["w"] + alpha * A)
        prev = g["w"]


# ---------------------------------------------------------------------------------------- A6


def test_adamc_matches_fp64_transcription():
    sched = pf.cosine_schedule(peak=1e-2, warmup=2, total=8, final=1e-3)
    peak, lam, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    p = {"h.w": rnd(1, 4, 3), "b": rnd(2, 3)}
    opt = pf.adamc(sched, b1, b2, eps, lam, peak_lr=peak)
    s = opt.init(p)
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    ref = {k: x.clone() for k, x in p.items()}
    for t in range(1, 7):
        g = {k: rnd(10 + t * 3 + i, *x.shape) for i, (k, x) in enumerate(p.items())}
        u, s = opt.update(g, s, p)
        p = pf.apply_updates(p, u)
        gamma = float(sched(torch.tensor(t - 1)))
        for k in ref:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            c = gamma**2 / peak if k == "h.w" else gamma
            ref[k] = ref[k] - gamma * (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps) - c * lam * ref[k]
    for k in p:
        close(p[k], ref[k], 1e-9)


# ---------------------------------------------------------------------------------------- A7


@pytest.mark.parametrize("order", ["canon", "official"])
def test_sage_matches_fp64_transcription(order):
    b1, b2, eps = 0.9, 0.99, 1e-8
    p = {"embed": rnd(1, 6, 4), "b": rnd(2, 4)}
    t = pf.scale_by_sage(b1, b2, eps, order=order)
    s = t.init(p)
    m = {k: torch.zeros_like(x) for k, x in p.items()}
    S = {"embed": torch.zeros(1, 4, dtype=F64), "b": torch.zeros(4, dtype=F64)}
    for step in range(1, 5):
        g = {k: rnd(20 + 3 * step + i, *x.shape) for i, (k, x) in enumerate(p.items())}
        u, s = t.update(g, s)
        for k in p:
            sk = g[k].abs().mean(0, keepdim=True) if k == "embed" else g[k].abs()
            S[k] = b2 * S[k] + (1 - b2) * sk
            Sh = S[k] / (1 - b2**step)
            H = torch.minimum(torch.minimum(Sh.square().mean().sqrt() / (Sh + eps), sk.square().mean().sqrt() / (sk + eps)),
                              torch.ones_like(Sh))
            m_new = b2 * m[k] + (1 - b2) * g[k]
            C = torch.sign(b1 * (m_new if order == "official" else m[k]) + (1 - b1) * g[k])
            close(u[k], C * H, 1e-6)  # S is kept in fp32
            m[k] = m_new


# ---------------------------------------------------------------------------------------- A8


def test_adagc_matches_fp64_transcription():
    lam_rel, beta, lam_abs, tw, eps = 1.05, 0.9, 1.0, 3, 1e-8
    t = pf.adagc(lam_rel, beta, lam_abs, tw, eps)
    shapes = {"a": (4, 3), "b": (5,)}
    s = t.init({k: torch.zeros(*x, dtype=F64) for k, x in shapes.items()})
    gamma = {}
    for step in range(1, 8):
        g = {k: rnd(step * 5 + i, *x) * (10.0 if step == 5 and k == "a" else 1.0) for i, (k, x) in enumerate(shapes.items())}
        u, s = t.update(g, s)
        gn = math.sqrt(sum(float(x.norm()) ** 2 for x in g.values()))
        for k in shapes:
            n = float(g[k].norm())
            if step < tw or step == 1:
                h = min(lam_abs / (gn + eps), 1.0)
                gamma[k] = h * n if step == 1 else min(gamma[k], h * n)
            else:
                h = min(lam_rel * gamma[k] / (n + eps), 1.0)
                gamma[k] = beta * gamma[k] + (1 - beta) * h * n
            close(u[k], h * g[k], 1e-6)  # norms in fp32
            assert abs(float(s.gamma[k]) - gamma[k]) <= 1e-6 * gamma[k]


# ---------------------------------------------------------------------------------------- A9


@pytest.mark.parametrize("mode", ["clip", "skip"])
def test_zclip_matches_fp64_transcription(mode):
    alpha, zt, W, eps, cap = 0.9, 1.5, 4, 1e-6, 30.0
    t = pf.zclip(alpha, zt, W, mode=mode, max_grad_norm=cap, eps=eps)
    s = t.init({"w": torch.zeros(3, 3, dtype=F64)})
    buf, mu, var, spikes = [], 0.0, 0.0, 0
    mags = [1.0, 1.2, 0.9, 1.1, 1.0, 8.0, 1.05, 40.0, 0.95, 1.3]
    for i, c in enumerate(mags):
        g = rnd(i, 3, 3)
        g = g / g.norm() * c
        u, s = t.update({"w": g}, s)
        gn = float(g.norm())
        spike = False
        if i < W:
            buf.append(gn)
            mu = sum(buf) / len(buf)
            var = sum((x - mu) ** 2 for x in buf) / len(buf)
            g_star = gn
        else:
            sd = math.sqrt(var)
            z = (gn - mu) / (sd + eps)
            spike = z > zt
            g_star = mu + zt * zt * sd / z if spike else gn
        eff = min(g_star, cap)
        scale = eff / (gn + eps) if gn > eff else 1.0
        if mode == "skip" and spike:
            scale = 0.0
        close(u["w"], g * scale, 1e-6)
        assert bool(s.spike) == spike
        spikes += spike
        if i >= W and not (mode == "skip" and spike):
            mu = alpha * mu + (1 - alpha) * g_star
            var = alpha * var + (1 - alpha) * (g_star - mu) ** 2
        assert abs(float(s.mean) - mu) <= 1e-5 * mu
    assert spikes >= 2 and int(s.skipped) == (spikes if mode == "skip" else 0)


# ---------------------------------------------------------------------------------------- A10, A11


def test_ema_matches_torch_averaged_model():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = torch.nn.Linear(3, 2)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    e = pf.ema(0.9)
    s = e.init(dict(model.named_parameters()))
    for i in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        avg.update_parameters(model)
        _, s = e.update({k: v.detach() for k, v in model.named_parameters()}, s)
    ours = pf.ema_params(s)
    for k, v in avg.module.named_parameters():
        torch.testing.assert_close(ours[k], v.detach(), rtol=1e-6, atol=1e-6)


def test_slerp_matches_fp64_transcription():
    a, b = rnd(1, 7, 3), rnd(2, 7, 3)
    for t in (0.0, 0.3, 0.75, 1.0):
        x, y = a.flatten() / a.norm(), b.flatten() / b.norm()
        om = math.acos(float((x * y).sum()))
        want = math.sin((1 - t) * om) / math.sin(om) * a + math.sin(t * om) / math.sin(om) * b
        close(pf.slerp(t, a, b), want, 1e-12)
    close(pf.slerp(0.4, a, 2 * a), 0.6 * a + 0.8 * a)  # colinear: lerp fallback
    merged = pf.merge_back({"w": b}, {"w": a}, 0.25, "slerp")
    close(merged["w"], pf.slerp(0.75, a, b))
