"""The step context: what the caller of a chain knows about where the step runs.

A transform's ``init``/``update`` receive it as the keyword ``ctx`` (a ``StepContext``;
absent means ``NO_CONTEXT``).  Only transforms that reduce over whole tensors or whole
matrices, or that depend on the flat layout, read it; elementwise ones never do.

- ``layout``: set by ``pf.compile`` (``FlatChain``): the trees hold one flat buffer per
  group (``pgs.func.layout``); None on per-parameter trees.
- ``reduce_sum``: set by the sharded binders (FSDP2): ``reduce_sum(tree)`` sums every tensor
  leaf over the ranks (one all-reduce).  Per-tensor and global reductions pass it to
  ``per_tensor_sumsq`` / ``per_tensor_dot`` / ``global_norm`` so that a shard sees whole-tensor
  norms.  None on one process.
- ``whole_tensors``: set by the sharded binders: ``whole_tensors(op, paths, tensors)``
  gathers each listed shard-local tensor, runs ``op`` on the whole tensors and scatters the
  results back (Muon's Newton-Schulz).  None on one process.
- ``sr_offset``: the index of the first tensor of this call among all tensors of the step,
  so that gradient release's groups draw distinct stochastic-rounding streams.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from pgs.func.layout import Layout


# A frozen dataclass, not attrs (as ``Transform``): ``pf.compile`` builds the context inside
# the update it traces, and dynamo does not trace attrs' frozen ``__init__``.
@dataclasses.dataclass(frozen=True)
class StepContext:
    """Runtime context of one ``init``/``update``/fused step (see the module docstring)."""

    layout: "Layout | None" = None
    reduce_sum: Callable[[Any], Any] | None = None
    whole_tensors: Callable[..., Any] | None = None
    sr_offset: int = 0

    def evolve(self, **changes) -> "StepContext":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


#: The context of a plain call: per-parameter trees, one process.
NO_CONTEXT = StepContext()


def context_of(extra: dict) -> StepContext:
    """The ``StepContext`` in a transform's keyword arguments (``NO_CONTEXT`` when absent)."""
    ctx = extra.get("ctx")
    if ctx is None:
        return NO_CONTEXT
    if not isinstance(ctx, StepContext):
        raise TypeError(f"ctx must be a pgs.func.StepContext, got {type(ctx).__name__}")
    return ctx
