"""preference_loss (DPO and variants) and sequence_logps: values by hand, references written
here from the papers' equations, fp64 gradcheck, and the errors."""

from __future__ import annotations

import math

import pytest
import torch

from pgs.errors import InvalidArgument
from pgs.func import MemoryOptions
from pgs.func.losses import (
    PREFERENCE_KINDS,
    REFERENCE_FREE,
    PreferenceLoss,
    preference_loss,
    sequence_logps,
)

F64 = torch.float64


def t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def softplus(x: float) -> float:
    """−log σ(−x) = log(1 + eˣ)."""
    return math.log1p(math.exp(x))


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=tol, atol=tol)


# ---- hand-computed values --------------------------------------------------------------------
# One pair: log π(y_c) = −10, log π(y_r) = −12, log π_ref(y_c) = log π_ref(y_r) = −11, so
# h = (−10 + 11) − (−12 + 11) = 2.

C, R, RC, RR = t(-10.0), t(-12.0), t(-11.0), t(-11.0)


def test_dpo_by_hand():
    out = preference_loss(C, R, RC, RR, kind="dpo", beta=0.1)
    assert isinstance(out, PreferenceLoss)
    close(out.loss, [softplus(-0.2)])  # −log σ(0.2)
    close(out.chosen_rewards, [0.1])  # 0.1·(−10 + 11)
    close(out.rejected_rewards, [-0.1])
    close(out.margins, [0.2])
    close(out.accuracy, [1.0])


def test_cdpo_label_smoothing_by_hand():
    out = preference_loss(C, R, RC, RR, kind="dpo", beta=0.1, label_smoothing=0.2)
    close(out.loss, [0.8 * softplus(-0.2) + 0.2 * softplus(0.2)])


def test_ipo_by_hand():
    close(preference_loss(C, R, RC, RR, kind="ipo", beta=0.1).loss, [(2 - 5) ** 2])
    close(preference_loss(C, R, RC, RR, kind="ipo", beta=0.5).loss, [(2 - 1) ** 2])


def test_hinge_by_hand():
    close(preference_loss(C, R, RC, RR, kind="hinge", beta=0.1).loss, [1 - 0.2])
    close(preference_loss(C, R, RC, RR, kind="hinge", beta=1.0).loss, [0.0])


def test_dpop_by_hand():
    # the chosen arm fell below the reference by 1 nat: h = (−1) − (−1) = 0, penalty λ·1
    c, rc = t(-10.0), t(-9.0)
    out = preference_loss(c, R, rc, RR, kind="dpop", beta=0.1, lam=5.0)
    close(out.loss, [softplus(0.1 * 5.0)])  # −log σ(0.1·(0 − 5))
    # above the reference: no penalty, DPO's value
    close(preference_loss(C, R, RC, RR, kind="dpop", beta=0.1, lam=5.0).loss, [softplus(-0.2)])


def test_simpo_by_hand():
    # log π(y_c)/|y_c| = −6/3 = −2, log π(y_r)/|y_r| = −12/4 = −3
    out = preference_loss(t(-6.0), t(-12.0), kind="simpo", beta=2.0, gamma=0.5,
                          chosen_lengths=torch.tensor([3]), rejected_lengths=torch.tensor([4]))
    close(out.loss, [softplus(-(2.0 * 1.0 - 0.5))])
    close(out.chosen_rewards, [2.0 * -2.0])
    close(out.rejected_rewards, [2.0 * -3.0])


def test_orpo_by_hand():
    # length-averaged log P: chosen −1/2, rejected −4/2
    def log_odds(lp):
        return lp - math.log(1 - math.exp(lp))

    ratio = log_odds(-0.5) - log_odds(-2.0)
    lens = dict(chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([2]))
    out = preference_loss(t(-1.0, dtype=F64), t(-4.0, dtype=F64), kind="orpo", beta=0.1, **lens)
    close(out.loss, [0.5 + 0.1 * softplus(-ratio)], tol=1e-12)
    close(out.chosen_rewards, [0.1 * -0.5], tol=1e-12)
    # the caller's NLL replaces −log π(y_c)/|y_c|
    out = preference_loss(t(-1.0, dtype=F64), t(-4.0, dtype=F64), kind="orpo", beta=0.1,
                          chosen_nll=t(3.0, dtype=F64), **lens)
    close(out.loss, [3.0 + 0.1 * softplus(-ratio)], tol=1e-12)


