"""Adam's direction (Kingma & Ba, arXiv 1412.6980; AdamW order: docs/techniques/adamw.md)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, realize_scalar, zero_count, zeros_state
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, check_range, hp_cache


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # int32, updates applied so far
    mu: object  # first moment, mu_dtype
    nu: object  # second moment, nu_dtype


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> Transform:
    """Adam's bias-corrected direction, without the learning rate.

    m_t = β1 m_{t−1} + (1−β1) g_t ;  v_t = β2 v_{t−1} + (1−β2) g_t²
    u_t = (m_t / (1−β1^t)) / (sqrt(v_t / (1−β2^t) + ε_root) + ε)

    ε is added after the bias-corrected square root, as torch.optim.AdamW and optax do.
    Moments are computed in fp32 (fp64 for fp64 inputs) and stored in ``mu_dtype`` /
    ``nu_dtype`` (default: the parameter's dtype).

    Args:
        b1, b2: moment decay rates in [0, 1).
        eps, eps_root: stabilisers (≥ 0).
        mu_dtype, nu_dtype: storage dtypes of the moments.

    Example::

        opt = pf.chain(pf.scale_by_adam(b2=0.95), pf.scale_by_learning_rate(1e-3))

    Paper: arXiv 1412.6980 (Adam), arXiv 1711.05101 (decoupled weight decay).
    """
    who = "scale_by_adam"
    check_range("b1", b1, 0.0, 1.0, hi_open=True, who=who)
    check_range("b2", b2, 0.0, 1.0, hi_open=True, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    check_range("eps_root", eps_root, 0.0, None, who=who)

    def init(params, **extra):
        return ScaleByAdamState(zero_count(params), zeros_state(params, mu_dtype), zeros_state(params, nu_dtype))

    def update(updates, state, params=None, **extra):
        count = increment(state.count)
        t = count.to(torch.float64)
        bc1 = realize_scalar(1.0 - b1**t)
        bc2 = realize_scalar(1.0 - b2**t)

        hps = hp_cache(1.0 - b1, 1.0 - b2, b2, eps_root, eps)

        def one(g, m, v):
            cd = compute_dtype(g)
            w1, w2, d2, er, ep = hps(cd, g.device)
            g32 = g.to(cd)
            m_new = m.to(cd).lerp(g32, w1)
            v_new = v.to(cd).mul(d2)
            # addcmul computes v + (w·g)·g; a tensor w goes into the product, not into value=
            v_new = v_new.addcmul(g32 * w2, g32) if isinstance(w2, torch.Tensor) else v_new.addcmul(g32, g32, value=w2)
            u = (m_new / bc1.to(cd)) / ((v_new / bc2.to(cd) + er).sqrt() + ep)
            return u.to(g.dtype), m_new.to(m.dtype), v_new.to(v.dtype)

        u, mu, nu = T.tree_map_n(one, 3, updates, state.mu, state.nu)
        return u, ScaleByAdamState(count, mu, nu)

    return Transform(init, update, name="scale_by_adam", locality=ELEMENTWISE, stage=DIRECTION,
                     fused=("adam", dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root)))

