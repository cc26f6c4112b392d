"""Heavy-ball and Nesterov momentum (as torch.optim.SGD computes them)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count, zeros_state
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, check_range, hp_cache


class ScaleBySgdMomentumState(NamedTuple):
    count: torch.Tensor
    momentum: object


def scale_by_sgd_momentum(momentum: float = 0.9, nesterov: bool = False,
                          mu_dtype: torch.dtype | None = None) -> Transform:
    """Momentum direction.

    b_t = μ b_{t−1} + g_t (b_0 = 0, so b_1 = g_1, as torch.optim.SGD)
    u_t = g_t + μ b_t if nesterov else b_t

    Paper: Polyak 1964; Sutskever et al. 2013 (Nesterov form used by torch.optim.SGD).
    """
    who = "scale_by_sgd_momentum"
    check_range("momentum", momentum, 0.0, 1.0, hi_open=True, who=who)
    if nesterov and isinstance(momentum, (int, float)) and momentum == 0:
        raise InvalidArgument(f"{who}: nesterov=True needs momentum > 0")

    def init(params, **extra):
        return ScaleBySgdMomentumState(zero_count(params), zeros_state(params, mu_dtype))

    def update(updates, state, params=None, **extra):
        hps = hp_cache(momentum)

        def one(g, b):
            cd = compute_dtype(g)
            (mu,) = hps(cd, g.device)
            g32 = g.to(cd)
            b_new = b.to(cd).mul(mu).add(g32)
            # one expression for numbers and injected tensors alike (add(alpha=) may fuse to an FMA)
            u = g32 + b_new * mu if nesterov else b_new
            return u.to(g.dtype), b_new.to(b.dtype)

        u, mom = T.tree_map_n(one, 2, updates, state.momentum)
        return u, ScaleBySgdMomentumState(increment(state.count), mom)

    return Transform(init, update, name="scale_by_sgd_momentum", locality=ELEMENTWISE, stage=DIRECTION)
