"""AdaGC: adaptive per-tensor gradient clipping (docs/techniques/adagc.md).

Wang et al., "AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient Clipping",
ICML 2026, arXiv 2502.11034.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import f32_scalar, increment, zero_count
from pgs.func.base import DIRECTION, GLOBAL, Transform, check_range
from pgs.func.layout import per_tensor_apply, per_tensor_sumsq
from pgs.func.step import NO_CONTEXT, StepContext


class AdaGCState(NamedTuple):
    count: torch.Tensor  # int32: updates seen so far
    gamma: object  # fp32 per-tensor reference norm γ_i (0-d per leaf, [num_tensors] per flat group)


def adagc(lambda_rel: float = 1.05, beta: float = 0.98, lambda_abs: float = 1.0, warmup_steps: int = 100,
          eps: float = 1e-8) -> Transform:
    """Clip each tensor's gradient relative to its own history of (clipped) norms.

    Warmup (t < T_w, and always at t = 1):
        h = min(λ_abs/(‖g_t‖_global + ε), 1) ;  ĝ_i = h g_i
        γ_i = ‖ĝ_i‖ at t = 1, then γ_i = min(γ_i, ‖ĝ_i‖)              (running MIN)
    After warmup:
        h_i = min(λ_rel γ_{i,t−1}/(‖g_{i,t}‖ + ε), 1) ;  ĝ_i = h_i g_i
        γ_{i,t} = β γ_{i,t−1} + (1−β) ‖ĝ_{i,t}‖                        (EMA of CLIPPED norms)

    t counts from 1.  The first step always initializes γ (so ``warmup_steps`` ≤ 1 is safe:
    γ would otherwise start at 0 and zero every later gradient).  ε guards both the global and
    the per-tensor norm (the port guards only the global one).  After warmup
    ‖ĝ_i‖ ≤ λ_rel γ_{i,t−1}, and γ grows by at most a factor β + (1−β)λ_rel per step.  The
    step is chosen with ``torch.where`` (no host sync).  Place it first, before the base
    direction; the paper calls it optimizer-agnostic.  Inside a ``pf.partition`` the warmup's
    global norm is over that branch.

    Args:
        lambda_rel: λ_rel > 0, the allowed growth over γ.
        beta: β in [0, 1), decay of γ's EMA.
        lambda_abs: λ_abs > 0, the global-norm clip during warmup.
        warmup_steps: T_w ≥ 0.
        eps: ε ≥ 0.

    Example::

        opt = pf.chain(pf.adagc(), pf.adamw(3e-4, weight_decay=0.1))

    Paper: arXiv 2502.11034.
    """
    who = "adagc"
    check_range("lambda_rel", lambda_rel, 0.0, None, lo_open=True, who=who)
    check_range("beta", beta, 0.0, 1.0, hi_open=True, who=who)
    check_range("lambda_abs", lambda_abs, 0.0, None, lo_open=True, who=who)
    check_range("warmup_steps", warmup_steps, 0.0, None, who=who)
    check_range("eps", eps, 0.0, None, who=who)

    def init(params, *, ctx: StepContext = NO_CONTEXT, **extra):
        sq = per_tensor_sumsq(params, ctx.layout, ctx.reduce_sum)
        return AdaGCState(zero_count(params), T.tree_map(torch.zeros_like, sq))

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        count = increment(state.count)
        first = count == 1
        warm = (count < warmup_steps) | first
        sq = per_tensor_sumsq(updates, layout, ctx.reduce_sum)  # sharded: all-reduced
        norms = T.tree_map(torch.sqrt, sq)
        total = None
        for x in T.leaves(sq):
            if x is not None:
                total = x.sum() if total is None else total + x.sum()
        if total is None:  # nothing to clip
            return updates, AdaGCState(count, state.gamma)
        gnorm = total.sqrt()

        ref = next(x for x in T.leaves(norms) if x is not None)
        l_abs, l_rel, b, omb, eps_ = (f32_scalar(x, ref) for x in (lambda_abs, lambda_rel, beta, 1.0 - beta, eps))

        def factor(n, g):
            h_warm = torch.clamp(l_abs / (gnorm + eps_), max=1.0)
            h_rel = torch.clamp(l_rel * g / (n + eps_), max=1.0)
            h = torch.where(warm, h_warm, h_rel)
            clipped = h * n
            g_warm = torch.where(first, clipped, torch.minimum(g, clipped))
            return h, torch.where(warm, g_warm, b * g + omb * clipped)

        h, gamma = T.tree_map_n(factor, 2, norms, state.gamma)

        def scale(x, s):
            cd = torch.promote_types(x.dtype, torch.float32)
            return (x.to(cd) * s.to(cd)).to(x.dtype)

        return per_tensor_apply(scale, updates, h, layout=layout), AdaGCState(count, gamma)

    # the warmup reads the global norm, hence GLOBAL (after warmup it is per-tensor)
    return Transform(init, update, name="adagc", locality=GLOBAL, shard_aware=True, stage=DIRECTION,
                     fused=("adagc", dict(lambda_rel=lambda_rel, beta=beta, lambda_abs=lambda_abs,
                                          warmup_steps=warmup_steps, eps=eps)))  # pgs.func.fused_chain8bit
