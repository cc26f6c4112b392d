"""Gradient clipping by the global norm and by per-tensor norms."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import device_of
from pgs.func.base import GLOBAL, PER_TENSOR, Transform, check_range
from pgs.func.layout import per_tensor_apply, per_tensor_sumsq


class ClipByGlobalNormState(NamedTuple):
    norm: torch.Tensor  # fp32: the global norm of the last incoming updates (before clipping)


def global_norm(tree, layout=None, reduce_sum=None) -> torch.Tensor:
    """sqrt(Σ_i ‖g_i‖²) over every leaf, in fp32 (``reduce_sum``: the sharding hook, see ``layout.reduced``)."""
    sq = per_tensor_sumsq(tree, layout, reduce_sum)
    total = None
    for x in T.leaves(sq):
        if x is None:
            continue
        s = x.sum()
        total = s if total is None else total + s
    if total is None:
        return torch.zeros((), dtype=torch.float32, device=device_of(tree))
    return total.sqrt()


def clip_by_global_norm(max_norm: float) -> Transform:
    """Scale all updates so that their global norm is at most ``max_norm``.

    ĝ = g · c / max(‖g‖, c),  ‖g‖ = sqrt(Σ_i ‖g_i‖²)

    The incoming norm is kept in state (``state.norm``): it is the "grad norm" that the
    runtime logs.  A zero gradient is left unchanged.  Global: needs the whole tree, so it
    cannot run inside backward with gradient release.

    Paper: Pascanu, Mikolov & Bengio, "On the difficulty of training RNNs", arXiv 1211.5063.
    """
    check_range("max_norm", max_norm, 0.0, None, lo_open=True, who="clip_by_global_norm")

    def init(params, **extra):
        return ClipByGlobalNormState(torch.zeros((), dtype=torch.float32, device=device_of(params)))

    def update(updates, state, params=None, **extra):
        norm = global_norm(updates, extra.get("layout"), extra.get("reduce_sum"))
        scale = max_norm / torch.clamp(norm, min=max_norm)
        def one(g):
            cd = torch.promote_types(g.dtype, torch.float32)
            return (g.to(cd) * scale.to(cd)).to(g.dtype)

        out = T.tree_map(one, updates)
        return out, ClipByGlobalNormState(norm)

    return Transform(init, update, name="clip_by_global_norm", locality=GLOBAL)


class ClipByNormPerTensorState(NamedTuple):
    norms: object  # per-tensor norms of the last incoming updates (fp32)


def clip_by_norm_per_tensor(max_norm: float) -> Transform:
    """Scale each tensor so that its own norm is at most ``max_norm``: ĝ_i = g_i·c/max(‖g_i‖, c).

    Per-tensor, so it can run inside backward (gradient release) and on FSDP2 shards (the norm
    is all-reduced through ``extra["reduce_sum"]``).  Paper: arXiv 1211.5063 (norm clipping).
    """
    check_range("max_norm", max_norm, 0.0, None, lo_open=True, who="clip_by_norm_per_tensor")

    def init(params, **extra):
        layout = extra.get("layout")
        return ClipByNormPerTensorState(T.tree_map(torch.zeros_like, per_tensor_sumsq(params, layout, extra.get("reduce_sum"))))

    def update(updates, state, params=None, **extra):
        layout = extra.get("layout")
        norms = T.tree_map(torch.sqrt, per_tensor_sumsq(updates, layout, extra.get("reduce_sum")))
        scales = T.tree_map(lambda n: max_norm / torch.clamp(n, min=max_norm), norms)

        def one(g, s):
            cd = torch.promote_types(g.dtype, torch.float32)
            return (g.to(cd) * s.to(cd)).to(g.dtype)

        return per_tensor_apply(one, updates, scales, layout=layout), ClipByNormPerTensorState(norms)

    return Transform(init, update, name="clip_by_norm_per_tensor", locality=PER_TENSOR)
