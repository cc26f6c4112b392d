"""Hyperparameters that live in state: ``inject_hyperparams``."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import torch

from pgs.func._common import device_of, increment, zero_count
from pgs.func.base import Transform
from pgs.func.layout import call_init, call_update


class InjectHyperparamsState(NamedTuple):
    count: torch.Tensor  # int32, the step that schedules are evaluated at
    hyperparams: dict  # name -> 0-d float64 tensor (the value used by the last update)
    inner_state: Any

    reports = (("lr", "hyperparams.learning_rate"),)  # pgs.func.reported


def inject_hyperparams(factory: Callable[..., Transform], static_args: tuple[str, ...] = ()):
    """Wrap a transform factory so its numeric hyperparameters live in state as 0-d tensors.

    ``pf.inject_hyperparams(pf.adamw)(learning_rate=sched, b1=0.9)`` builds a transform whose
    state has ``hyperparams["learning_rate"]`` (the current lr) and ``hyperparams["b1"]``.
    Numbers become tensors; schedules (callables of the step) are evaluated every update and
    the value is stored.  Editing ``state.hyperparams[name]`` between steps changes the value
    used next (for numbers) without rebuilding or recompiling anything.  Arguments that are
    not numbers (masks, dtypes, strings) and names in ``static_args`` are passed as given.
    """

    def make(*args, **kwargs) -> Transform:
        if args:
            sig = inspect.signature(factory)
            bound = sig.bind_partial(*args)
            kwargs = {**bound.arguments, **kwargs}
        numeric, scheds, static = {}, {}, {}
        for k, v in kwargs.items():
            if k in static_args or isinstance(v, bool):
                static[k] = v
            elif isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
                numeric[k] = v
            elif callable(v) and not isinstance(v, (torch.dtype, type)) and _is_schedule(v):
                scheds[k] = v
            else:
                static[k] = v
        # validate the Python values once (tensors skip validation inside the factory)
        factory(**static, **numeric, **{k: float(s(torch.zeros((), dtype=torch.int32))) for k, s in scheds.items()})

        def current(count, stored):
            hp = dict(stored)
            for k, s in scheds.items():
                hp[k] = s(count).to(dtype=torch.float64, device=count.device)
            return hp

        def init(params, **extra):
            count = zero_count(params)
            dev = device_of(params)
            stored = {k: torch.as_tensor(v, dtype=torch.float64).to(dev).reshape(()) for k, v in numeric.items()}
            hp = current(count, stored)
            inner = factory(**static, **hp)
            return InjectHyperparamsState(count, hp, call_init(inner, params, extra))

        def update(updates, state, params=None, **extra):
            hp = current(state.count, state.hyperparams)
            inner = factory(**static, **hp)
            u, s = call_update(inner, updates, state.inner_state, params, extra)
            return u, InjectHyperparamsState(increment(state.count), hp, s)

        proto = factory(**static, **numeric, **{k: 0.0 for k in scheds})
        return Transform(
            init,
            update,
            name=proto.name,
            stage=proto.stage,
            locality=proto.locality,
            flat_ok=True,
            group_by=proto.all_group_by(),
            align=proto.max_align(),
            children=(proto,),
            skip_of=None if proto.skip_of is None else (lambda state: proto.skip_of(state.inner_state)),
        )

    return make


def _is_schedule(v) -> bool:
    """A schedule is a callable of one step argument; masks/label functions take (path, param)."""
    if not callable(v) or isinstance(v, Transform):
        return False
    try:
        sig = inspect.signature(v)
    except (TypeError, ValueError):
        return True
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    has_var = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    return len(required) <= 1 and (len(positional) >= 1 or has_var)
