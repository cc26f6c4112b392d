"""The learning-rate step: scale the direction by −η_t, with η_t kept readable in state."""

from __future__ import annotations

from typing import Callable, NamedTuple, TypeVar

import torch

from pgs.func import tree as T
from pgs.func._common import increment, realize_scalar, zero_count
from pgs.func.base import ELEMENTWISE, STEP, Transform, check_range


F = TypeVar("F", bound=Callable)


def takes_learning_rate(factory: F) -> F:
    """Declare that ``factory`` takes the learning rate η_t as its ``learning_rate`` argument
    (a number ≥ 0, a 0-d tensor or a schedule ``step -> 0-d tensor``).

    The declaration, not the signature, is what a spec reads: ``pgs.runtime.spec.chain`` hands
    the ``[schedule]`` to the ``learning_rate`` of every factory that declares it (an
    ``optimizer.alias`` is one of them; a chain entry that sets ``learning_rate`` keeps its
    own), and to no other.  A factory that declares nothing never receives it.
    """
    factory.takes_learning_rate = True
    return factory


class ScaleByLearningRateState(NamedTuple):
    count: torch.Tensor  # int32: updates applied so far (the schedule's step)
    lr: torch.Tensor  # float64: the learning rate used by the last update (readable for logging)

    reports = (("lr", "lr"),)  # pgs.func.reported


def lr_value(lr, count):
    """The learning rate at ``count`` as a float64 0-d tensor on count's device."""
    if callable(lr) and not isinstance(lr, torch.Tensor):
        return lr(count).to(dtype=torch.float64, device=count.device)
    if isinstance(lr, torch.Tensor):
        return lr.to(dtype=torch.float64, device=count.device)
    return torch.full((), float(lr), dtype=torch.float64, device=count.device)


@takes_learning_rate
def scale_by_learning_rate(learning_rate, flip_sign: bool = True) -> Transform:
    """u ← −η_t·u, with η_t = schedule(t) or a constant.

    ``state.lr`` holds the value used by the last update (a 0-d tensor), so the current
    learning rate is always readable without recomputing the schedule.

    Args:
        learning_rate: a number ≥ 0, a 0-d tensor, or a schedule ``step -> tensor``.
        flip_sign: True (default) for descent.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0

    def init(params, **extra):
        count = zero_count(params)
        return ScaleByLearningRateState(count, lr_value(learning_rate, count))

    def update(updates, state, params=None, **extra):
        lr = realize_scalar(lr_value(learning_rate, state.count))
        scale = sign * lr

        def one(g):
            cd = torch.promote_types(g.dtype, torch.float32)
            return (g.to(cd) * scale.to(cd)).to(g.dtype)

        return T.tree_map(one, updates), ScaleByLearningRateState(increment(state.count), lr)

    return Transform(init, update, name="scale_by_learning_rate", locality=ELEMENTWISE, stage=STEP,
                     fused=("lr", dict(learning_rate=learning_rate, flip_sign=flip_sign)))
