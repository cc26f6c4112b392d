"""Hypothesis tests of the loss invariants of the token losses (C1-C7: the labels of docs/techniques/README.md).

Most tests set W = I (D = V, no bias), so the hidden state *is* the logit vector z and a
gradient with respect to h is ∇_z; references are written here from the equations, with
autograd, independently of pgs's analytic gates.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.func.losses import (
    CADFT,
    DEFT,
    DeformedLog,
    InfoSFT,
    cadft_compatibility,
    cayley_alpha,
    infosft_weight,
    neftune,
    symnoise,
    token_loss,
)

FAST = settings(max_examples=25, deadline=None)
F64 = torch.float64

seeds = st.integers(0, 2**31 - 1)
sizes = st.integers(1, 9)
vocab = st.integers(2, 12)
temperatures = st.floats(0.2, 6.0)


def logits(seed, n, v, temp=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=F64) * temp).requires_grad_()


def targets(seed, n, v, masked_fraction=0.0):
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randint(0, v, (n,), generator=g)
    if masked_fraction:
        y[torch.rand(n, generator=g) < masked_fraction] = -100
    return y


def loss_on_logits(z, y, objective, backend="chunked", **kw):
    eye = torch.eye(z.shape[1], dtype=z.dtype)
    return token_loss(z, eye, y, objective=objective, backend=backend, **kw)


def grad_z(result, z):
    return torch.autograd.grad(result.loss_sum, z)[0]


def reference_grad(z, y, per_token_loss):
    """∇_z Σ_i per_token_loss(log p_i,y, p_i) written directly with autograd."""
    z = z.detach().requires_grad_()
    logp = torch.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    p = torch.softmax(z, -1)
    loss = per_token_loss(logp, p).sum()
    return torch.autograd.grad(loss, z)[0], loss.detach()


# ---- C1: DEFT and the deformed-log family ----------------------------------------------------


@FAST
@given(seed=seeds, n=sizes, v=vocab, temp=temperatures, backend=st.sampled_from(["chunked", "dense"]))
def test_deformed_log_small_alpha_is_nll(seed, n, v, temp, backend):
    z, y = logits(seed, n, v, temp), targets(seed, n, v)
    small = loss_on_logits(z, y, DeformedLog(1e-7), backend)
    nll = loss_on_logits(z, y, "ce", backend)
    torch.testing.assert_close(small.loss_sum, nll.loss_sum, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad_z(small, z), grad_z(nll, z), rtol=1e-5, atol=1e-8)


@FAST
@given(seed=seeds, n=sizes, v=vocab, temp=temperatures)
def test_deformed_log_alpha_one_is_one_minus_p_and_dft_gradient(seed, n, v, temp):
    z, y = logits(seed, n, v, temp), targets(seed, n, v)
    one = loss_on_logits(z, y, DeformedLog(1.0))
    g_ref, l_ref = reference_grad(z, y, lambda logp, p: 1 - logp.exp())
    torch.testing.assert_close(one.loss_sum, l_ref)
    torch.testing.assert_close(grad_z(one, z), g_ref)
    torch.testing.assert_close(grad_z(loss_on_logits(z, y, "dft"), z), g_ref)


@FAST
@given(seed=seeds, n=sizes, v=vocab, temp=temperatures, backend=st.sampled_from(["chunked", "dense"]))
def test_deft_gradient_is_gated_ce_with_no_gradient_through_alpha(seed, n, v, temp, backend):
    z, y = logits(seed, n, v, temp), targets(seed, n, v, masked_fraction=0.3)
    r = loss_on_logits(z, y, "deft", backend)
    valid = y != -100
    p = torch.softmax(z.detach(), -1)
    alpha = (p * p).sum(-1)
    p_y = p.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    gate = alpha / (alpha + 1e-6) * p_y**alpha
    expected = gate[:, None] * (p - torch.nn.functional.one_hot(y.clamp(min=0), v))
    expected[~valid] = 0
    torch.testing.assert_close(grad_z(r, z), expected)  # invariants 3 and 4
    # The same loss with α left attached to the graph has a different gradient.
    zz = z.detach().requires_grad_()
    pp = torch.softmax(zz, -1)
    a_live = (pp * pp).sum(-1)
    logp = torch.log_softmax(zz, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    live = (-(torch.exp(a_live * logp) - 1) / (a_live + 1e-6))[valid].sum()
    torch.testing.assert_close(r.loss_sum, live.detach())
    if valid.any() and temp > 0.5:
        g_live = torch.autograd.grad(live, zz)[0]
        assert not torch.allclose(g_live, expected, rtol=1e-6, atol=1e-9)


@FAST
@given(
    logp=st.lists(st.floats(-30.0, 0.0), min_size=2, max_size=20),
    alpha=st.floats(1e-3, 1.0),
)
def test_deft_loss_nonnegative_monotone_and_zero_at_certainty(logp, alpha):
    logp = torch.tensor(sorted(logp), dtype=F64)
    for objective in (DEFT(), DeformedLog(alpha)):
        loss, gate = objective.terms(logp, torch.full_like(logp, alpha), None)
        assert (loss >= 0).all() and (gate >= 0).all()
        assert (loss[1:] <= loss[:-1] + 1e-12).all()  # decreasing in p_y
        zero, _ = objective.terms(torch.zeros(1, dtype=F64), torch.full((1,), alpha, dtype=F64), None)
        assert float(zero) == 0.0
        assert (loss <= 1 / alpha + 1e-9).all()  # bounded by 1/α, unlike CE


@FAST
@given(v=st.integers(2, 5000), n=sizes)
def test_deft_alpha_is_one_over_v_for_uniform(v, n):
    z = torch.zeros(n, v, dtype=F64, requires_grad=True)
    y = torch.zeros(n, dtype=torch.long)
    r = loss_on_logits(z, y, "deft", chunk_size=3)
    a = 1 / v
    expected = -(math.exp(a * math.log(1 / v)) - 1) / (a + 1e-6) * n
    torch.testing.assert_close(r.loss_sum, torch.tensor(expected, dtype=F64))


@FAST
@given(seed=seeds, v=vocab, margin=st.floats(20.0, 40.0))
def test_deft_alpha_tends_to_one_when_confident(seed, v, margin):
    z = torch.zeros(1, v, dtype=F64)
    z[0, seed % v] = margin
    z.requires_grad_()
    y = torch.tensor([seed % v])
    g = grad_z(loss_on_logits(z, y, "deft"), z)
    g1 = grad_z(loss_on_logits(z, y, DeformedLog(1.0)), z)
    torch.testing.assert_close(g, g1, rtol=1e-5, atol=1e-30)


@FAST
@given(p=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=30), p_bar=st.floats(0.0, 1.0))
def test_cayley_alpha_range_and_monotone(p, p_bar):
    p = torch.tensor(sorted(p), dtype=F64)
    a = cayley_alpha(p, torch.tensor(p_bar, dtype=F64))
    assert (a >= 0.001).all() and (a <= 1).all()
    assert (a[1:] >= a[:-1] - 1e-12).all()
    local = cayley_alpha(p, torch.tensor(0.0, dtype=F64))
    torch.testing.assert_close(local.clamp(min=0.001), (p / (2 - p)).clamp(min=0.001), atol=1e-7, rtol=0)
    assert float(cayley_alpha(torch.ones(1, dtype=F64), torch.tensor(p_bar))) > 1 - 1e-6


@FAST
@given(seed=seeds, n=sizes, v=vocab)
def test_cayley_default_p_bar_is_call_mean(seed, n, v):
    z, y = logits(seed, n, v), targets(seed, n, v, masked_fraction=0.3)
    valid = y != -100
    p_y = torch.softmax(z.detach(), -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    p_bar = p_y[valid].mean() if valid.any() else torch.tensor(0.0, dtype=F64)
    auto = loss_on_logits(z, y, "deft_cayley", chunk_size=2)
    given_ = loss_on_logits(z, y, "deft_cayley", p_bar=p_bar)
    dense = loss_on_logits(z, y, "deft_cayley", "dense")
    torch.testing.assert_close(auto.loss_sum, given_.loss_sum)
    torch.testing.assert_close(auto.loss_sum, dense.loss_sum)


# ---- C2: DFT --------------------------------------------------------------------------------


@FAST
@given(seed=seeds, n=sizes, v=vocab, temp=temperatures)
def test_dft_gradient_equals_one_minus_p_gradient_and_is_bounded(seed, n, v, temp):
    z, y = logits(seed, n, v, temp), targets(seed, n, v, masked_fraction=0.3)
    r = loss_on_logits(z, y, "dft")
    valid = y != -100
    g_ref, _ = reference_grad(z, y.clamp(min=0), lambda logp, p: (1 - logp.exp()) * valid)
    g = grad_z(r, z)
    torch.testing.assert_close(g, g_ref)
    p = torch.softmax(z.detach(), -1)
    p_y = p.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    bound = math.sqrt(2) * p_y * (1 - p_y)
    assert (g.norm(dim=-1) <= bound + 1e-12).all() and (bound <= math.sqrt(2) / 4 + 1e-12).all()
    assert (g[~valid] == 0).all()


@FAST
@given(seed=seeds, v=vocab)
def test_dft_zero_gradient_at_certainty(seed, v):
    z = torch.full((1, v), -1e3, dtype=F64)
    z[0, seed % v] = 0
    z.requires_grad_()
    g = grad_z(loss_on_logits(z, torch.tensor([seed % v]), "dft"), z)
    assert g.abs().max() == 0


@FAST
@given(seed=seeds, n=sizes, v=vocab, objective=st.sampled_from(["ce", "deft", "dft", "infosft"]))
def test_masked_tokens_contribute_nothing(seed, n, v, objective):
    z, y = logits(seed, n, v), targets(seed, n, v, masked_fraction=0.5)
    r = loss_on_logits(z, y, objective)
    z2 = z.detach().clone()
    z2[y == -100] = torch.randn_like(z2[y == -100]) * 50
    z2.requires_grad_()
    r2 = loss_on_logits(z2, y, objective)
    torch.testing.assert_close(r.loss_sum, r2.loss_sum)
    assert (grad_z(r2, z2)[y == -100] == 0).all()
    assert int(r.num_valid) == int((y != -100).sum())


# ---- C3: InfoSFT ----------------------------------------------------------------------------


@FAST
@given(q=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30), p_bar=st.floats(0.05, 0.99))
def test_infosft_weight_nonnegative_and_zero_above_p_bar(q, p_bar):
    q = torch.tensor(q, dtype=F64)
    w = infosft_weight(q.log(), p_bar)
    assert torch.isfinite(w).all() and (w >= 0).all()
    seen = q.log().exp()  # the q the weight sees (exp∘log may move q by an ulp across p̄)
    assert (w[seen >= p_bar] == 0).all()


@FAST
@given(q=st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=30), a=st.floats(0.05, 0.98), b=st.floats(0.05, 0.98))
def test_infosft_weight_monotone_in_p_bar(q, a, b):
    lo, hi = sorted((a, b))
    log_q = torch.tensor(q, dtype=F64).log()
    assert (infosft_weight(log_q, hi) >= infosft_weight(log_q, lo) - 1e-12).all()


def test_infosft_weight_peak():
    q = torch.linspace(1e-4, 0.9999, 200001, dtype=F64)
    w = infosft_weight(q.log(), 0.93)
    assert abs(float(w.max()) - 1.314) < 2e-3 and abs(float(q[w.argmax()]) - 0.568) < 2e-3


@FAST
@given(seed=seeds, n=sizes, v=vocab, temp=temperatures, p_bar=st.floats(0.3, 0.99))
def test_infosft_gradient_is_weighted_grad_q_without_gradient_through_w(seed, n, v, temp, p_bar):
    z, y = logits(seed, n, v, temp), targets(seed, n, v)
    r = loss_on_logits(z, y, InfoSFT(p_bar=p_bar))
    c = math.log(p_bar / (1 - p_bar))

    def surrogate(logp, p):
        q = logp.exp()
        qc = q.detach().clamp(1e-6, 1 - 1e-6)
        return -torch.relu(c - (qc.log() - torch.log1p(-qc))) * q  # −[C − logit q]_+ · q

    g_ref, _ = reference_grad(z, y, surrogate)
    torch.testing.assert_close(grad_z(r, z), g_ref)


# ---- C4: CADFT ------------------------------------------------------------------------------


@FAST
@given(seed=seeds, n=sizes, v=vocab, backend=st.sampled_from(["chunked", "dense"]))
def test_cadft_with_unit_compatibility_is_dft_exactly(seed, n, v, backend):
    z, y = logits(seed, n, v), targets(seed, n, v, masked_fraction=0.3)
    docs = torch.arange(n) // 3
    dft = loss_on_logits(z, y, "dft", backend)
    g_dft = grad_z(dft, z)
    for r in (
        loss_on_logits(z, y, "cadft", backend, compat=torch.ones(n, dtype=F64)),
        loss_on_logits(z, y, CADFT(temperature=math.inf), backend, doc_ids=docs),
    ):
        assert torch.equal(r.loss_sum.detach(), dft.loss_sum.detach())
        assert torch.equal(grad_z(r, z), g_dft)


@FAST
@given(seed=seeds, n=st.integers(2, 12), v=vocab, temp=st.floats(0.3, 4.0), floor=st.floats(0.0, 0.5))
def test_cadft_gradient_has_no_term_through_c(seed, n, v, temp, floor):
    z, y = logits(seed, n, v), targets(seed, n, v, masked_fraction=0.2)
    docs = torch.arange(n) % 3
    r = loss_on_logits(z, y, CADFT(temperature=temp, floor=floor), doc_ids=docs, chunk_size=2)
    valid = y != -100
    logp_all = torch.log_softmax(z.detach(), -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    c = torch.ones(n, dtype=F64)
    for d in range(3):
        m = (docs == d) & valid
        if m.any():
            c[docs == d] = max(floor, math.exp(float(logp_all[m].mean()) / temp))
    g_ref, l_ref = reference_grad(z, y.clamp(min=0), lambda logp, p: -c * logp.exp().detach() * logp * valid)
    torch.testing.assert_close(r.loss_sum, l_ref)
    torch.testing.assert_close(grad_z(r, z), g_ref)


@FAST
@given(means=st.lists(st.floats(-20.0, 0.0), min_size=2, max_size=8), temp=st.floats(0.1, 10.0))
def test_cadft_compatibility_monotone_in_sequence_likelihood(means, temp):
    # One token per sample: the sample's length-normalized log-likelihood is that token's.
    logp = torch.tensor(sorted(means), dtype=F64)
    c = cadft_compatibility(logp, torch.arange(len(means)), torch.ones(len(means), dtype=torch.bool), temperature=temp)
    assert (c >= 0).all() and (c <= 1).all()
    assert (c[1:] >= c[:-1]).all()


# ---- C5 / C6: chunked cross-entropy ---------------------------------------------------------


@st.composite
def masked_problems(draw):
    n = draw(st.integers(1, 24))
    v = draw(st.integers(2, 11))
    d = draw(st.integers(1, 5))
    seed = draw(seeds)
    # Runs of masked and unmasked tokens: fully masked chunks and unequal valid counts.
    mask = []
    while len(mask) < n:
        mask += [draw(st.booleans())] * draw(st.integers(1, 6))
    return n, v, d, seed, torch.tensor(mask[:n])


@settings(max_examples=40, deadline=None)
@given(problem=masked_problems(), objective=st.sampled_from(["ce", "deft", "deft_cayley", "dft", "infosft", "cadft"]),
       softcap=st.sampled_from([None, 1.5]), z_loss=st.sampled_from([0.0, 0.01]))
def test_chunked_equals_dense_for_every_chunk_size(problem, objective, softcap, z_loss):
    n, v, d, seed, masked = problem
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(v, d, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=F64, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    y[masked] = -100
    kw = dict(objective=objective, bias=b, softcap=softcap, z_loss=z_loss, doc_ids=torch.arange(n) // 5)
    dense = token_loss(h, W, y, backend="dense", **kw)
    g_dense = torch.autograd.grad(dense.loss_sum, (h, W, b))
    for chunk in range(1, n + 2):
        r = token_loss(h, W, y, backend="chunked", chunk_size=chunk, **kw)
        torch.testing.assert_close(r.loss_sum, dense.loss_sum)
        assert int(r.num_valid) == int((~masked).sum())
        for a, e in zip(torch.autograd.grad(r.loss_sum, (h, W, b)), g_dense):
            torch.testing.assert_close(a, e)


@FAST
@given(seed=seeds, n=sizes, v=vocab, chunk=st.integers(1, 4))
def test_chunked_independent_of_row_order_and_vocab_order(seed, n, v, chunk):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 4, generator=g, dtype=F64, requires_grad=True)
    W = torch.randn(v, 4, generator=g, dtype=F64, requires_grad=True)
    y = targets(seed, n, v, masked_fraction=0.3)
    base = token_loss(h, W, y, chunk_size=chunk)
    gh, gW = torch.autograd.grad(base.loss_sum, (h, W))
    rows, cols = torch.randperm(n, generator=g), torch.randperm(v, generator=g)
    inverse = torch.argsort(cols)  # new id of old vocab entry j is inverse[j]
    y2 = torch.where(y[rows] >= 0, inverse[y[rows].clamp(min=0)], -100)
    h2 = h.detach()[rows].requires_grad_()
    W2 = W.detach()[cols].requires_grad_()
    r = token_loss(h2, W2, y2, chunk_size=chunk)
    torch.testing.assert_close(r.loss_sum, base.loss_sum)
    gh2, gW2 = torch.autograd.grad(r.loss_sum, (h2, W2))
    torch.testing.assert_close(gh2, gh[rows])
    torch.testing.assert_close(gW2, gW[cols])


# ---- C7: NEFTune and symmetric noise --------------------------------------------------------


@FAST
@given(seed=seeds, b=st.integers(1, 3), seq=st.integers(1, 16), d=st.integers(1, 16),
       alpha=st.one_of(st.just(0.0), st.floats(1e-3, 20.0)), use_lengths=st.booleans())
def test_neftune_and_symnoise_bounds(seed, b, seq, d, alpha, use_lengths):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(b, seq, d, generator=g, dtype=F64)
    lengths = torch.randint(1, seq + 1, (b,), generator=g) if use_lengths else None
    L = (lengths if use_lengths else torch.full((b,), seq)).to(F64)
    bound = (alpha / torch.sqrt(L * d))[:, None, None]
    past_end = (torch.arange(seq) >= L[:, None])[..., None]
    for fn in (neftune, symnoise):
        noisy = fn(e, alpha, generator=g, training=True, lengths=lengths)
        delta = (noisy - e).abs()
        assert noisy.dtype == e.dtype and noisy.shape == e.shape
        assert (delta <= bound * (1 + 1e-6)).all()  # the noise is drawn in fp32
        assert (delta.masked_select(past_end.expand_as(delta)) == 0).all()
        if fn is symnoise:
            inside = ~past_end.expand_as(delta)
            torch.testing.assert_close(delta[inside], bound.expand_as(delta)[inside], rtol=1e-6, atol=0)
        assert fn(e, alpha, generator=g, training=False, lengths=lengths) is e
        assert fn(e, 0.0, generator=g, training=True) is e
