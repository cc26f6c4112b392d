"""Fused update-and-apply: the hook ``pf.compile(...).step`` uses when a chain offers one.

A chain such as ``lion8bit = chain(scale_by_lion8bit, add_decayed_weights, scale_by_learning_rate)``
runs on the flat layout as three elementwise stages plus the apply, i.e. four passes over
memory.  A ``FusedTransform`` is that same chain (same ``init``/``update``, same state) with
one extra attribute, ``fused_step``, which does the whole step in one kernel per group:

    fused_step(flat_grads, state, flat_params, *, ctx, donate, memory, extra)
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

from pgs.func._common import INT32_MAX, increment
from pgs.func.base import Transform


@dataclasses.dataclass(frozen=True)
class FusedTransform(Transform):
    """A ``Transform`` that can also run update-and-apply fused (see the module docstring)."""

    fused_step: Callable | None = None


def hp_tensor(device: torch.device, *values) -> torch.Tensor:
    """Hyperparameters as one fp32 tensor on ``device`` (numbers are cached; tensors are read lazily).

    No host synchronization: the numbers come from a cached device tensor and the tensors are
    converted on the device (``torch.tensor(x, device=cuda)`` per number would be a blocking
    host-to-device copy, i.e. a stream sync per call: one per 8-bit tensor inside gradient
    release's backward).  Each value goes through float64 to float32, as before.  A tensor
    value may hold several entries (a 1-D tensor, e.g. both bias corrections): they take
    consecutive places.  With tensors the vector is one ``cat`` of the cached runs of numbers
    and each tensor's fp32 conversion (one kernel per tensor, one for the cat)."""
    if all(not isinstance(v, torch.Tensor) for v in values):
        return _hp_cached(device, tuple(float(v) for v in values))
    # the numbers' cached vector (zeros where a tensor goes), cut into runs between the tensors
    nums = _hp_cached(device, tuple(0.0 if isinstance(v, torch.Tensor) else float(v) for v in values))
    pieces, start = [], 0
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if i > start:
                pieces.append(nums[start:i])
            pieces.append(v.to(device=device, dtype=torch.float64).reshape(-1).to(torch.float32))
            start = i + 1
    if start < len(values):
        pieces.append(nums[start:])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # fresh either way (a conversion or a cat)


@functools.lru_cache(maxsize=256)
def _hp_cached(device: torch.device, values: tuple) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)


def one_minus(x):
    """1 − x for a number or a tensor hyperparameter, computed in float64."""
    if isinstance(x, torch.Tensor):
        return 1.0 - x.to(torch.float64)
    return 1.0 - x


def sr_seed(count: torch.Tensor, group_index: int, salt: int = 0) -> torch.Tensor:
    """A per-step, per-group stochastic-rounding seed as an int64 device tensor (no host sync;
    ``sr_seeds`` makes the same values for a run of tensors); ``salt``
    sets a caller's seeds apart from another's at the same step and group."""
    return (count.to(torch.int64) * 1_000_003 + ((group_index + 1) * 7919 + salt)).reshape(1)


def sr_seeds(count: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """``sr_seed(count, first + i)`` for i < n as one int64 tensor of n seeds, in one kernel.

    The same values as n ``sr_seed`` calls (three kernels each): ``count·1000003`` plus the
    cached offsets ``(first + i + 1)·7919``, as one integer ``add`` with ``alpha`` (the int32
    count is widened to int64 inside it; a count < 2^31 times 1000003 stays below 2^51).
    Each seed sits 16 bytes from the next (a strided view of an (n, 2) buffer), so that a
    kernel handed ``seeds[i]`` sees a 16-byte-aligned pointer, as it did with one tensor per
    seed (Triton specialises its compiled kernels on pointer alignment)."""
    return torch.add(_seed_offsets(count.device, first, n), count, alpha=1_000_003)[:, 0]


@functools.lru_cache(maxsize=None)  # one entry per release group (and slab): never evicted
def _seed_offsets(device: torch.device, first: int, n: int) -> torch.Tensor:
    # made on the device (no host-to-device copy, which would wait for the stream)
    col = torch.arange(first + 1, first + 1 + n, dtype=torch.int64, device=device).mul_(7919)
    return col.unsqueeze(1).repeat(1, 2)


def constant_lr(device: torch.device, value: float) -> torch.Tensor:
    """``lr_value(value, count)`` of a constant learning rate: a cached float64 0-d tensor on
    ``device`` (the state's ``lr``; never written in place, so one tensor serves every step and
    every group instead of a ``full`` kernel per call)."""
    return _lr_cached(device, float(value))


@functools.lru_cache(maxsize=64)
def _lr_cached(device: torch.device, value: float) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float64, device=device)


def increment_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(increment(a), increment(b))`` for two step counters in two kernels instead of four
    (``torch._foreach_*``: one clamp and one add over both)."""
    if a.device != b.device or a.dtype != b.dtype:
        return increment(a), increment(b)
    na, nb = torch._foreach_add(torch._foreach_clamp_max([a, b], INT32_MAX - 1), 1)
    return na, nb
