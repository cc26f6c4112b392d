"""MONA's acceleration term: an EMA of gradient differences added to the gradient (A2)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count, zeros_state
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, check_range, hp_in


class MonaState(NamedTuple):
    count: torch.Tensor  # int32
    prev: object  # G_{t−1}, rounded to buffer_dtype
    acc: object  # A_t, buffer_dtype


def mona(alpha: float = 0.92, beta: float = 0.92, buffer_dtype: torch.dtype | None = torch.bfloat16) -> Transform:
    """Augment the gradient with an EMA of gradient differences, before the base direction.

    Δ_t = G_t − G_{t−1}          (Δ_1 = 0; G_{t−1} as stored, in ``buffer_dtype``)
    A_t = β A_{t−1} + (1−β) Δ_t
    G̃_t = G_t + α A_t

    Since G_t − G_{t−1} ≈ H(θ_t − θ_{t−1}), A carries curvature along the recent path.  Put
    it first in a chain, before the base direction (Muon, Lion, Adam):
    ``pf.chain(pf.mona(), pf.scale_by_muon(), ...)``.

    **Contract.**  The MONA paper's equations were not recovered (only its abstract was
    readable: "an exponential moving average of gradient differences" added "directly into
    Muon's gradient processing pipeline").  The definition above is the one in the pgs design
    documents, and it is the contract this transform keeps; it is not claimed to be the
    paper's.

    **Defaults.**  The paper's defaults are unknown.  α = β = 0.92 are borrowed from Adan
    (Xie et al., arXiv 2208.06677), the published optimizer with the same gradient-difference
    term: its difference EMA has decay 1 − 0.08 = 0.92 and enters the step with weight
    1 − 0.08 = 0.92, which Adan derives from Nesterov's look-ahead.  α = 0 turns MONA off
    exactly.

    Both buffers (previous gradient, A) are stored in bf16 by default, so with a constant
    gradient Δ is G − bf16(G) (about 2⁻⁹ relative), not exactly 0; ``buffer_dtype=None``
    (the gradient's dtype) makes it exactly 0.  The stored previous gradient is used as is
    (no in-graph rounding), so eager and ``torch.compile`` agree.

    Args:
        alpha: α ≥ 0, weight of the acceleration term.
        beta: β in [0, 1), decay of the EMA of differences.
        buffer_dtype: storage dtype of both buffers (None: the parameter's dtype).

    Example::

        opt = pf.chain(pf.mona(0.92, 0.92), pf.scale_by_muon(), pf.scale_by_learning_rate(0.02))

    Paper: arXiv 2605.26842 (MONA; equations not recovered); arXiv 2208.06677 (Adan, defaults).
    """
    who = "mona"
    check_range("alpha", alpha, 0.0, None, who=who)
    check_range("beta", beta, 0.0, 1.0, hi_open=True, who=who)

    def init(params, **extra):
        return MonaState(zero_count(params), zeros_state(params, buffer_dtype), zeros_state(params, buffer_dtype))

    def update(updates, state, params=None, **extra):
        first = state.count == 0

        def one(g, prev, acc):
            cd = compute_dtype(g)
            g32 = g.to(cd)
            delta = torch.where(first, torch.zeros_like(g32), g32 - prev.to(cd))
            a, b, omb = (hp_in(x, cd, g.device) for x in (alpha, beta, 1.0 - beta))
            acc_new = acc.to(cd) * b + omb * delta
            return (g32 + a * acc_new).to(g.dtype), g.to(prev.dtype), acc_new.to(acc.dtype)

        u, prev, acc = T.tree_map_n(one, 3, updates, state.prev, state.acc)
        return u, MonaState(increment(state.count), prev, acc)

    return Transform(init, update, name="mona", locality=ELEMENTWISE, stage=DIRECTION,
                     # pgs.func.fused_chain8bit
                     fused=("mona", dict(alpha=alpha, beta=beta, buffer_dtype=buffer_dtype)))