def test_orpo_finite_at_certainty():
    lens = dict(chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([2]))
    c = t(0.0).requires_grad_()
    out = preference_loss(c, t(-4.0), kind="orpo", beta=0.1, **lens)
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(c.grad).all()


def test_nll_weight_adds_the_chosen_nll_for_any_kind():
    lens = dict(chosen_lengths=torch.tensor([5]), rejected_lengths=torch.tensor([6]))
    for kind in PREFERENCE_KINDS:
        refs = (None, None) if kind in REFERENCE_FREE else (RC, RR)
        base = preference_loss(C, R, *refs, kind=kind, **lens).loss
        plus = preference_loss(C, R, *refs, kind=kind, nll_weight=0.5, **lens).loss
        close(plus - base, [0.5 * 10.0 / 5])
        # (ORPO's own NLL term reads chosen_nll too, so compare at the same chosen_nll)
        base = preference_loss(C, R, *refs, kind=kind, chosen_nll=t(1.5), **lens).loss
        given = preference_loss(C, R, *refs, kind=kind, nll_weight=0.5, chosen_nll=t(1.5), **lens).loss
        close(given - base, [0.5 * 1.5])


def test_rewards_are_detached_and_reference_gets_no_gradient():
    c, r = C.clone().requires_grad_(), R.clone().requires_grad_()
    rc, rr = RC.clone().requires_grad_(), RR.clone().requires_grad_()
    out = preference_loss(c, r, rc, rr)
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    out.loss.sum().backward()
    assert c.grad is not None and r.grad is not None
    assert rc.grad is None and rr.grad is None


def test_many_pairs_are_independent():
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-torch.rand(7, generator=g, dtype=F64) * 20 for _ in range(4))
    lc, lr = torch.randint(1, 9, (7,), generator=g), torch.randint(1, 9, (7,), generator=g)
    for kind in PREFERENCE_KINDS:
        refs = (None, None) if kind in REFERENCE_FREE else (rc, rr)
        kw = dict(kind=kind, chosen_lengths=lc, rejected_lengths=lr, nll_weight=0.1)
        full = preference_loss(c, r, *refs, **kw)
        for i in range(7):
            one = preference_loss(c[i:i + 1], r[i:i + 1], *(x if x is None else x[i:i + 1] for x in refs),
                                  kind=kind, chosen_lengths=lc[i:i + 1], rejected_lengths=lr[i:i + 1], nll_weight=0.1)
            for a, b in zip(one, full):
                torch.testing.assert_close(a, b[i:i + 1])


def test_dtypes():
    out = preference_loss(C.bfloat16(), R.bfloat16(), RC.bfloat16(), RR.bfloat16())
    assert all(x.dtype == torch.float32 for x in out)
    out = preference_loss(C.double(), R.double(), RC.double(), RR.double())
    assert all(x.dtype == F64 for x in out)


# ---- DPO against a transcription of the paper's equation (TRL's "sigmoid" loss form) ----------


def dpo_as_in_the_paper(pi_c, pi_r, ref_c, ref_r, beta, eps):
    """arXiv 2305.18290 eq. 7: L = −log σ(β log π(y_w)/π_ref(y_w) − β log π(y_l)/π_ref(y_l)),
    written as the policy's log-ratio minus the reference's; cDPO mixes in the flipped label."""
    pi_logratio = pi_c - pi_r
    ref_logratio = ref_c - ref_r
    logits = pi_logratio - ref_logratio
    losses = -torch.nn.functional.logsigmoid(beta * logits) * (1 - eps) \
        - torch.nn.functional.logsigmoid(-beta * logits) * eps
    return losses, beta * (pi_c - ref_c), beta * (pi_r - ref_r)


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.1), (2.0, 0.3)])
def test_dpo_equals_the_paper_transcription(beta, eps):
    g = torch.Generator().manual_seed(1)
    c, r, rc, rr = (-torch.rand(64, generator=g, dtype=F64) * 200 for _ in range(4))
    c.requires_grad_(), r.requires_grad_()
    out = preference_loss(c, r, rc, rr, kind="dpo", beta=beta, label_smoothing=eps)
    ref = dpo_as_in_the_paper(c, r, rc, rr, beta, eps)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b.detach() if not a.requires_grad else b)
    ga = torch.autograd.grad(out.loss.mean(), (c, r))
    gb = torch.autograd.grad(ref[0].mean(), (c, r))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


