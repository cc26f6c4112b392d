"""Hypothesis tests of the preference losses' invariants and of sequence_logps.

References are written here from the papers' equations (docs/techniques/preference.md).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.func import MemoryOptions
from pgs.func.losses import PREFERENCE_KINDS, REFERENCE_FREE, preference_loss, sequence_logps, token_loss

FAST = settings(max_examples=25, deadline=None)
F64 = torch.float64

seeds = st.integers(0, 2**31 - 1)
betas = st.floats(0.01, 10.0)
logps = st.floats(-200.0, -1e-3)
REF_KINDS = [k for k in PREFERENCE_KINDS if k not in REFERENCE_FREE]


def one(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=F64)


def pairs(seed: int, n: int):
    """n pairs of summed log-probs (policy and reference) and completion lengths."""
    g = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (-torch.rand(n, generator=g, dtype=F64) * 60 - 1e-3 for _ in range(4))
    lc, lr = torch.randint(1, 30, (n,), generator=g), torch.randint(1, 30, (n,), generator=g)
    return c, r, rc, rr, lc, lr


def call(kind, c, r, rc, rr, lc, lr, **kw):
    refs = (None, None) if kind in REFERENCE_FREE else (rc, rr)
    return preference_loss(c, r, *refs, kind=kind, chosen_lengths=lc, rejected_lengths=lr, **kw)


# ---- DPO ------------------------------------------------------------------------------------


@FAST
@given(c=logps, rc=logps, r=logps, beta=betas, eps=st.floats(0.0, 0.49))
def test_dpo_is_log2_at_zero_margin(c, rc, r, beta, eps):
    # h = 0: the rejected arm moved by exactly as much as the chosen one
    rr = r - (c - rc)
    out = preference_loss(one(c), one(r), one(rc), one(rr), beta=beta, label_smoothing=eps)
    torch.testing.assert_close(out.loss, one(math.log(2)), rtol=1e-9, atol=1e-9)


@FAST
@given(hs=st.lists(st.floats(-50.0, 50.0), min_size=2, max_size=20, unique=True), beta=betas)
def test_dpo_decreasing_in_margin_and_swap_identity(hs, beta):
    h = torch.tensor(sorted(hs), dtype=F64)
    zero = torch.zeros_like(h)
    loss = preference_loss(h, zero, zero, zero, beta=beta).loss
    assert (loss[1:] <= loss[:-1]).all() and (loss > 0).all()
    # −log σ(x) − (−log σ(−x)) = −x: swapping the arms adds βh
    swapped = preference_loss(zero, h, zero, zero, beta=beta).loss
    torch.testing.assert_close(swapped - loss, beta * h, rtol=1e-9, atol=1e-9)


@FAST
@given(beta=betas, eps=st.floats(0.01, 0.45))
def test_cdpo_minimised_where_sigma_is_one_minus_eps(beta, eps):
    # d/dx [−(1−ε) log σ(x) − ε log σ(−x)] = σ(x) − (1 − ε): zero at x* = log((1−ε)/ε)
    x_star = math.log((1 - eps) / eps)
    h = (x_star / beta + torch.tensor([-1e-2, 0.0, 1e-2], dtype=F64) / beta).requires_grad_()
    zero = torch.zeros(3, dtype=F64)
    loss = preference_loss(h, zero, zero, zero, beta=beta, label_smoothing=eps).loss
    assert loss[1] <= loss[0] and loss[1] <= loss[2]
    g = torch.autograd.grad(loss[1], h)[0][1]
    assert abs(float(g)) < 1e-9 * max(1.0, beta)


# ---- IPO, hinge, DPOP -----------------------------------------------------------------------


@FAST
@given(beta=betas, offsets=st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=10))
def test_ipo_minimised_at_half_over_beta(beta, offsets):
    target = 1 / (2 * beta)
    h = torch.tensor([target] + [target + o for o in offsets], dtype=F64)
    zero = torch.zeros_like(h)
    loss = preference_loss(h, zero, zero, zero, kind="ipo", beta=beta).loss
    assert float(loss[0]) == 0.0 and (loss >= 0).all()
    torch.testing.assert_close(loss[1:], torch.tensor(offsets, dtype=F64).square(), rtol=1e-9, atol=1e-9)


@FAST
@given(h=st.floats(-50.0, 50.0), beta=betas)
def test_hinge_zero_exactly_past_the_margin(h, beta):
    zero = torch.zeros(1, dtype=F64)
    loss = float(preference_loss(one(h), zero, zero, zero, kind="hinge", beta=beta).loss)
    assert loss >= 0
    assert (loss == 0) == (beta * h >= 1) or abs(beta * h - 1) < 1e-12


@FAST
@given(seed=seeds, n=st.integers(1, 8), beta=betas, lam=st.floats(0.0, 50.0))
def test_dpop_bounds_dpo_and_equals_it_without_penalty(seed, n, beta, lam):
    c, r, rc, rr, _, _ = pairs(seed, n)
    dpo = preference_loss(c, r, rc, rr, beta=beta).loss
    dpop = preference_loss(c, r, rc, rr, kind="dpop", beta=beta, lam=lam).loss
    assert (dpop >= dpo - 1e-12).all()
    above = c >= rc  # the chosen arm did not fall below the reference: no penalty
    torch.testing.assert_close(dpop[above], dpo[above])
    torch.testing.assert_close(preference_loss(c, r, rc, rr, kind="dpop", beta=beta).loss, dpo)


# ---- every kind -------------------------------------------------------------------------------


@FAST
@given(seed=seeds, n=st.integers(1, 8), kind=st.sampled_from(PREFERENCE_KINDS), beta=betas)
def test_swapping_arms_flips_the_margin(seed, n, kind, beta):
    c, r, rc, rr, lc, lr = pairs(seed, n)
    a = call(kind, c, r, rc, rr, lc, lr, beta=beta)
    b = call(kind, r, c, rr, rc, lr, lc, beta=beta)
    torch.testing.assert_close(b.margins, -a.margins)
    torch.testing.assert_close(b.chosen_rewards, a.rejected_rewards)
    assert torch.isfinite(a.loss).all()


@FAST
@given(seed=seeds, n=st.integers(1, 8), kind=st.sampled_from(["dpo", "ipo", "hinge", "dpop"]),
       shift=st.floats(-20.0, 20.0))
def test_reference_kinds_see_only_log_ratios(seed, n, kind, shift):
    # adding δ to an arm's policy and reference log-probs changes nothing
    c, r, rc, rr, lc, lr = pairs(seed, n)
    a = call(kind, c, r, rc, rr, lc, lr, beta=0.5, lam=1.0 if kind == "dpop" else 0.0)
    b = call(kind, c + shift, r - shift, rc + shift, rr - shift, lc, lr, beta=0.5, lam=1.0 if kind == "dpop" else 0.0)
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.margins, a.margins)


@FAST
@given(seed=seeds, n=st.integers(1, 8), kind=st.sampled_from(["dpo", "ipo", "hinge"]), shift=st.floats(-20.0, 20.0))
def test_dpo_ipo_hinge_invariant_to_a_common_policy_shift(seed, n, kind, shift):
    # h is a difference of the arms' log-ratios: moving both policy log-probs by δ leaves it
    # (DPOP is not: its penalty reads log π_ref,c − log π_c)
    c, r, rc, rr, lc, lr = pairs(seed, n)
    torch.testing.assert_close(call(kind, c + shift, r + shift, rc, rr, lc, lr).loss, call(kind, c, r, rc, rr, lc, lr).loss)


@FAST
@given(seed=seeds, n=st.integers(1, 8), beta=betas, gamma=st.floats(-5.0, 5.0), shift=st.floats(-5.0, 0.0))
def test_simpo_invariant_to_a_common_shift_of_the_averages(seed, n, beta, gamma, shift):
    # SimPO reads only β(avg_c − avg_r) − γ, so a common shift δ of both length-normalised
    # log-probs (δ·|y| added to each sum) leaves the loss for every γ (the rewards move by βδ)
    c, r, _, _, lc, lr = pairs(seed, n)
    a = call("simpo", c, r, None, None, lc, lr, beta=beta, gamma=gamma)
    b = call("simpo", c + shift * lc, r + shift * lr, None, None, lc, lr, beta=beta, gamma=gamma)
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.chosen_rewards, a.chosen_rewards + beta * shift)


@FAST
@given(avgs=st.lists(st.floats(-20.0, -1e-3), min_size=2, max_size=12, unique=True), beta=betas)
def test_orpo_decreasing_in_the_chosen_average(avgs, beta):
    # the odds-ratio term decreases as the chosen arm's average log-prob rises (rejected fixed);
    # with chosen_nll fixed the whole loss does
    a = torch.tensor(sorted(avgs), dtype=F64)
    ones = torch.ones(len(avgs), dtype=torch.long)
    loss = preference_loss(a, torch.full_like(a, -3.0), kind="orpo", beta=beta, chosen_lengths=ones,
                           rejected_lengths=ones, chosen_nll=torch.zeros_like(a)).loss
    assert (loss[1:] <= loss[:-1] + 1e-12).all() and (loss >= 0).all()


# ---- sequence_logps ---------------------------------------------------------------------------


@st.composite
def packed(draw):
    """Random packed rows: each row a run of documents (prompt −100 then completion), some
    padding with seq id −1; documents numbered globally."""
    B, S = draw(st.integers(1, 3)), draw(st.integers(1, 16))
    V, D = draw(st.integers(2, 11)), draw(st.integers(1, 5))
    seed = draw(seeds)
    g = torch.Generator().manual_seed(seed)
    seq = torch.full((B, S), -1, dtype=torch.long)
    masked = torch.zeros(B, S, dtype=torch.bool)
    nxt = 0
    for b in range(B):
        pos = 0
        while pos < S:
            n = draw(st.integers(1, 6))
            if draw(st.integers(0, 4)) == 0:  # padding
                pos += n
                continue
            seq[b, pos : pos + n] = nxt
            prompt = draw(st.integers(0, n))
            masked[b, pos : pos + prompt] = True
            nxt += 1
            pos += n
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[masked] = -100
    h = torch.randn(B, S, D, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=F64, requires_grad=True)
    b_ = torch.randn(V, generator=g, dtype=F64, requires_grad=True)
    return h, W, b_, labels, seq, nxt + draw(st.integers(0, 2)), seed


def dense_reference(h, W, bias, labels, seq, num, softcap):
    z = h.reshape(-1, h.shape[-1]) @ W.t() + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    y, s = labels.reshape(-1), seq.reshape(-1)
    keep = (y != -100) & (s >= 0)
    logp = torch.log_softmax(z, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    return torch.zeros(num, dtype=z.dtype).index_add(0, s[keep], logp[keep]), torch.bincount(s[keep], minlength=num)


@settings(max_examples=40, deadline=None)
@given(problem=packed(), chunk=st.integers(1, 20), softcap=st.sampled_from([None, 2.0]))
def test_sequence_logps_equals_dense(problem, chunk, softcap):
    h, W, b, labels, seq, num, seed = problem
    logp, n = sequence_logps(h, W, labels, seq, num, chunk_size=chunk, bias=b, softcap=softcap)
    ref, n_ref = dense_reference(h, W, b, labels, seq, num, softcap)
    assert n.tolist() == n_ref.tolist()
    torch.testing.assert_close(logp, ref)
    up = torch.randn(num, generator=torch.Generator().manual_seed(seed), dtype=F64)
    got = torch.autograd.grad((logp * up).sum(), (h, W, b), allow_unused=True)
    want = torch.autograd.grad((ref * up).sum(), (h, W, b), allow_unused=True)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


@FAST
@given(problem=packed(), chunk=st.integers(1, 9))
def test_sequence_sums_add_up(problem, chunk):
    h, W, b, labels, seq, num, _ = problem
    logp, n = sequence_logps(h, W, labels, seq, num, chunk_size=chunk, bias=b)
    counted = (labels != -100) & (seq >= 0)
    # the documents' sums add up to the token loss over the same tokens (CE = −log p)
    ce = token_loss(h, W, torch.where(counted, labels, -100), bias=b, chunk_size=chunk)
    torch.testing.assert_close(logp.sum(), -ce.loss_sum.detach())
    assert int(n.sum()) == int(ce.num_valid)
    # merging documents sums them: map every id to id // 2
    merged, n2 = sequence_logps(h, W, labels, torch.where(seq >= 0, seq // 2, -1), (num + 1) // 2, chunk_size=chunk, bias=b)
    expect = torch.zeros((num + 1) // 2, dtype=F64).index_add(0, torch.arange(num) // 2, logp.detach())
    torch.testing.assert_close(merged.detach(), expect)
    assert n2.tolist() == torch.zeros((num + 1) // 2, dtype=torch.long).index_add(0, torch.arange(num) // 2, n).tolist()
    assert (logp <= 0).all()


@settings(max_examples=40, deadline=None)
@given(problem=packed(), chunk=st.integers(1, 20), softcap=st.sampled_from([None, 2.0]), slab=st.integers(1, 12))
def test_deferred_head_grad_equals_the_dense_gradient(problem, chunk, softcap, slab):
    """``defer_head_grad=True``: autograd gives W nothing and h, b the dense gradients; the
    deferred object's ``add_to`` and its ``add_rows_to`` over slabs of any size give W's."""
    h, W, b, labels, seq, num, seed = problem
    logp, n, head = sequence_logps(h, W, labels, seq, num, chunk_size=chunk, bias=b, softcap=softcap,
                                   memory=MemoryOptions(defer_head_grad=True))
    ref, _ = dense_reference(h, W, b, labels, seq, num, softcap)
    up = torch.randn(num, generator=torch.Generator().manual_seed(seed), dtype=F64)
    gh, gW, gb = torch.autograd.grad((logp * up).sum(), (h, W, b), allow_unused=True)
    rh, rW, rb = torch.autograd.grad((ref * up).sum(), (h, W, b), allow_unused=True)
    assert gW is None and head.ready
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gb, rb)
    slabs = torch.zeros_like(W)
    for r0 in range(0, W.shape[0], slab):
        head.add_rows_to(slabs[r0 : r0 + slab], r0, min(r0 + slab, W.shape[0]))
    torch.testing.assert_close(slabs, rW)
    torch.testing.assert_close(head.add_to(torch.zeros_like(W)), rW)
