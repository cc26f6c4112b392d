"""Router losses and load statistics of a mixture-of-experts layer (pure: tensors in, tensors out).

A router gives each token ``t`` logits ``x_t ∈ R^E`` over ``E`` experts and sends it to the
``k`` experts of largest probability ``p_t = softmax(x_t)``.  Everything the auxiliary losses
and the load telemetry need is a *sum over tokens* (:func:`router_stats`), so statistics of
micro-batches and ranks add up, and a loss over the global batch is computed from the summed
statistics:

* ``counts_i``   = #{(t, j): token t's j-th choice is expert i}     (Σ_i counts_i = k·T)
* ``prob_sum_i`` = Σ_t p_{t,i}                                       (differentiable)
* ``z_sum``      = Σ_t (log Σ_i exp x_{t,i})²                         (differentiable)
* ``entropy_sum``= Σ_t H(p_t)
* ``tokens``     = T

Load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961, eq. 4; the
top-k form of GShard, arXiv:2006.16668)::

    L_lb = E · Σ_i f_i · P_i,   f_i = counts_i / (k·T),   P_i = prob_sum_i / T

``f`` is a count (no gradient); ``P`` carries the gradient to the router.  ``L_lb = 1`` when
the load and the probabilities are uniform, whatever ``E`` and ``k``.  (transformers'
``load_balancing_loss_func`` divides the counts by ``T`` instead of ``k·T``: its value is
``k · L_lb`` for one layer.)

Router z-loss (ST-MoE, Zoph et al. 2022, arXiv:2202.08906, eq. 5)::

    L_z = (1/T) Σ_t (log Σ_i exp x_{t,i})²

Maximal violation (Loss-Free Balancing, Wang et al. 2024, arXiv:2408.15664, eq. 6)::

    MaxVio = max_i counts_i / mean_i counts_i − 1   (0: perfectly balanced)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RouterStats(NamedTuple):
    """Token sums of one router (shapes ``[..., E]`` for ``prob_sum``/``counts``, ``[...]`` for
    the rest; a leading layer axis when stacked).  ``prob_sum`` and ``z_sum`` keep their graph."""

    prob_sum: Tensor
    z_sum: Tensor
    counts: Tensor
    entropy_sum: Tensor
    tokens: Tensor


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def router_stats(logits: Tensor, top_k: int, selected: Tensor | None = None,
                 mask: Tensor | None = None) -> RouterStats:
    """The token sums of one router's logits ``[T, E]`` (module docstring).

    ``selected [T, k]``: the experts the model chose (its own top-k, which may differ from the
    top-k of ``softmax(logits)`` for a router with a bias or groups); None: the top-k of the
    logits.  ``mask [T]`` (bool): the tokens that count (padding excluded); None: all.
    Sums are in fp32 (fp64 for fp64 logits).
    """
    if logits.dim() != 2:
        raise ValueError(f"router_stats: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= int(top_k) <= logits.shape[-1]:
        raise ValueError(f"router_stats: top_k={top_k} must be in [1, {logits.shape[-1]}]")
    x = logits.to(_stat_dtype(logits))
    if selected is None:
        selected = torch.topk(x.detach(), int(top_k), dim=-1).indices
    keep = None if mask is None else mask.reshape(-1).to(device=x.device, dtype=x.dtype)
    logz = torch.logsumexp(x, dim=-1)
    logp = x - logz[:, None]
    p = logp.exp()
    entropy = -(p.detach() * logp.detach()).sum(-1)
    z = logz.square()
    # counts_i: each (token, choice) pair adds the token's weight (1, or its mask) into bin i; the
    # sums are whole numbers, exact in fp32 up to 2^24 assignments
    weight = (torch.ones(selected.shape, dtype=x.dtype, device=x.device) if keep is None
              else keep[:, None].expand(selected.shape).reshape(-1))
    counts = x.new_zeros(x.shape[-1]).scatter_add_(0, selected.reshape(-1).long(), weight.reshape(-1))
    if keep is not None:
        p, z, entropy = p * keep[:, None], z * keep, entropy * keep
        tokens = keep.sum()
    else:
        tokens = torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)
    return RouterStats(p.sum(0), z.sum(), counts, entropy.sum(), tokens)


def load_balance_loss(counts: Tensor, prob_sum: Tensor, tokens: Tensor, top_k: int | Tensor,
                      count_tokens: Tensor | None = None) -> Tensor:
    """Switch load-balancing loss ``E · Σ_i f_i P_i`` (arXiv:2101.03961, eq. 4), per router.

    ``counts``, ``prob_sum``: ``[..., E]`` token sums (:func:`router_stats`; ``counts`` gets no
    gradient); ``tokens``: ``[...]``, the ``T`` of ``P = prob_sum / T``.  ``top_k``: an int, or
    a ``[...]`` tensor of each router's ``k`` (stacked routers of different ``k``; one call for
    every layer instead of one per layer).  ``count_tokens``: the
    ``T`` of ``f = counts / (k·T)`` when the counts cover other tokens than ``prob_sum`` (one
    micro-batch's share of a global batch's loss: ``f`` from the counts known so far, ``P`` a
    partial sum over the global token count); None: ``tokens``.  Returns ``[...]``: 1 for
    uniform load and probabilities.
    """
    num_experts = counts.shape[-1]
    t = tokens.clamp_min(1)[..., None]
    tc = t if count_tokens is None else count_tokens.clamp_min(1)[..., None]
    k = top_k.to(tc.dtype)[..., None] if isinstance(top_k, Tensor) else int(top_k)
    f = counts.detach() / (k * tc)
    return num_experts * (f * (prob_sum / t)).sum(-1)


def router_z_loss(z_sum: Tensor, tokens: Tensor) -> Tensor:
    """Router z-loss ``(1/T) Σ_t (logsumexp x_t)²`` (ST-MoE, arXiv:2202.08906, eq. 5)."""
    return z_sum / tokens.clamp_min(1)


def max_violation(counts: Tensor) -> Tensor:
    """``max_i counts_i / mean_i counts_i − 1`` over the last axis (arXiv:2408.15664, eq. 6);
    0 for a router that saw no token."""
    mean = counts.mean(-1)
    return torch.where(mean > 0, counts.amax(-1) / mean.clamp_min(1e-30) - 1, torch.zeros_like(mean))


def load_utilization(counts: Tensor) -> Tensor:
    """Effective share of experts used: ``exp(H(load)) / E`` with ``load = counts / Σ counts``
    (1: every expert the same load; 1/E: one expert takes all)."""
    total = counts.sum(-1, keepdim=True)
    q = counts / total.clamp_min(1e-30)
    h = -(q * torch.where(q > 0, q.log(), torch.zeros_like(q))).sum(-1)
    return torch.where(total[..., 0] > 0, h.exp() / counts.shape[-1], torch.zeros_like(h))


def dead_fraction(counts: Tensor) -> Tensor:
    """Share of experts that received no token (over the last axis)."""
    return (counts <= 0).to(counts.dtype).mean(-1)
