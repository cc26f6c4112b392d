"""Small pieces the building blocks share (step counters, dtype casts)."""

from __future__ import annotations

import torch

from pgs.func import tree as T

INT32_MAX = 2**31 - 1


def device_of(tree) -> torch.device:
    for x in T.leaves(tree):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def zero_count(tree) -> torch.Tensor:
    """A 0-d int32 step counter on the tree's device."""
    return torch.zeros((), dtype=torch.int32, device=device_of(tree))


def increment(count: torch.Tensor) -> torch.Tensor:
    """count + 1, saturating at int32 max instead of overflowing (as optax does)."""
    return count.clamp(max=INT32_MAX - 1) + 1  # two kernels (a where() form takes three)


def zeros_state(tree, dtype: torch.dtype | None):
    """A zero moment buffer per leaf, in ``dtype`` (or the leaf's own dtype)."""
    return T.tree_map(lambda x: torch.zeros_like(x, dtype=dtype or x.dtype), tree)


#: compute_dtype of the floating dtypes, looked up (``torch.promote_types`` is a dispatcher
#: call: host time in gradient release's per-group steps); never written after import
_COMPUTE_DTYPE = {d: torch.promote_types(d, torch.float32)
                  for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half types, the tensor's own dtype for fp32/fp64."""
    cd = _COMPUTE_DTYPE.get(x.dtype)
    return cd if cd is not None else torch.promote_types(x.dtype, torch.float32)


def realize_scalar(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a 0-d per-step scalar), computed once instead of once per element when compiled.

    Inductor inlines 0-d pointwise producers into their consumers: a bias correction
    ``1 − β^t`` or a cosine schedule would be recomputed (fp64 ``pow``/``cos``) for every
    element of a 1.7-billion-element flat buffer.  A reduction is always materialised, so
    ``max`` over two copies of ``x`` (exactly ``x``) makes it a buffer the big kernel reads.
    In eager mode this is the identity.
    """
    if not torch.compiler.is_compiling():
        return x
    return x.reshape(1).expand(2).amax()


def nonzero(x) -> bool:
    """A hyperparameter that is a tensor (its value is known only at run time) or a number != 0."""
    return isinstance(x, torch.Tensor) or x != 0


def f32_scalar(x, ref: torch.Tensor):
    """A hyperparameter as an fp32 scalar on ``ref``'s device (0-d float64 tensors would promote)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=ref.device, dtype=torch.float32)
    return torch.tensor(float(x), dtype=torch.float32, device=ref.device)
