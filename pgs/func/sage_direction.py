"""SAGE: Lion's sign direction damped by an O(d) per-column statistic (docs/techniques/sage.md).

Lee & Kim, "SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization",
arXiv 2604.07663 (ACL 2026 Findings).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count
from pgs.func.base import DIRECTION, MATRIX, Transform, chain, check_range, hp_in, identity
from pgs.func.learning_rate import scale_by_learning_rate, takes_learning_rate
from pgs.func.muon_direction import is_embedding_or_head
from pgs.func.weight_decay import add_decayed_weights, mask_fn

ORDERS = ("canon", "official")


def is_embedding(path: str, param) -> bool:
    """Default embedding mask: a matrix whose path names an embedding (embed / wte / wpe)."""
    low = path.lower()
    return param.ndim == 2 and is_embedding_or_head(path) and "lm_head" not in low


class ScaleBySageState(NamedTuple):
    count: torch.Tensor  # int32
    mu: object  # momentum m, mu_dtype
    s: object  # S: fp32, [1, d] for embeddings (O(d)), elementwise otherwise


def scale_by_sage(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-8, embedding=is_embedding,
                  order: str = "canon", mu_dtype: torch.dtype | None = None) -> Transform:
    """SAGE's damped sign direction, without the learning rate.

    s_t = mean over the vocab axis of |g_t| ([1, d]) for embeddings, |g_t| elementwise otherwise
    S_t = β2 S_{t−1} + (1−β2) s_t ;  Ŝ_t = S_t/(1−β2^t)
    H_t = min( rms(Ŝ_t)/(Ŝ_t+ε), rms(s_t)/(s_t+ε), 1 )           0 ≤ H ≤ 1
    u_t = sign(β1 m_{t−1} + (1−β1) g_t) ⊙ H_t ;  m_t = β2 m_{t−1} + (1−β2) g_t

    rms is over the whole statistic of one tensor.  H broadcasts over the vocab axis.

    **Momentum ordering.**  ``order="canon"`` (default) is the form above (the zij canon,
    and Lion's order: the direction is taken, then m is updated).  The official code
    (``UniSAGE``) updates m first and then takes sign(β1 m_t + (1−β1) g_t);
    ``order="official"`` gives that.  The canon form is the default because it makes SAGE
    with H ≡ 1 exactly ``scale_by_lion`` (A7 invariant 3), so the damper is the only
    difference a user is choosing, and it matches the paper's own description of SAGE as
    Lion plus a damper.

    Args:
        b1, b2: β1, β2 in [0, 1].
        eps: ε ≥ 0.
        embedding: ``(path, param) -> bool`` selecting embedding matrices (vocab rows);
            default: 2-D leaves whose path names embed / wte / wpe.
        order: "canon" | "official".
        mu_dtype: storage dtype of m.

    Paper: arXiv 2604.07663; official code naubull2/SAGE-optimizer (UniSAGE).
    """
    who = "scale_by_sage"
    check_range("b1", b1, 0.0, 1.0, who=who)
    check_range("b2", b2, 0.0, 1.0, hi_open=True, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    if order not in ORDERS:
        raise InvalidArgument(f"{who}: order={order!r}, expected one of {ORDERS}")
    emb = mask_fn(embedding, who)

    def is_emb(path, p):
        return p.ndim == 2 and bool(emb(path, p))

    def init(params, **extra):
        def s0(path, p):
            shape = (1, p.shape[1]) if is_emb(path, p) else p.shape
            return torch.zeros(shape, dtype=torch.float32, device=p.device)

        mu = T.tree_map(lambda p: torch.zeros_like(p, dtype=mu_dtype or p.dtype), params)
        return ScaleBySageState(zero_count(params), mu, T.tree_map_with_path(s0, params))

    def update(updates, state, params=None, **extra):
        count = increment(state.count)
        bc = 1.0 - b2 ** count.to(torch.float64)

        def one(path, g, m, S):
            cd = compute_dtype(g)
            g32, m32 = g.to(cd), m.to(cd)
            a = g32.abs().float()
            s = a.mean(dim=0, keepdim=True) if S.shape != g.shape else a
            S_new = S * hp_in(b2, torch.float32, g.device) + hp_in(1.0 - b2, torch.float32, g.device) * s
            S_hat = S_new / bc.to(torch.float32)
            h_ema = torch.sqrt(S_hat.square().mean()) / (S_hat + eps)
            h_now = torch.sqrt(s.square().mean()) / (s + eps)
            H = torch.minimum(torch.minimum(h_ema, h_now), torch.ones_like(h_ema))
            omb1, omb2 = (hp_in(x, cd, g.device) for x in (1.0 - b1, 1.0 - b2))
            m_next = m32.lerp(g32, omb2)
            c = (m_next if order == "official" else m32).lerp(g32, omb1).sign()
            u = c * H.to(cd)
            return u.to(g.dtype), m_next.to(m.dtype), S_new

        out_u, out_m, out_s = _map_with_path(one, updates, state.mu, state.s)
        return out_u, ScaleBySageState(count, out_m, out_s)

    return Transform(init, update, name="scale_by_sage", locality=MATRIX, flat_ok=False, group_by=(),
                     stage=DIRECTION)


def _map_with_path(fn, tree, *rest):
    """``fn(path, leaf, *others) -> 3-tuple`` over leaves; three trees shaped like ``tree``."""
    leaves, spec = T.flatten(tree)
    paths = T.paths(tree)
    others = [T.flatten(r)[0] for r in rest]
    outs = ([], [], [])
    for i, (path, x) in enumerate(zip(paths, leaves)):
        if x is None:
            for o in outs:
                o.append(None)
            continue
        res = fn(path, x, *(o[i] for o in others))
        for o, r in zip(outs, res):
            o.append(r)
    return tuple(T.unflatten(o, spec) for o in outs)


@takes_learning_rate
def sage(learning_rate=2e-3, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
         embedding=is_embedding, order: str = "canon", mu_dtype: torch.dtype | None = None) -> Transform:
    """SAGE = chain(scale_by_sage, add_decayed_weights, scale_by_learning_rate).

    θ ← θ(1 − ηλ) − η (C_t ⊙ H_t)  (see ``scale_by_sage``).  UniSAGE's defaults: lr 2e-3,
    betas (0.9, 0.99), eps 1e-8 (its weight decay default is 1e-2; pgs defaults to 0).

    Paper: arXiv 2604.07663.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="sage")
    return chain(
        scale_by_sage(b1, b2, eps, embedding, order, mu_dtype),
        (add_decayed_weights(weight_decay) if (isinstance(weight_decay, torch.Tensor) or weight_decay != 0)
         else identity()),
        scale_by_learning_rate(learning_rate),
    )
