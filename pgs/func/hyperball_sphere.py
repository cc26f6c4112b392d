"""Hyperball: keep each weight matrix on its initial Frobenius sphere (docs/techniques/hyperball.md).

Wen, Dang, Lyu, Ma, Liang, "Fantastic Pretraining Optimizers and Where to Find Them II:
Hyperball Optimization", arXiv 2606.16899.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import increment, zero_count
from pgs.func.adam import scale_by_adam
from pgs.func.base import PER_TENSOR, STEP, Transform, chain, check_range
from pgs.func.combine import partition
from pgs.func.layout import group_label, per_tensor_apply, per_tensor_sumsq
from pgs.func.learning_rate import lr_value as _lr_value, takes_learning_rate
from pgs.func.muon_direction import NS_COEFFICIENTS, muon_route, scale_by_muon
from pgs.func.weight_decay import mask_fn
from pgs.func.step import NO_CONTEXT, StepContext


class HyperballState(NamedTuple):
    count: torch.Tensor  # int32: updates applied so far (the schedule's step)
    lr: torch.Tensor  # float64: η_t of the last update
    radius: object  # fp32 per-tensor R = ‖W_0‖_F (0-d per leaf, or [num_tensors] per flat group)

    reports = (("lr", "lr"),)  # pgs.func.reported


@takes_learning_rate
def hyperball(learning_rate, mask=None, eps: float = 1e-12) -> Transform:
    """The last stage of a chain: turn a base direction u into a step on the sphere ‖W‖_F = R.

    For each constrained matrix W (ndim ≥ 2 and ``mask(path, W)`` true), with R = ‖W_0‖_F
    stored at init:

        W̃ = W − η_t R u/‖u‖_F          (a step of length exactly η_t R)
        W' = R W̃/‖W̃‖_F
        emit W' − W

    Other leaves follow the base rule: emit −η_t u.  Norms are guarded with max(‖·‖, ε).
    Use it instead of weight decay (the base direction must have none), after a base
    direction with no learning rate: ``pf.chain(pf.scale_by_adam(), pf.hyperball(0.01))``.
    Needs ``params``.  Runs on the flat layout (per-tensor norms are segmented sums).

    The lr heuristic of the reference: η ≈ sqrt(η_AdamW · λ_AdamW) of a tuned AdamW baseline.

    Args:
        learning_rate: η_t, a number ≥ 0, a 0-d tensor or a schedule of the step.
        mask: ``(path, param) -> bool`` (or a pytree of bools) selecting constrained
            matrices among the ndim ≥ 2 leaves; None constrains every ndim ≥ 2 leaf.
        eps: ε of the norm guards.

    Paper: arXiv 2606.16899 (Algorithm 1).
    """
    who = "hyperball"
    check_range("learning_rate", learning_rate, 0.0, None, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    user = mask_fn(mask, who)

    def constrained(path, p) -> bool:
        return p.ndim >= 2 and (user is None or bool(user(path, p)))

    def init(params, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        count = zero_count(params)
        radius = T.tree_map(torch.sqrt, per_tensor_sumsq(params, layout, ctx.reduce_sum))
        return HyperballState(count, _lr_value(learning_rate, count), radius)

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        if params is None and any(x is not None for x in T.leaves(updates)):
            raise InvalidArgument(f"{who}: update() needs params (the sphere is the parameter's)")
        layout = ctx.layout
        lr = _lr_value(learning_rate, state.count)
        labels = group_label(layout, updates, constrained)
        rsum = ctx.reduce_sum  # sharded: shard-local sums, all-reduced
        u_norm = T.tree_map(torch.sqrt, per_tensor_sumsq(updates, layout, rsum))

        # W̃ = W − (η R/‖u‖) u, in fp32 (on unconstrained leaves the result is discarded)
        coef = T.tree_map(lambda r, n: lr.to(torch.float32) * r / n.clamp(min=eps), state.radius, u_norm)
        step = per_tensor_apply(lambda u, c: u.to(torch.promote_types(u.dtype, torch.float32)) * c.to(
            torch.promote_types(u.dtype, torch.float32)), updates, coef, layout=layout)
        tilde = T.tree_map(lambda p, s: p.to(s.dtype) - s, params, step)
        # W' = R W̃/‖W̃‖ ; emit W' − W
        shrink = T.tree_map(lambda r, n: r / n.clamp(min=eps), state.radius,
                            T.tree_map(torch.sqrt, per_tensor_sumsq(tilde, layout, rsum)))
        proj = per_tensor_apply(lambda w, s: w * s.to(w.dtype), tilde, shrink, layout=layout)
        on_sphere = T.tree_map(lambda w, p, u: (w - p.to(w.dtype)).to(u.dtype), proj, params, updates)

        def plain(u):
            cd = torch.promote_types(u.dtype, torch.float32)
            return (u.to(cd) * (-lr).to(cd)).to(u.dtype)

        if layout is None:
            out = T.tree_map_with_path(lambda path, u, s: s if labels[path] else plain(u), updates, on_sphere)
        else:
            out = {k: (None if u is None else (on_sphere[k] if labels[k] else plain(u))) for k, u in updates.items()}
        return out, HyperballState(increment(state.count), lr, state.radius)

    return Transform(init, update, name="hyperball", locality=PER_TENSOR, shard_aware=True, stage=STEP,
                     group_by=(constrained,),
                     fused=("hyperball", dict(learning_rate=learning_rate, eps=eps)))  # pgs.func.fused_chain8bit


@takes_learning_rate
def adamh(learning_rate=1e-2, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, mask=None,
          mu_dtype: torch.dtype | None = None, nu_dtype: torch.dtype | None = None) -> Transform:
    """AdamH = chain(scale_by_adam(b1, b2, eps), hyperball(η, mask)).

    Adam's direction moved on the sphere of each constrained matrix; other leaves get plain
    Adam with the same η (use a ``pf.partition`` for a separate Adam lr).  No weight decay:
    the sphere replaces it.  Defaults follow the levanter reference (β2 = 0.95).

    Paper: arXiv 2606.16899.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="adamh")
    return chain(scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype), hyperball(learning_rate, mask))


