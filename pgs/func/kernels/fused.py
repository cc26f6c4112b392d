"""Fused update-and-apply: the hook ``pf.compile(...).step`` uses when a chain offers one.

A chain such as ``lion8bit = chain(scale_by_lion8bit, add_decayed_weights, scale_by_learning_rate)``
runs on the flat layout as three elementwise stages plus the apply, i.e. four passes over
memory.  A ``FusedTransform`` is that same chain (same ``init``/``update``, same state) with
one extra attribute, ``fused_step``, which does the whole step in one kernel per group:

    fused_step(flat_grads, state, flat_params, *, layout, donate, stochastic_rounding, extra)
        -> (new_flat_params, new_state)   or   None  (cannot fuse here: use the generic path)

``FlatChain.step_flat`` calls it first.  The result must equal the generic path's up to
floating-point contraction (the fused kernel skips the intermediate casts of the direction
to the gradient dtype, so with bf16 gradients it is slightly *more* precise).  With
``donate=True`` it writes parameters and state in place; otherwise it allocates new ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from pgs.func.base import Transform


@dataclasses.dataclass(frozen=True)
class FusedTransform(Transform):
    """A ``Transform`` that can also run update-and-apply fused (see the module docstring)."""

    fused_step: Callable | None = None


def hp_tensor(device: torch.device, *values) -> torch.Tensor:
    """Hyperparameters as one fp32 tensor on ``device`` (numbers are cached; tensors are read lazily).

    No host synchronization: the numbers come from a cached device tensor (zeros where a
    tensor goes) and the tensors are copied in on the device (``torch.tensor(x, device=cuda)``
    per number would be a blocking host-to-device copy, i.e. a stream sync per call: one per
    8-bit tensor inside gradient release's backward).  Each value goes through float64 to
    float32, as before."""
    if all(not isinstance(v, torch.Tensor) for v in values):
        return _hp_cached(device, tuple(float(v) for v in values))
    out = _hp_cached(device, tuple(0.0 if isinstance(v, torch.Tensor) else float(v) for v in values)).clone()
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            out[i] = v.to(device=device, dtype=torch.float64).reshape(()).to(torch.float32)
    return out


@functools.lru_cache(maxsize=256)
def _hp_cached(device: torch.device, values: tuple) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)


def one_minus(x):
    """1 − x for a number or a tensor hyperparameter, computed in float64."""
    if isinstance(x, torch.Tensor):
        return 1.0 - x.to(torch.float64)
    return 1.0 - x


def sr_seed(count: torch.Tensor, group_index: int) -> torch.Tensor:
    """A per-step, per-group Philox seed as an int64 device tensor (no host sync)."""
    return (count.to(torch.int64) * 1_000_003 + (group_index + 1) * 7919).reshape(1)


def apply_fp32(p: torch.Tensor, u32: torch.Tensor, lr, wd, stochastic_rounding: bool) -> torch.Tensor:
    """``p − η(u + λp)`` in fp32, cast (or stochastically rounded) back to p's dtype."""
    from pgs.func.apply import stochastic_round_to_bf16

    p32 = p.float()
    lr32 = lr.to(torch.float32) if isinstance(lr, torch.Tensor) else lr
    x = p32 - lr32 * (u32 + wd * p32) if not _is_zero(wd) else p32 - lr32 * u32
    if stochastic_rounding and p.dtype == torch.bfloat16:
        return stochastic_round_to_bf16(x)
    return x.to(p.dtype)


def _is_zero(x) -> bool:
    return not isinstance(x, torch.Tensor) and x == 0