# ---- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PREFERENCE_KINDS)
def test_preference_gradcheck(kind):
    g = torch.Generator().manual_seed(2)
    # away from the hinge's kink (βh = 1) and DPOP's (log π_ref,c = log π_c)
    c = (-torch.rand(4, generator=g, dtype=F64) * 3 - 1).requires_grad_()
    r = (-torch.rand(4, generator=g, dtype=F64) * 3 - 5).requires_grad_()
    rc = c.detach() + torch.tensor([0.7, -0.6, 0.8, -0.9], dtype=F64)
    rr = r.detach() + 0.3
    lc = torch.tensor([2, 3, 4, 5])
    lr = torch.tensor([5, 4, 3, 6])
    nll = torch.rand(4, generator=g, dtype=F64).requires_grad_()
    kw = dict(kind=kind, beta=0.3, chosen_lengths=lc, rejected_lengths=lr, nll_weight=0.2)
    kw.update({"dpo": dict(label_smoothing=0.1), "dpop": dict(lam=2.0), "simpo": dict(gamma=0.4)}.get(kind, {}))
    refs = (None, None) if kind in REFERENCE_FREE else (rc, rr)

    def f(c, r, nll):
        return preference_loss(c, r, *refs, chosen_nll=nll, **kw).loss

    assert torch.autograd.gradcheck(f, (c, r, nll))


# ---- sequence_logps ------------------------------------------------------------------------