def _is_head(path, p) -> bool:
    return p.ndim >= 2 and "lm_head" in path.lower()


@takes_learning_rate
def muonh(learning_rate=0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
          ns_coefficients=NS_COEFFICIENTS, adam_lr=6e-4, b1: float = 0.9, b2: float = 0.95,
          adam_eps: float = 1e-8, route=None, fallback_mask=_is_head,
          ns_dtype: torch.dtype = torch.bfloat16) -> Transform:
    """MuonH = partition({"muon": chain(scale_by_muon, hyperball(η)),
                         "fallback": chain(scale_by_adam, hyperball(adam_lr, fallback_mask))}).

    Hidden matrices (``route``, default ``muon_route``) move on their spheres along Muon's
    direction; the rest gets Adam with ``adam_lr`` — AdamH (on the sphere) for the leaves
    ``fallback_mask`` selects (default: the output head, as levanter's MuonH), plain Adam for
    embeddings, norms and biases.  The Muon shape factor is irrelevant here (the sphere step
    normalizes u), so none is applied.  Defaults from levanter (adam_lr 6e-4, β2 0.95).

    Paper: arXiv 2606.16899.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="muonh")
    check_range("adam_lr", adam_lr, 0.0, None, who="muonh")
    m = chain(scale_by_muon(momentum, nesterov, ns_steps, ns_coefficients, adjust_lr="none", ns_dtype=ns_dtype),
              hyperball(learning_rate))
    f = chain(scale_by_adam(b1, b2, adam_eps), hyperball(adam_lr, fallback_mask))
    return partition({"muon": m, "fallback": f}, route or muon_route)
