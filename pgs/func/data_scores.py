"""Scores and orders of training samples, as pure functions of per-token statistics or embeddings.

``pgs prepare`` (``pgs.runtime.prepare``) computes the per-token statistics with the model
(``pgs.func.losses.token_nll_entropy``) and calls these; nothing here reads a file or a model.

* :func:`hes` — the High-Entropy Sum of a response (arXiv 2605.22389; docs/techniques/hes.md).
* :func:`tfp_order` — the greedy threshold-filtered nearest-neighbour path of Threshold
  Filtering Packing (arXiv 2408.09327; docs/techniques/tfp.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pgs.errors import InvalidArgument

#: HES's share of the response's tokens summed: "the top 0.5%" (arXiv 2605.22389).
HES_RHO = 0.005


def hes_k(length: int, rho: float = HES_RHO) -> int:
    """How many token entropies HES sums for a response of ``length`` tokens: max(1, ⌈ρ·T⌉).

    0 for an empty response.  Non-decreasing in ``length``.
    """
    if not 0 < rho <= 1:
        raise InvalidArgument(f"rho must be in (0, 1], got {rho}")
    if length <= 0:
        return 0
    return max(1, math.ceil(rho * length - 1e-9))


def hes(entropies: Tensor, rho: float = HES_RHO) -> float:
    """High-Entropy Sum: the sum of the k = max(1, ⌈ρ·T⌉) largest token entropies of a response.

    HES = Σ_{t ∈ top-k(H)} H_t,  H_t = − Σ_v p_t(v) log p_t(v)  (nats),  ρ = 0.005.

    ``entropies``: the response's T token entropies (1-D).  0 for an empty response.  Invariant
    to token order; never lowered by raising one H_t; ≤ k·log V.  For T ≤ 200, k = 1 and HES is
    the largest entropy.  Li et al., "Unified Data Selection for LLM Reasoning", arXiv 2605.22389.

    Example::

        hes(torch.tensor([0.1, 2.0, 0.5]))   # 2.0 (k = 1)
    """
    if entropies.dim() != 1:
        raise InvalidArgument(f"entropies must be 1-D (one response), got shape {tuple(entropies.shape)}")
    k = hes_k(entropies.numel(), rho)
    if k == 0:
        return 0.0
    return float(torch.topk(entropies.double(), k).values.sum())


def tfp_order(embeddings: Tensor, threshold: float = 0.0, window: int = 1, start: int = 0) -> list[int]:
    """A permutation of the samples: the greedy nearest-neighbour path with a threshold filter.

    From the current sample, go to the nearest unvisited one (Euclidean distance) among those
    whose distance to each of the last ``window`` samples on the path is > ``threshold`` (no
    near-duplicates side by side); when none passes the filter, to the nearest unvisited one.
    Ties go to the lower index, so the path is deterministic.  ``threshold = 0`` and
    ``window = 1`` is the plain greedy nearest-neighbour path.  Every sample appears once.

    Dong et al., "Threshold Filtering Packing for Supervised Fine-Tuning", arXiv 2408.09327
    (their defaults for the threshold and the window were not recovered; docs/techniques/tfp.md).
    O(N²·D) time: meant for thousands of samples, not millions.
    """
    if embeddings.dim() != 2:
        raise InvalidArgument(f"embeddings must be [N, D], got shape {tuple(embeddings.shape)}")
    if threshold < 0 or window < 1:
        raise InvalidArgument(f"threshold must be >= 0 and window >= 1, got {threshold}, {window}")
    n = embeddings.shape[0]
    if n == 0:
        return []
    if not 0 <= start < n:
        raise InvalidArgument(f"start {start} is outside the {n} samples")
    x = embeddings.double()
    visited = torch.zeros(n, dtype=torch.bool)
    path = [start]
    visited[start] = True
    inf = torch.tensor(float("inf"), dtype=x.dtype)
    for _ in range(n - 1):
        d_cur = torch.cdist(x[path[-1]][None], x)[0]
        recent = x[path[-window:]]
        d_recent = torch.cdist(recent, x).min(dim=0).values
        free = ~visited
        passing = free & (d_recent > threshold)
        pool = passing if bool(passing.any()) else free
        # argmin returns the first minimum: ties go to the lower index
        nxt = int(torch.where(pool, d_cur, inf).argmin())
        path.append(nxt)
        visited[nxt] = True
    return path
