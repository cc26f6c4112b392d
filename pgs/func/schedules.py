"""Learning-rate schedules: pure functions of a step tensor.

Each schedule is a callable ``schedule(step) -> 0-d float64 tensor``.  ``step`` counts
updates already applied (0 for the first update), as in optax.  All arithmetic is tensor
arithmetic (``torch.where``, ``clamp``) so that a compiled step never recompiles and never
synchronises the host: the value lives in optimizer state as a tensor.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from pgs.errors import InvalidArgument

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _step(step) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.to(torch.float64)
    return torch.tensor(float(step), dtype=torch.float64)


def _nonneg(who: str, **kw):
    for k, v in kw.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise InvalidArgument(f"{who}: {k} must be a number, got {type(v).__name__}")
        if math.isnan(v) or v < 0:
            raise InvalidArgument(f"{who}: {k}={v!r} must be >= 0")


def constant_schedule(value: float) -> Schedule:
    """η(t) = value."""
    _nonneg("constant_schedule", value=value)

    def schedule(step):
        return torch.full_like(_step(step), float(value))

    return schedule


def linear_warmup(peak: float, warmup: int, init: float = 0.0) -> Schedule:
    """η(t) = init + (peak − init)·min(t, W)/W, then constant ``peak``."""
    _nonneg("linear_warmup", peak=peak, warmup=warmup, init=init)

    def schedule(step):
        s = _step(step)
        if warmup == 0:
            return torch.full_like(s, float(peak))
        frac = (s / warmup).clamp(0.0, 1.0)
        return init + (peak - init) * frac

    return schedule


def cosine_schedule(peak: float, warmup: int, total: int, final: float = 0.0, init: float = 0.0) -> Schedule:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``final`` at ``total``.

    η(t) = init + (peak − init)·t/W                                  for t < W
    η(t) = final + (peak − final)·½(1 + cos(π·min(t − W, D)/D))      for t ≥ W, D = total − W

    Same values as ``optax.warmup_cosine_decay_schedule(init, peak, W, total, final)``.
    Paper: Loshchilov & Hutter, "SGDR", arXiv 1608.03983 (cosine annealing).
    """
    _nonneg("cosine_schedule", peak=peak, warmup=warmup, total=total, final=final, init=init)
    if total < warmup:
        raise InvalidArgument(f"cosine_schedule: total={total} must be >= warmup={warmup}")
    decay = total - warmup

    def schedule(step):
        s = _step(step)
        w = init + (peak - init) * (s / max(warmup, 1)).clamp(0.0, 1.0)
        if decay == 0:
            cos = torch.full_like(s, float(final))
        else:
            z = (s - warmup).clamp(0.0, float(decay)) / decay
            cos = final + (peak - final) * 0.5 * (1.0 + torch.cos(math.pi * z))
        return torch.where(s < warmup, w, cos)

    return schedule


_WSD_SHAPES = ("linear", "cosine", "1-sqrt", "power", "exponential")


def wsd_schedule(
    peak: float,
    warmup: int,
    stable: int,
    decay: int,
    shape: str = "linear",
    final: float = 0.0,
    init: float = 0.0,
    power: float = 2.0,
) -> Schedule:
    """Warmup-stable-decay (MiniCPM, arXiv 2404.06395; docs/techniques/schedules.md).

    η = init + (peak − init)·t/W for t < W;  η = peak on [W, W + S];
    η = final + (peak − final)·f(z) after, z = (t − W − S)/D ∈ [0, 1], with f(0) = 1, f(1) = 0:
    linear 1 − z; cosine ½(1 + cos πz); 1-sqrt 1 − √z; power (1 − z)^power;
    exponential: geometric from peak to final (final must be > 0).
    The stable value does not depend on the decay length, so stable checkpoints are reusable.
    """
    _nonneg("wsd_schedule", peak=peak, warmup=warmup, stable=stable, decay=decay, final=final, init=init, power=power)
    if shape not in _WSD_SHAPES:
        raise InvalidArgument(f"wsd_schedule: shape={shape!r} is not one of {_WSD_SHAPES}")
    if shape == "exponential" and final <= 0:
        raise InvalidArgument("wsd_schedule: shape='exponential' needs final > 0")
    start = warmup + stable

    def schedule(step):
        s = _step(step)
        w = init + (peak - init) * (s / max(warmup, 1)).clamp(0.0, 1.0)
        z = ((s - start) / max(decay, 1)).clamp(0.0, 1.0)
        if decay == 0:
            z = (s > start).to(s.dtype)
        if shape == "exponential":
            decayed = peak * (final / peak) ** z
        else:
            if shape == "linear":
                f = 1.0 - z
            elif shape == "cosine":
                f = 0.5 * (1.0 + torch.cos(math.pi * z))
            elif shape == "1-sqrt":
                f = 1.0 - torch.sqrt(z)
            else:  # power
                f = (1.0 - z) ** power
            decayed = final + (peak - final) * f
        # the stable phase is exactly ``peak``: final + (peak − final)·1 can be off by an ulp
        stable_or_decay = torch.where(s <= start, torch.full_like(s, float(peak)), decayed)
        return torch.where(s < warmup, w, stable_or_decay)

    return schedule


def power_decay_schedule(peak: float, total: int, gamma: float = 4.0, warmup: int = 0, init: float = 0.0) -> Schedule:
    """Power decay (Li et al., arXiv 2602.06797; docs/techniques/schedules.md).

    η(z) = η_peak·(1 − z/N)^γ with z = t − W clamped to [0, N], N = total − W; optional linear
    warmup first.  γ = 0 is constant, γ = 1 linear decay; larger γ is pointwise smaller.
    """
    _nonneg("power_decay_schedule", peak=peak, total=total, gamma=gamma, warmup=warmup, init=init)
    if total <= warmup:
        raise InvalidArgument(f"power_decay_schedule: total={total} must be > warmup={warmup}")
    n = total - warmup

    def schedule(step):
        s = _step(step)
        w = init + (peak - init) * (s / max(warmup, 1)).clamp(0.0, 1.0)
        z = (s - warmup).clamp(0.0, float(n))
        return torch.where(s < warmup, w, peak * (1.0 - z / n) ** gamma)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]`` on, each seeing ``t − boundaries[i-1]``.

    Same semantics as ``optax.join_schedules``.
    """
    if len(schedules) != len(boundaries) + 1:
        raise InvalidArgument(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}"
        )
    if list(boundaries) != sorted(boundaries):
        raise InvalidArgument(f"join_schedules: boundaries {list(boundaries)} must be increasing")

    def schedule(step):
        s = _step(step)
        out = schedules[0](s)
        for b, sch in zip(boundaries, schedules[1:]):
            out = torch.where(s < b, out, sch(s - b))
        return out

    return schedule


def evaluate(lr, step) -> torch.Tensor:
    """The value of a number-or-schedule at ``step`` as a float64 0-d tensor."""
    if callable(lr):
        return lr(step).to(torch.float64)
    if isinstance(lr, torch.Tensor):
        return lr.to(torch.float64)
    return torch.tensor(float(lr), dtype=torch.float64)
