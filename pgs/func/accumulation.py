"""Gradient accumulation as a transform: ``accumulate(opt, every=k)``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import zero_count
from pgs.func.base import Transform
from pgs.func.layout import call_init, call_update


class AccumulateState(NamedTuple):
    mini_step: torch.Tensor  # int32 in [0, every)
    acc: Any  # fp32 (fp64 for fp64) sum of the micro-step gradients so far
    inner_state: Any


def accumulate(opt: Transform, every: int) -> Transform:
    """Sum ``every`` micro-step gradients, then apply ``opt`` once to their mean.

    Micro-steps 1..k−1 emit zero updates and leave ``opt``'s state untouched; micro-step k
    emits ``opt.update(mean(g_1..g_k))``.  The same as optax's ``MultiSteps``.

    The branch is taken on the host (one read of ``mini_step`` per call).  The runtime does
    not use this wrapper: it accumulates into ``.grad`` and calls the chain once per step;
    this is for users who drive a pure chain by hand.
    """
    if not isinstance(every, int) or every < 1:
        raise InvalidArgument(f"accumulate: every={every!r} must be an int >= 1")

    def init(params, **extra):
        acc = T.tree_map(lambda x: torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32)), params)
        return AccumulateState(zero_count(params), acc, call_init(opt, params, extra))

    def update(updates, state, params=None, **extra):
        acc = T.tree_map(lambda a, g: a + g.to(a.dtype), state.acc, updates)
        k = int(state.mini_step) + 1
        if k < every:
            zeros = T.tree_map(torch.zeros_like, updates)
            return zeros, AccumulateState(state.mini_step + 1, acc, state.inner_state)
        mean = T.tree_map(lambda a, g: (a / every).to(g.dtype), acc, updates)
        u, inner = call_update(opt, mean, state.inner_state, params, extra)
        return u, AccumulateState(torch.zeros_like(state.mini_step), T.tree_map(torch.zeros_like, acc), inner)

    return Transform(init, update, name="accumulate", locality=opt.locality, group_by=opt.all_group_by(),
                     align=opt.max_align(), children=(opt,))
