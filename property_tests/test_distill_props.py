"""Hypothesis tests of the distillation divergences (``distill_loss``).

The reference is written here from the equations of GKD (arXiv 2306.13649, §3) on the full
fp64 logits with plain autograd (docs/techniques/distillation.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.errors import InvalidArgument
from pgs.func.losses import DISTILL_KINDS, distill_loss

FAST = settings(max_examples=20, deadline=None)
F64 = torch.float64

seeds = st.integers(0, 2**31 - 1)
betas = st.floats(0.05, 0.95)
temps = st.floats(0.3, 3.0)
kinds = st.sampled_from(DISTILL_KINDS)


def problem(seed: int, *, B=2, S=5, D=4, Dt=6, V=11, scale=1.0, dtype=F64, softcap=False):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, S, D, generator=g, dtype=F64) * scale
    Ws = torch.randn(V, D, generator=g, dtype=F64)
    ht = torch.randn(B, S, Dt, generator=g, dtype=F64) * scale
    Wt = torch.randn(V, Dt, generator=g, dtype=F64)
    mask = torch.rand(B, S, generator=g) < 0.7
    bs = torch.randn(V, generator=g, dtype=F64) if softcap else None
    return [x if x is None or x.dtype == torch.bool else x.to(dtype) for x in (hs, Ws, ht, Wt, mask, bs)]


def dense(hs, Ws, ht, Wt, mask, kind, beta=0.5, tau=1.0, bs=None, cap_s=None):
    """The per-token divergence summed over the mask, on full logits, differentiable."""
    zs = hs @ Ws.t() + (0 if bs is None else bs)
    if cap_s is not None:
        zs = cap_s * torch.tanh(zs / cap_s)
    ls = torch.log_softmax(zs / tau, -1)
    lt = torch.log_softmax((ht @ Wt.t()) / tau, -1)
    s, t = ls.exp(), lt.exp()
    if kind == "forward_kl":
        per = (t * (lt - ls)).sum(-1)
    elif kind == "reverse_kl":
        per = (s * (ls - lt)).sum(-1)
    else:
        lm = torch.log(beta * t + (1 - beta) * s)
        per = beta * (t * (lt - lm)).sum(-1) + (1 - beta) * (s * (ls - lm)).sum(-1)
    return per[mask].sum()


def value(hs, Ws, ht, Wt, mask, **kw) -> float:
    with torch.no_grad():
        return float(distill_loss(hs, Ws, ht, Wt, mask, **kw).loss_sum)


@FAST
@given(seed=seeds, kind=kinds, beta=betas, tau=temps, chunk=st.integers(1, 12), cap=st.sampled_from([None, 4.0]))
def test_equals_dense_fp64_reference_with_gradients(seed, kind, beta, tau, chunk, cap):
    hs, Ws, ht, Wt, mask, bs = problem(seed, softcap=cap is not None)
    leaves = [x.clone().requires_grad_() for x in (hs, Ws) + ((bs,) if bs is not None else ())]
    b = leaves[2] if bs is not None else None
    out = distill_loss(leaves[0], leaves[1], ht, Wt, mask, kind=kind, beta=beta, temperature=tau,
                       chunk_size=chunk, student_bias=b, student_softcap=cap)
    assert int(out.num_tokens) == int(mask.sum())
    ref_leaves = [x.clone().requires_grad_() for x in leaves]
    rb = ref_leaves[2] if bs is not None else None
    ref = dense(ref_leaves[0], ref_leaves[1], ht, Wt, mask, kind, beta, tau, rb, cap)
    torch.testing.assert_close(out.loss_sum, ref.detach(), rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.loss_sum * 1.7, leaves)
    ref_grads = torch.autograd.grad(ref * 1.7, ref_leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


@FAST
@given(seed=seeds, kind=kinds, beta=betas, tau=temps, chunks=st.tuples(st.integers(1, 12), st.integers(1, 12)))
def test_chunk_size_invariant(seed, kind, beta, tau, chunks):
    hs, Ws, ht, Wt, mask, _ = problem(seed, dtype=torch.float32)
    outs = []
    for chunk in chunks:
        h, W = hs.clone().requires_grad_(), Ws.clone().requires_grad_()
        loss = distill_loss(h, W, ht, Wt, mask, kind=kind, beta=beta, temperature=tau, chunk_size=chunk).loss_sum
        outs.append((loss.detach(), *torch.autograd.grad(loss, (h, W))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@FAST
@given(seed=seeds, kind=kinds, beta=betas, tau=temps, scale=st.floats(0.1, 20.0))
def test_non_negative_and_zero_when_the_heads_are_equal(seed, kind, beta, tau, scale):
    hs, Ws, ht, Wt, mask, _ = problem(seed, scale=scale)
    assert value(hs, Ws, ht, Wt, mask, kind=kind, beta=beta, temperature=tau) >= -1e-12
    # the teacher is the student (other tensors, the same logits): every divergence is 0
    h = hs.clone().requires_grad_()
    out = distill_loss(h, Ws, hs.clone(), Ws.clone(), mask, kind=kind, beta=beta, temperature=tau)
    assert abs(float(out.loss_sum.detach())) < 1e-12
    (g,) = torch.autograd.grad(out.loss_sum, h)
    assert float(g.abs().max()) < 1e-12  # a minimum: zero gradient too


@FAST
@given(seed=seeds, beta=betas, tau=temps)
def test_jsd_swaps_heads_with_beta(seed, beta, tau):
    # JSD_β(T, S) = JSD_{1−β}(S, T); at β = ½ the divergence is symmetric
    hs, Ws, ht, Wt, mask, _ = problem(seed, Dt=4)
    a = value(hs, Ws, ht, Wt, mask, kind="jsd", beta=beta, temperature=tau)
    b = value(ht, Wt, hs, Ws, mask, kind="jsd", beta=1 - beta, temperature=tau)
    assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    half = value(hs, Ws, ht, Wt, mask, kind="jsd", beta=0.5, temperature=tau)
    swapped = value(ht, Wt, hs, Ws, mask, kind="jsd", beta=0.5, temperature=tau)
    assert math.isclose(half, swapped, rel_tol=1e-9, abs_tol=1e-12)
    assert half <= int(mask.sum()) * math.log(2) + 1e-9  # JSD(½) ≤ log 2 per token


@FAST
@given(seed=seeds, tau=st.floats(1.0, 3.0))
def test_jsd_limits_are_the_kls_scaled(seed, tau):
    # β → 0: JSD(β)/β → KL(T‖S);  β → 1: JSD(β)/(1−β) → KL(S‖T)  (GKD §3).  The error is
    # about β·max_v T_v/S_v (resp. S_v/T_v), so the heads here are kept within a few nats
    # (small hidden states, τ ≥ 1).
    hs, Ws, ht, Wt, mask, _ = problem(seed, scale=0.3)
    fwd = value(hs, Ws, ht, Wt, mask, kind="forward_kl", temperature=tau)
    rev = value(hs, Ws, ht, Wt, mask, kind="reverse_kl", temperature=tau)
    errs = []
    for eps in (1e-4, 1e-5, 1e-6):
        lo = value(hs, Ws, ht, Wt, mask, kind="jsd", beta=eps, temperature=tau) / eps
        hi = value(hs, Ws, ht, Wt, mask, kind="jsd", beta=1 - eps, temperature=tau) / eps
        errs.append((abs(lo - fwd), abs(hi - rev)))
    assert math.isclose(lo, fwd, rel_tol=1e-3, abs_tol=1e-7)
    assert math.isclose(hi, rev, rel_tol=1e-3, abs_tol=1e-7)
    for (big_lo, big_hi), (small_lo, small_hi) in zip(errs, errs[1:]):  # closer as β → 0 / 1
        assert small_lo <= big_lo * 0.5 + 1e-9 and small_hi <= big_hi * 0.5 + 1e-9


@FAST
@given(seed=seeds, kind=kinds, beta=betas)
def test_teacher_gets_no_gradient_and_masked_tokens_count_nothing(seed, kind, beta):
    hs, Ws, ht, Wt, mask, _ = problem(seed)
    ht_, Wt_ = ht.clone().requires_grad_(), Wt.clone().requires_grad_()
    h = hs.clone().requires_grad_()
    out = distill_loss(h, Ws, ht_, Wt_, mask, kind=kind, beta=beta)
    assert out.loss_sum.requires_grad
    (g,) = torch.autograd.grad(out.loss_sum, h)
    assert ht_.grad is None and Wt_.grad is None
    assert torch.equal(g[~mask], torch.zeros_like(g[~mask]))
    # changing unmasked positions of either model changes nothing
    hs2, ht2 = hs.clone(), ht.clone()
    hs2[~mask] += 5.0
    ht2[~mask] -= 3.0
    assert value(hs2, Ws, ht2, Wt, mask, kind=kind, beta=beta) == value(hs, Ws, ht, Wt, mask, kind=kind, beta=beta)


def test_bf16_student_against_fp64_and_extreme_logits_stay_finite():
    hs, Ws, ht, Wt, mask, _ = problem(3, scale=50.0)  # saturated softmaxes: zero probabilities
    for kind in DISTILL_KINDS:
        h = hs.clone().requires_grad_()
        out = distill_loss(h, Ws, ht, Wt, mask, kind=kind)
        (g,) = torch.autograd.grad(out.loss_sum, h)
        assert torch.isfinite(out.loss_sum) and torch.isfinite(g).all()
    hs, Ws, ht, Wt, mask, _ = problem(4)
    h16 = hs.to(torch.bfloat16).requires_grad_()
    out = distill_loss(h16, Ws.to(torch.bfloat16), ht.to(torch.bfloat16), Wt.to(torch.bfloat16), mask)
    assert out.loss_sum.dtype == torch.float32
    ref = dense(hs, Ws, ht, Wt, mask, "jsd")
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(kind="kl"), "kind"),
        (dict(kind="jsd", beta=0.0), "beta"),
        (dict(kind="jsd", beta=1.0), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_arguments_name_the_field(kw, word):
    hs, Ws, ht, Wt, mask, _ = problem(0)
    with pytest.raises(InvalidArgument, match=word):
        distill_loss(hs, Ws, ht, Wt, mask, **kw)


def test_mismatched_shapes_are_refused():
    hs, Ws, ht, Wt, mask, _ = problem(0)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        distill_loss(hs, Ws, ht, Wt[:-1], mask)
    with pytest.raises(InvalidArgument, match="same tokens"):
        distill_loss(hs, Ws, ht[:, :-1], Wt, mask)
    with pytest.raises(InvalidArgument, match="mask"):
        distill_loss(hs, Ws, ht, Wt, mask[:, :-1])
