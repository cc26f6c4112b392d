"""Properties of the mixture-of-experts router losses and load statistics (pgs.func.losses.moe):
equality with transformers' load-balancing loss, the fixed points the papers state (uniform
routing gives L_lb = 1 and MaxVio = 0), invariances, and the padding mask."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.func.losses import (dead_fraction, load_balance_loss, load_utilization, max_violation, router_stats,
                             router_z_loss)

F64 = torch.float64


def _logits(seed: int, tokens: int, experts: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=gen, dtype=F64) * scale


shapes = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(2, 9))


@given(shape=shapes, data=st.data())
@settings(deadline=None, max_examples=40)
def test_load_balance_equals_transformers_over_k(shape, data):
    """For one router transformers' load_balancing_loss_func is k · L_lb (it divides the counts
    by T, not k·T); values and gradients agree."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    seed, tokens, experts = shape
    k = data.draw(st.integers(1, experts), label="k")
    x = _logits(seed, tokens, experts).requires_grad_()
    s = router_stats(x, k)
    ours = load_balance_loss(s.counts, s.prob_sum, s.tokens, k)
    y = x.detach().clone().requires_grad_()
    theirs = load_balancing_loss_func((y,), experts, k) / k
    torch.testing.assert_close(ours, theirs.to(F64), rtol=1e-5, atol=1e-7)  # transformers sums in fp32
    (gx,) = torch.autograd.grad(ours, x)
    (gy,) = torch.autograd.grad(theirs, y)
    torch.testing.assert_close(gx, gy.to(F64), rtol=1e-4, atol=1e-7)


@given(experts=st.integers(2, 16), k=st.integers(1, 4), rounds=st.integers(1, 5))
def test_uniform_routing_is_one_and_balanced(experts, k, rounds):
    """Equal logits and every expert chosen equally often: L_lb = 1, MaxVio = 0, utilisation 1,
    no dead expert, router entropy log E."""
    k = min(k, experts)
    tokens = experts * rounds
    x = torch.zeros(tokens, experts, dtype=F64)
    selected = (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % experts
    s = router_stats(x, k, selected=selected)
    assert torch.all(s.counts == s.counts[0])
    torch.testing.assert_close(load_balance_loss(s.counts, s.prob_sum, s.tokens, k), torch.tensor(1.0, dtype=F64))
    assert float(max_violation(s.counts)) == 0.0
    torch.testing.assert_close(load_utilization(s.counts), torch.tensor(1.0, dtype=F64))
    assert float(dead_fraction(s.counts)) == 0.0
    torch.testing.assert_close(s.entropy_sum / s.tokens, torch.tensor(math.log(experts), dtype=F64))


@given(shape=shapes, shift=st.floats(-20, 20))
def test_shift_invariance_and_z_loss_reference(shape, shift):
    """Adding a constant to every logit of a token changes neither the probabilities nor the
    choice (L_lb unchanged) but moves logsumexp by the constant (z-loss = mean (lse + c)²)."""
    seed, tokens, experts = shape
    x = _logits(seed, tokens, experts)
    a, b = router_stats(x, 1), router_stats(x + shift, 1)
    torch.testing.assert_close(load_balance_loss(a.counts, a.prob_sum, a.tokens, 1),
                               load_balance_loss(b.counts, b.prob_sum, b.tokens, 1))
    reference = (torch.logsumexp(x, -1) + shift).square().mean()
    torch.testing.assert_close(router_z_loss(b.z_sum, b.tokens), reference)
    assert float(router_z_loss(a.z_sum, a.tokens)) >= 0


@given(shape=shapes, data=st.data())
def test_mask_equals_dropping_the_tokens(shape, data):
    seed, tokens, experts = shape
    k = data.draw(st.integers(1, experts), label="k")
    x = _logits(seed, tokens, experts)
    mask = torch.rand(tokens, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    masked, kept = router_stats(x, k, mask=mask), router_stats(x[mask], k)
    for m, c in zip(masked, kept):
        torch.testing.assert_close(m, c.to(m.dtype), rtol=1e-12, atol=1e-12)


@given(counts=st.lists(st.integers(0, 50), min_size=2, max_size=12), scale=st.integers(1, 7))
def test_load_metrics_ranges_and_scale_invariance(counts, scale):
    c = torch.tensor(counts, dtype=F64)
    e = len(counts)
    vio, util, dead = max_violation(c), load_utilization(c), dead_fraction(c)
    assert float(vio) >= 0 and float(vio) <= e - 1 + 1e-9
    assert float(dead) == sum(1 for v in counts if v == 0) / e
    if sum(counts):
        assert 1 / e - 1e-12 <= float(util) <= 1 + 1e-12
    else:
        assert float(vio) == 0 and float(util) == 0
    torch.testing.assert_close(max_violation(c * scale), vio)
    torch.testing.assert_close(load_utilization(c * scale), util)


def test_stacked_layers_reduce_per_layer():
    """A leading layer axis: each layer's loss is its own."""
    x = _logits(3, 20, 5)
    y = _logits(4, 20, 5)
    a, b = router_stats(x, 2), router_stats(y, 2)
    stacked = [torch.stack([u, v]) for u, v in zip(a, b)]
    both = load_balance_loss(stacked[2], stacked[0], stacked[4], 2)
    torch.testing.assert_close(both, torch.stack([load_balance_loss(a.counts, a.prob_sum, a.tokens, 2),
                                                  load_balance_loss(b.counts, b.prob_sum, b.tokens, 2)]))
