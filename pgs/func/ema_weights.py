"""EMA of weights: fp32 shadow parameters as a pure transform (docs/techniques/ema.md)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.func import tree as T
from pgs.func._common import increment, zero_count
from pgs.func.base import ELEMENTWISE, Transform, check_range


class EmaState(NamedTuple):
    count: torch.Tensor  # int32: averages taken so far
    ema: object  # fp32 shadow weights θ^ema (zero-initialized when debias=True)
    correction: torch.Tensor  # fp32 0-d: 1 − δ^t when debias=True, else 1 (read-out = ema / correction)


def ema(decay: float = 0.999, debias: bool = False, warmup: bool = False) -> Transform:
    """Exponential moving average of the parameters, kept in fp32.

    θ^ema_t = δ θ^ema_{t−1} + (1−δ) θ_t

    Contract: a ``Transform`` whose *updates* are the current parameters.
    ``state = e.init(params)``, then after every optimizer step
    ``avg, state = e.update(params, state)``; ``avg`` is the current average in the
    parameters' dtypes and ``ema_params(state)`` is the fp32 one.  Being a transform, it runs
    through ``pf.compile`` and checkpoints with ``pf.state_to_dict`` like any optimizer state.

    debias=False (default): the first update **copies** θ (torch.optim.swa_utils.AveragedModel
    semantics), so a constant θ gives θ^ema = θ exactly.  debias=True: θ^ema starts at 0 and
    the read-out is θ^ema_t/(1−δ^t) (Adam-style bias correction).  warmup=True uses
    δ_t = min(δ, (1+t)/(10+t)) (the TF/timm warm-up), t = updates taken before this one.

    Args:
        decay: δ in [0, 1] (δ = 0 copies, δ = 1 freezes).
        debias: zero-init with bias-corrected read-out instead of copy-init.
        warmup: the (1+t)/(10+t) warm-up of δ.

    Example::

        e = pf.ema(0.999)
        es = e.init(params)
        for batch in data:
            params, opt_state = ...  # an optimizer step
            _, es = e.update(params, es)
        eval_params = pf.ema_params(es)

    Source: Polyak averaging; torch.optim.swa_utils.get_ema_multi_avg_fn.
    """
    who = "ema"
    check_range("decay", decay, 0.0, 1.0, who=who)

    def init(params, **extra):
        count = zero_count(params)
        ema = T.tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params)
        # correction = 1 − Π_s δ_s: 0 before the first zero-init update; always 1 for copy-init
        corr = torch.full((), 0.0 if debias else 1.0, dtype=torch.float32, device=count.device)
        return EmaState(count, ema, corr)

    def update(updates, state, params=None, **extra):
        t = state.count.to(torch.float32)
        d = decay.to(device=t.device, dtype=torch.float32) if isinstance(decay, torch.Tensor) else \
            torch.tensor(float(decay), dtype=torch.float32, device=t.device)
        if warmup:
            d = torch.minimum(d, (1.0 + t) / (10.0 + t))
        copy = (state.count == 0) & (not debias)
        new_ema = T.tree_map(lambda p, e: torch.where(copy, p.float(), e * d + (1.0 - d) * p.float()),
                             updates, state.ema)
        corr = 1.0 - (1.0 - state.correction) * d if debias else state.correction
        new_state = EmaState(increment(state.count), new_ema, corr)
        return ema_params(new_state, like=updates), new_state

    return Transform(init, update, name="ema", locality=ELEMENTWISE)


def ema_params(state: EmaState, like=None):
    """The averaged parameters: θ^ema (copy-init) or θ^ema/(1 − Πδ) (debias), in fp32.

    With ``like`` (a tree of tensors), each leaf is cast to the dtype of ``like``'s leaf.
    Before the first update (debias) the read-out is 0.
    """
    c = state.correction
    safe = torch.where(c > 0, c, torch.ones_like(c))
    avg = T.tree_map(lambda e: e / safe, state.ema)
    if like is None:
        return avg
    return T.tree_map(lambda a, p: a.to(p.dtype), avg, like)
