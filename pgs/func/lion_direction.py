"""Lion's direction (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count, zeros_state
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, check_range, hp_cache


class ScaleByLionState(NamedTuple):
    count: torch.Tensor
    mu: object  # the single momentum buffer, mu_dtype


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, mu_dtype: torch.dtype | None = None) -> Transform:
    """Lion's sign direction, without the learning rate (docs/techniques/lion.md).

    c_t = β1 m_{t−1} + (1−β1) g_t ;  u_t = sign(c_t) ;  m_t = β2 m_{t−1} + (1−β2) g_t

    The momentum is updated after the direction is taken.  sign(0) = 0, so a coordinate with
    c = 0 does not move.  Use a learning rate 3-10× smaller than AdamW's.

    Example::

        opt = pf.chain(pf.scale_by_lion(0.95, 0.98), pf.scale_by_learning_rate(1e-4))

    Paper: arXiv 2302.06675.
    """
    who = "scale_by_lion"
    check_range("b1", b1, 0.0, 1.0, who=who)
    check_range("b2", b2, 0.0, 1.0, who=who)

    def init(params, **extra):
        return ScaleByLionState(zero_count(params), zeros_state(params, mu_dtype))

    def update(updates, state, params=None, **extra):
        hps = hp_cache(1.0 - b1, 1.0 - b2)

        def one(g, m):
            cd = compute_dtype(g)
            w1, w2 = hps(cd, g.device)
            g32, m32 = g.to(cd), m.to(cd)
            u = m32.lerp(g32, w1).sign()
            return u.to(g.dtype), m32.lerp(g32, w2).to(m.dtype)

        u, mu = T.tree_map_n(one, 2, updates, state.mu)
        return u, ScaleByLionState(increment(state.count), mu)

    return Transform(init, update, name="scale_by_lion", locality=ELEMENTWISE, stage=DIRECTION,
                     fused=("lion", dict(b1=b1, b2=b2)))
