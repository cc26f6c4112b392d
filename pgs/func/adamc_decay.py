"""AdamC: weight decay corrected for the learning-rate schedule (docs/techniques/adamc.md).

Defazio, "Why Gradients Rapidly Increase Near the End of Training", arXiv 2506.02285.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import increment, zero_count
from pgs.func.adam import scale_by_adam
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, chain, check_range
from pgs.func.layout import group_label
from pgs.func.learning_rate import lr_value as _lr_value, scale_by_learning_rate, takes_learning_rate
from pgs.func.muon_direction import is_hidden_matrix
from pgs.func.weight_decay import mask_fn
from pgs.func.step import NO_CONTEXT, StepContext


class AddCorrectedDecayState(NamedTuple):
    count: torch.Tensor  # int32: the schedule's step


def schedule_peak(learning_rate, horizon: int | None = None, who: str = "adamc"):
    """γ_max of a number, a 0-d tensor or a schedule.

    For a schedule: its ``peak`` attribute when it has one, else the maximum of
    ``schedule(0..horizon)`` when ``horizon`` is given; otherwise an error asking for
    ``peak_lr``.
    """
    if isinstance(learning_rate, torch.Tensor) or not callable(learning_rate):
        return learning_rate
    peak = getattr(learning_rate, "peak", None)
    if peak is not None:
        return peak
    if horizon is None:
        raise InvalidArgument(f"{who}: learning_rate is a schedule whose peak is not known; pass peak_lr= "
                              "(its maximum over training, warmup included) or horizon= (the total steps)")
    steps = torch.arange(int(horizon) + 1, dtype=torch.int64)
    return float(learning_rate(steps).max())


@takes_learning_rate
def add_corrected_decayed_weights(weight_decay: float, learning_rate, peak_lr,
                                  normalized=is_hidden_matrix) -> Transform:
    """u ← u + k_t λ θ, with k_t = γ_t/γ_max on ``normalized`` leaves and 1 elsewhere.

    Followed by ``scale_by_learning_rate(γ_t)`` the decay term is c_t λ θ with
    c_t = γ_t²/γ_max (normalized) or γ_t (otherwise).  γ_t is evaluated from the same step
    counter as ``scale_by_learning_rate``.  γ_max = 0 gives k = 0.
    """
    who = "add_corrected_decayed_weights"
    check_range("weight_decay", weight_decay, 0.0, None, who=who)
    check_range("peak_lr", peak_lr, 0.0, None, who=who)
    fn = mask_fn(normalized, who)

    def init(params, **extra):
        return AddCorrectedDecayState(zero_count(params))

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        if params is None and any(x is not None for x in T.leaves(updates)):
            raise InvalidArgument(f"{who}: update() needs params")
        layout = ctx.layout
        labels = group_label(layout, updates, fn)
        gamma = _lr_value(learning_rate, state.count)
        peak = peak_lr.to(gamma) if isinstance(peak_lr, torch.Tensor) else torch.full_like(gamma, float(peak_lr))
        ratio = torch.where(peak > 0, gamma / torch.where(peak > 0, peak, torch.ones_like(peak)),
                            torch.zeros_like(peak))
        wd = weight_decay.to(gamma) if isinstance(weight_decay, torch.Tensor) else weight_decay

        def one(path, g, p):
            cd = torch.promote_types(g.dtype, torch.float32)
            k = (ratio * wd).to(cd) if labels[path] else torch.as_tensor(wd, dtype=cd, device=g.device)
            return (g.to(cd) + k * p.to(cd)).to(g.dtype)

        if layout is None:
            out = T.tree_map_with_path(one, updates, params)
        else:
            out = {k: (None if g is None else one(k, g, params[k])) for k, g in updates.items()}
        return out, AddCorrectedDecayState(increment(state.count))

    return Transform(init, update, name="add_corrected_decayed_weights", locality=ELEMENTWISE, group_by=(fn,),
                     stage=DIRECTION)


@takes_learning_rate
def adamc(learning_rate=1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
          normalized=is_hidden_matrix, peak_lr=None, horizon: int | None = None,
          mu_dtype: torch.dtype | None = None, nu_dtype: torch.dtype | None = None) -> Transform:
    """AdamC = chain(scale_by_adam, add_corrected_decayed_weights, scale_by_learning_rate).

    θ_t = θ_{t−1} − γ_t m̂_t/(sqrt(v̂_t)+ε) − c_t λ θ_{t−1}
    c_t = γ_t²/γ_max on ``normalized`` leaves (layers followed by a normalization; default:
    2-D hidden matrices), c_t = γ_t elsewhere (plain AdamW).

    γ_max (``peak_lr``) is the schedule's maximum, warmup included.  When not given it is the
    learning rate itself (a constant), the schedule's ``peak`` attribute, or the maximum of
    the schedule over ``0..horizon``; a schedule with none of these is refused.  A constant
    schedule gives exactly AdamW.

    Example::

        sched = pf.cosine_schedule(peak=3e-4, warmup=100, total=10_000)
        opt = pf.adamc(sched, weight_decay=0.1, peak_lr=3e-4)

    Paper: arXiv 2506.02285.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="adamc")
    peak = peak_lr if peak_lr is not None else schedule_peak(learning_rate, horizon)
    return chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        add_corrected_decayed_weights(weight_decay, learning_rate, peak, normalized),
        scale_by_learning_rate(learning_rate),
    )
