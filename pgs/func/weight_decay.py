"""Decoupled weight decay as a building block."""

from __future__ import annotations

from typing import Callable

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func.base import DIRECTION, ELEMENTWISE, EmptyState, Transform, check_range
from pgs.func.layout import group_label
from pgs.func.step import NO_CONTEXT, StepContext


def mask_fn(mask, who: str) -> Callable[[str, torch.Tensor], bool] | None:
    """A mask given as a function ``(path, param) -> bool`` or a pytree of bools, as a function."""
    if mask is None or callable(mask):
        return mask
    table = {}
    for path, v in T.leaves_with_paths(mask):
        if not isinstance(v, bool):
            raise InvalidArgument(f"{who}: mask leaf {path!r} is a {type(v).__name__}, expected a bool")
        table[path] = v

    def fn(path, p):
        if path not in table:
            raise InvalidArgument(f"{who}: the mask has no entry for parameter {path!r}")
        return table[path]

    return fn


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> Transform:
    """u ← u + λ·θ (on the leaves where ``mask(path, param)`` is true).

    Followed by ``scale_by_learning_rate(η)`` this is decoupled weight decay,
    θ ← θ − η(u + λθ) (Loshchilov & Hutter, arXiv 1711.05101).  Put it before the
    learning-rate step, after the base direction.

    Args:
        weight_decay: λ ≥ 0.
        mask: ``(path, param) -> bool`` or a pytree of bools; None decays everything.
    """
    who = "add_decayed_weights"
    check_range("weight_decay", weight_decay, 0.0, None, who=who)
    fn = mask_fn(mask, who)

    def init(params, **extra):
        return EmptyState()

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        if params is None:
            raise InvalidArgument(f"{who}: update() needs params")
        layout = ctx.layout
        labels = group_label(layout, updates, fn) if fn is not None else None

        def one(path, g, p):
            if labels is not None and not labels[path]:
                return g
            cd = torch.promote_types(g.dtype, torch.float32)
            wd = weight_decay.to(device=g.device, dtype=cd) if isinstance(weight_decay, torch.Tensor) else weight_decay
            return (g.to(cd) + wd * p.to(cd)).to(g.dtype)

        if layout is None:
            return T.tree_map_with_path(one, updates, params), state
        return {k: (None if g is None else one(k, g, params[k])) for k, g in updates.items()}, state

    return Transform(init, update, name="add_decayed_weights", locality=ELEMENTWISE, stage=DIRECTION,
                     group_by=(fn,) if fn else (),
                     fused=("decay", dict(weight_decay=weight_decay, mask=fn)))
