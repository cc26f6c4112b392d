"""The memory options: what the pure layer's steps and losses read of a run's memory trade-offs.

A run's ``[memory]`` section trades precision or compute for memory; three of its choices change
what code below the optimizer binder does, and they reach it as one frozen record,
:class:`MemoryOptions`, passed as the keyword ``memory`` (absent: ``NO_MEMORY_OPTIONS``, none of
them):

- ``stochastic_rounding``: bf16 parameters are rounded stochastically when the update is
  applied (``pf.apply_updates``, ``pf.compile``'s ``step``, every fused plan's step), so bf16
  weights accumulate updates smaller than their ulp without an fp32 master copy (arXiv
  1502.02551).  The noise is seeded by the chain state's step count (docs/techniques/8bit.md).
- ``defer_head_grad``: the chunked token loss and the sequence log-probs give the head's weight
  no gradient through autograd and return a ``DeferredHeadGrad`` that the caller adds into the
  weight's gradient later (``pf.losses.token_loss``, ``pf.losses.sequence_logps``; docs/memory.md).
- ``tied_slabs``: rows per slab (0: off) in which gradient release steps the tied input
  embedding's weight at the end of backward, so that no dense V×D gradient exists (the runtime's
  ``GradientRelease``; the deferred head gradient is then rebuilt slab by slab).

The runtime builds it once from the spec (``MemorySpec.options()`` in
pgs/runtime/optim/config.py, ``"auto"`` resolved) and hands it to the binder, which passes it
down; the objectives take the binder's to the losses.  A caller in Python builds one directly::

    params = pf.apply_updates(params, updates, memory=pf.MemoryOptions(stochastic_rounding=True), state=state)
"""

from __future__ import annotations

import dataclasses

from pgs.errors import InvalidArgument


# A frozen dataclass, not attrs (as ``StepContext``): ``pf.compile``'s step reads it inside the
# graph it traces, and dynamo does not trace attrs' frozen classes.
@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """A run's memory trade-offs as the pure layer reads them (see the module docstring).

    Attributes:
        stochastic_rounding: round bf16 parameters stochastically in the update.
        defer_head_grad: the losses leave the head's gradient out of autograd (a
            ``DeferredHeadGrad`` in the result instead).
        tied_slabs: rows per slab of the tied embedding's step at the end of backward (0: off;
            gradient release on one process).
    """

    stochastic_rounding: bool = False
    defer_head_grad: bool = False
    tied_slabs: int = 0

    def __post_init__(self):
        for name in ("stochastic_rounding", "defer_head_grad"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"MemoryOptions.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.tied_slabs, bool) or not isinstance(self.tied_slabs, int) or self.tied_slabs < 0:
            raise InvalidArgument(f"MemoryOptions.tied_slabs must be an int >= 0 (rows per slab; 0: off), "
                                  f"got {self.tied_slabs!r}")

    def evolve(self, **changes) -> "MemoryOptions":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


#: No memory trade-off: round to nearest, the head's gradient through autograd, no slabs.
NO_MEMORY_OPTIONS = MemoryOptions()


def memory_options(value, where: str) -> MemoryOptions:
    """``value`` if it is a ``MemoryOptions`` (None: ``NO_MEMORY_OPTIONS``); else ``InvalidArgument``
    naming ``where`` (the function that was given it)."""
    if value is None:
        return NO_MEMORY_OPTIONS
    if not isinstance(value, MemoryOptions):
        raise InvalidArgument(f"{where}: memory must be a pgs.func.MemoryOptions, got {type(value).__name__}")
    return value