def dense_sequence_logps(h, W, labels, seq, num, bias=None, softcap=None):
    """The reference: full logits, log_softmax, gather, scatter-add by sequence id."""
    z = (h.reshape(-1, h.shape[-1]) @ W.t()).to(torch.promote_types(h.dtype, torch.float32))
    if bias is not None:
        z = z + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    y, s = labels.reshape(-1), seq.reshape(-1)
    keep = (y != -100) & (s >= 0)
    logp = torch.log_softmax(z, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    out = torch.zeros(num, dtype=z.dtype).index_add(0, s[keep], logp[keep])
    return out, torch.bincount(s[keep], minlength=num)


def packed_problem(seed, B=2, S=9, D=5, V=13, dtype=F64):
    """Two rows, each packing a chosen and a rejected arm as isolated documents (prompt tokens
    −100), plus padding with seq id −1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    seq = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, -1], [2, 2, 2, 3, 3, 3, 3, 3, 3]])[:B, :S]
    labels[0, [0, 1, 4, 8]] = -100  # prompts and padding
    labels[1, [0, 3, 4]] = -100
    return h, W, b, labels, seq


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_sequence_logps_equals_dense(chunk, softcap):
    h, W, b, labels, seq = packed_problem(3)
    logp, n = sequence_logps(h, W, labels, seq, 4, chunk_size=chunk, bias=b, softcap=softcap)
    ref, n_ref = dense_sequence_logps(h, W, labels, seq, 4, bias=b, softcap=softcap)
    assert logp.dtype == F64 and n.dtype == torch.int64
    assert n.tolist() == n_ref.tolist() == [2, 3, 2, 4]
    torch.testing.assert_close(logp, ref)
    up = torch.tensor([0.3, -1.7, 2.0, 0.5], dtype=F64)  # any upstream gradient
    for a, e in zip(torch.autograd.grad((logp * up).sum(), (h, W, b)), torch.autograd.grad((ref * up).sum(), (h, W, b))):
        torch.testing.assert_close(a, e)


def test_sequence_logps_fp32_and_flat_inputs():
    h, W, b, labels, seq = packed_problem(4, dtype=torch.float32)
    flat = sequence_logps(h.reshape(-1, 5), W, labels.reshape(-1), seq.reshape(-1), 4, chunk_size=4)
    logp, n = sequence_logps(h, W, labels, seq, 4, chunk_size=4)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(flat[0], logp)
    ref, _ = dense_sequence_logps(h, W, labels, seq, 4)
    torch.testing.assert_close(logp, ref)
    gh, gW = torch.autograd.grad(logp.sum(), (h, W))
    rh, rW = torch.autograd.grad(ref.sum(), (h, W))
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gW, rW)


def test_sequence_logps_bf16_within_rounding():
    h, W, _, labels, seq = packed_problem(5, dtype=torch.float32)
    logp, _ = sequence_logps(h.bfloat16(), W.bfloat16(), labels, seq, 4)
    ref, _ = dense_sequence_logps(h.detach(), W.detach(), labels, seq, 4)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=3e-2, atol=5e-2)


def test_sequence_logps_gradcheck():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(1, 6, 3, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(5, 3, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=F64, requires_grad=True)
    labels = torch.tensor([[-100, 1, 4, -100, 0, 2]])
    seq = torch.tensor([[0, 0, 0, 1, 1, 1]])
    for softcap in (None, 1.5):
        assert torch.autograd.gradcheck(
            lambda h, W, b: sequence_logps(h, W, labels, seq, 2, chunk_size=2, bias=b, softcap=softcap)[0], (h, W, b)
        )


def test_sequence_logps_empty_and_frozen_and_no_grad():
    h, W, b, labels, seq = packed_problem(7)
    logp, n = sequence_logps(h, W, torch.full_like(labels, -100), seq, 4)
    assert logp.tolist() == [0.0] * 4 and n.tolist() == [0] * 4
    (gh,) = torch.autograd.grad(logp.sum(), (h,))
    assert (gh == 0).all()
    frozen = W.detach()
    logp, _ = sequence_logps(h, frozen, labels, seq, 4)
    (gh,) = torch.autograd.grad(logp.sum(), (h,))
    (rh,) = torch.autograd.grad(dense_sequence_logps(h, frozen, labels, seq, 4)[0].sum(), (h,))
    torch.testing.assert_close(gh, rh)
    with torch.no_grad():
        logp, _ = sequence_logps(h, W, labels, seq, 4)
    assert not logp.requires_grad
    # more sequences than ids used: the extra ones are 0 with length 0
    logp, n = sequence_logps(h, W, labels, seq, 6)
    assert n.tolist()[4:] == [0, 0] and logp.tolist()[4:] == [0.0, 0.0]


def test_sequence_logps_into_dpo_matches_dense_end_to_end():
    h, W, b, labels, seq = packed_problem(8)
    ref_c, ref_r = torch.tensor([-20.0, -25.0], dtype=F64), torch.tensor([-22.0, -21.0], dtype=F64)

    def loss(fn):
        logp, _ = fn(h, W, labels, seq, 4)
        return preference_loss(logp[0::2], logp[1::2], ref_c, ref_r, beta=0.2).loss.mean()

    a = loss(lambda *x: sequence_logps(*x, chunk_size=3))
    e = loss(dense_sequence_logps)
    torch.testing.assert_close(a, e)
    for x, y in zip(torch.autograd.grad(a, (h, W)), torch.autograd.grad(e, (h, W))):
        torch.testing.assert_close(x, y)


# ---- errors ----------------------------------------------------------------------------------


def test_unknown_kind_suggests():
    for typo, meant in (("simpoo", "simpo"), ("DPO", "dpo"), ("sigmoid", "dpo"), ("hing", "hinge")):
        with pytest.raises(InvalidArgument, match=rf"kind.*'{typo}'.*did you mean '{meant}'"):
            preference_loss(C, R, RC, RR, kind=typo)
    with pytest.raises(InvalidArgument, match=r"kind.*expected one of"):
        preference_loss(C, R, RC, RR, kind="zzzzzz")


@pytest.mark.parametrize("kind", [k for k in PREFERENCE_KINDS if k not in REFERENCE_FREE])
def test_reference_kinds_need_reference(kind):
    with pytest.raises(InvalidArgument, match="ref_chosen_logps is required"):
        preference_loss(C, R, kind=kind)
    with pytest.raises(InvalidArgument, match="ref_rejected_logps is required"):
        preference_loss(C, R, RC, kind=kind)


@pytest.mark.parametrize("kind", REFERENCE_FREE)
def test_reference_free_kinds_need_lengths_and_refuse_a_reference(kind):
    with pytest.raises(InvalidArgument, match="chosen_lengths is required"):
        preference_loss(C, R, kind=kind)
    with pytest.raises(InvalidArgument, match="rejected_lengths is required"):
        preference_loss(C, R, kind=kind, chosen_lengths=torch.tensor([3]))
    with pytest.raises(InvalidArgument, match="ref_chosen_logps.*no reference"):
        preference_loss(C, R, RC, RR, kind=kind, chosen_lengths=torch.tensor([3]), rejected_lengths=torch.tensor([3]))
    with pytest.raises(InvalidArgument, match="chosen_lengths must be > 0"):
        preference_loss(C, R, kind=kind, chosen_lengths=torch.tensor([0]), rejected_lengths=torch.tensor([3]))


@pytest.mark.parametrize("kw,match", [
    (dict(beta=0.0), "beta must be > 0"),
    (dict(beta=-1.0), "beta must be > 0"),
    (dict(beta=math.nan), "beta must be > 0"),
    (dict(label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(label_smoothing=-0.1), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(lam=-1.0), "lam must be >= 0"),
    (dict(nll_weight=-0.5), "nll_weight must be >= 0"),
    (dict(gamma=0.5), "gamma=0.5 has no effect with kind='dpo'"),
    (dict(lam=1.0), "lam=1.0 has no effect with kind='dpo'"),
    (dict(nll_weight=1.0), "chosen_lengths \\(or chosen_nll\\) is required"),
])
def test_bad_hyperparameters(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        preference_loss(C, R, RC, RR, **kw)


def test_label_smoothing_only_for_dpo():
    with pytest.raises(InvalidArgument, match="label_smoothing=0.1 has no effect with kind='ipo'"):
        preference_loss(C, R, RC, RR, kind="ipo", label_smoothing=0.1)


def test_shape_mismatch():
    with pytest.raises(InvalidArgument, match=r"rejected_logps has shape \(2,\), expected \(1,\)"):
        preference_loss(C, t(-1.0, -2.0), RC, RR)
    with pytest.raises(InvalidArgument, match="ref_rejected_logps has shape"):
        preference_loss(C, R, RC, t(-1.0, -2.0))
    with pytest.raises(InvalidArgument, match="chosen_logps must be a 1-D tensor"):
        preference_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))


def test_sequence_logps_errors():
    h, W, b, labels, seq = packed_problem(9)
    with pytest.raises(InvalidArgument, match="sequence id 3, but num_sequences=3"):
        sequence_logps(h, W, labels, seq, 3)
    with pytest.raises(InvalidArgument, match="num_sequences must be a non-negative integer"):
        sequence_logps(h, W, labels, seq, -1)
    with pytest.raises(InvalidArgument, match="seq_ids must be an integer tensor"):
        sequence_logps(h, W, labels, seq.double(), 4)
    with pytest.raises(InvalidArgument, match="seq_ids has shape"):
        sequence_logps(h, W, labels, seq[:, :4], 4)
    with pytest.raises(InvalidArgument, match="labels have shape"):
        sequence_logps(h, W, labels[:, :4], seq, 4)
    with pytest.raises(InvalidArgument, match="chunk_size must be a positive integer"):
        sequence_logps(h, W, labels, seq, 4, chunk_size=0)
    bad = labels.clone()
    bad[1, 1] = 13
    with pytest.raises(InvalidArgument, match=r"labels: ids must be in \[0, 13\)"):
        sequence_logps(h, W, bad, seq, 4)


# ---- sequence_logps(defer_head_grad=True) ----------------------------------------------------


def _dpo_of(logp):
    """A nonlinear loss of the sums (DPO), so that ∂L/∂logp_sum differs per sequence."""
    ref_c, ref_r = torch.tensor([-20.0, -25.0], dtype=logp.dtype), torch.tensor([-22.0, -21.0], dtype=logp.dtype)
    return preference_loss(logp[0::2], logp[1::2], ref_c, ref_r, beta=0.3).loss.sum()


def _plain_and_deferred(h, W, b, labels, seq, **kw):
    """(grads of h, W, b by autograd; grads of h, b by autograd and the deferred W object)."""
    logp, n = sequence_logps(h, W, labels, seq, 4, bias=b, **kw)
    plain = torch.autograd.grad(_dpo_of(logp), (h, W, b))
    logp_d, n_d, head = sequence_logps(h, W, labels, seq, 4, bias=b, memory=MemoryOptions(defer_head_grad=True), **kw)
    assert torch.equal(logp_d, logp) and torch.equal(n_d, n)
    assert head is not None and not head.ready  # filled by backward, not by forward
    loss = _dpo_of(logp_d)
    gh, gW, gb = torch.autograd.grad(loss, (h, W, b), allow_unused=True)
    assert gW is None and head.ready  # W got nothing from autograd
    return plain, (gh, gb), head


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("chunk", [2, 5, 100])
def test_deferred_head_grad_equals_autograd(dtype, softcap, chunk):
    """grad_h and grad_b unchanged; ``add_to`` gives W's autograd gradient; ``add_rows_to`` over
    slabs (one past the vocabulary's end) gives its rows; the same arithmetic, so equal to
    rounding of the order of sums (bf16: within a bf16 ulp of the gradient's scale)."""
    h, W, b, labels, seq = packed_problem(11)
    h, W, b = (x.detach().to(dtype).requires_grad_() for x in (h, W, b))
    (rh, rW, rb), (gh, gb), head = _plain_and_deferred(h, W, b, labels, seq, chunk_size=chunk, softcap=softcap)
    torch.testing.assert_close(gh, rh, rtol=0, atol=0)
    torch.testing.assert_close(gb, rb, rtol=0, atol=0)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-2, atol=1e-2 * rW.abs().max().item())
    slabs = torch.zeros_like(W)
    for r0 in range(0, W.shape[0], 4):  # 13 rows: slabs of 4, the last of 1
        r1 = min(r0 + 4, W.shape[0])
        head.add_rows_to(slabs[r0:r1], r0, r1)
    torch.testing.assert_close(slabs, rW, **tol)
    base = torch.randn_like(W) if dtype == F64 else torch.zeros_like(W)  # adds into what the buffer holds
    whole = head.add_to(base.clone()) - base
    torch.testing.assert_close(whole, rW, **tol)
    assert rW.abs().sum() > 0
    with pytest.raises(RuntimeError, match="already added"):
        head.add_to(torch.zeros_like(W))


def test_deferred_head_grad_only_where_W_gets_a_gradient():
    h, W, b, labels, seq = packed_problem(12)
    assert sequence_logps(h, W.detach(), labels, seq, 4, memory=MemoryOptions(defer_head_grad=True))[2] is None
    with torch.no_grad():
        assert sequence_logps(h, W, labels, seq, 4, memory=MemoryOptions(defer_head_grad=True))[2] is None
    logp, _, head = sequence_logps(h, W, torch.full_like(labels, -100), seq, 4, memory=MemoryOptions(defer_head_grad=True))
    (gh,) = torch.autograd.grad(logp.sum(), (h,))  # no completion token: zeros, an empty rebuild
    assert (gh == 0).all() and head.ready
    assert (head.add_to(torch.zeros_like(W)) == 0).all()
    logp, _, head = sequence_logps(h, W, labels, seq, 4, memory=MemoryOptions(defer_head_grad=True))
    head.discard()  # a step that never ran backward drops what it would hold
    with pytest.raises(RuntimeError, match="nothing to add"):
        head.add_to(torch.zeros_like(W))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_sequence_logps_triton_passes_equal_the_torch_path(kernels_on, monkeypatch, dtype, softcap):
    """On CUDA (the interpreter on the CPU) the chunk's logits stay in W's dtype: ``row_stats``
    in forward, ``grad_in_place`` in backward and in the deferred rebuild; equal to the torch
    path (``ce_kernels`` off) up to the rounding of the logits to W's dtype."""
    from pgs.func import kernels
    from pgs.func.losses import chunked

    g = torch.Generator().manual_seed(13)
    h = (torch.randn(2, 24, 16, generator=g) * 0.7).to(kernels_on, dtype)
    W = (torch.randn(300, 16, generator=g) * 0.5).to(kernels_on, dtype)
    labels = torch.randint(0, 300, (2, 24), generator=g)
    labels[:, ::5] = -100
    seq = torch.arange(4).repeat_interleave(12).reshape(2, 24)
    labels, seq = labels.to(kernels_on), seq.to(kernels_on)

    def grads(defer):
        x, w = h.clone().requires_grad_(), W.clone().requires_grad_()
        out = sequence_logps(x, w, labels, seq, 4, chunk_size=7, softcap=softcap, memory=MemoryOptions(defer_head_grad=defer))
        _dpo_of(out[0].cpu()).backward()
        if defer:
            assert w.grad is None
            w.grad = out[2].add_to(torch.zeros_like(w))
        return out[0], x.grad, w.grad

    on = [grads(False), grads(True)]
    assert chunked._use_kernels(h, W, chunked._Plan(None, None, -100, softcap, 0.0, 7, None, True, True, False,
                                                    False), W)
    monkeypatch.setattr(kernels, "CONFIG", kernels.CONFIG.evolve(ce_kernels=False))
    off = grads(False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the products' roundings, about 2 ulps at the largest
    for got in on:
        for a, e in zip(got, off):
            assert ((a.float() - e.float()).abs().max() / e.float().abs().max()).item() < tol
