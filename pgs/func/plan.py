"""The execution-plan registry: the one place that decides whether a chain runs fused.

Every executor asks ``plan_for(chain, placement)`` and gets a ``Plan`` or None (run the
chain's own ``update`` and apply it):

- ``pf.compile``'s ``FlatChain`` (``FLAT``: flat buffers, one per group);
- gradient release (``RELEASE``: one group's per-parameter tree, inside backward);
- the sharded binders (``SHARDED``: FSDP2 shards; no plan serves shards yet);
- ``pgs profile``, to say which path a run will take.

A plan's ``step`` has one signature::

    step(grads, state, params, *, ctx: StepContext, donate: bool, memory: MemoryOptions,
         extra: dict | None = None) -> (new_params, new_state) | None

It updates and applies in one go and returns the chain's own state (same NamedTuples, same
buffers), so a run can switch between a plan and the generic path at any step.  It returns
None where it cannot serve this call (a device without the kernel, a dtype it does not
handle): the executor then runs the generic path.  ``ctx.layout`` is the flat layout (None in
gradient release); ``memory`` the run's memory options (``pf.MemoryOptions``: a step reads
``memory.stochastic_rounding``); ``extra`` holds the caller's keyword arguments.

Entries, in the order they are tried (the first that matches wins):

- ``own``: a chain that carries its own fused step (``FusedTransform.fused_step``:
  ``lion8bit``, ``adamw8bit``, ``muon``);
- ``adagc_mona_lion8bit_hyperball``: that exact four-stage chain (``pgs.func.fused_chain8bit``);
- ``adamw_lion``: ``chain(scale_by_adam | scale_by_lion, [add_decayed_weights],
  scale_by_learning_rate)`` with number hyperparameters (``pgs.func.fused_adamw_lion``).

A new fused chain registers one ``PlanEntry``: a ``match(chain)`` that returns its step
function (or None) and the placements it serves.
"""

from __future__ import annotations

from typing import Callable

import attrs

from pgs.func import fused_chain8bit as _chain8bit
from pgs.func import fused_adamw_lion as _fused
from pgs.func.base import Transform


@attrs.frozen
class Placement:
    """Where a step runs.  ``kind``: "flat" (``pf.compile``'s flat buffers), "release" (one
    gradient-release group's per-parameter tree, inside backward) or "sharded" (FSDP2
    shards)."""

    kind: str = attrs.field(validator=attrs.validators.in_(("flat", "release", "sharded")))


FLAT = Placement("flat")
RELEASE = Placement("release")
SHARDED = Placement("sharded")


@attrs.frozen
class Plan:
    """A fused step for one chain: ``name`` (the registry entry) and ``step`` (see the module
    docstring for its signature)."""

    name: str
    step: Callable


@attrs.frozen
class PlanEntry:
    """One registry entry: ``match(chain)`` returns the chain's fused step or None;
    ``placements``: the placement kinds it serves."""

    name: str
    match: Callable[[Transform], Callable | None]
    placements: frozenset


def _own_step(chain: Transform) -> Callable | None:
    return getattr(chain, "fused_step", None)


def _adamw_lion_step(chain: Transform) -> Callable | None:
    plan = _fused.match(chain)
    return None if plan is None else _fused.plan_step(plan)


REGISTRY: list[PlanEntry] = [
    PlanEntry("own", _own_step, frozenset({"flat", "release"})),
    PlanEntry("adagc_mona_lion8bit_hyperball", _chain8bit.match, frozenset({"flat"})),
    PlanEntry("adamw_lion", _adamw_lion_step, frozenset({"flat", "release"})),
]


def register(entry: PlanEntry) -> None:
    """Add ``entry`` to the registry (tried after the entries already there)."""
    if any(e.name == entry.name for e in REGISTRY):
        raise ValueError(f"plan_for: an entry named {entry.name!r} is registered already")
    REGISTRY.append(entry)


def plan_for(chain: Transform, placement: Placement) -> Plan | None:
    """The fused plan for ``chain`` at ``placement``, or None (the generic path)."""
    for entry in REGISTRY:
        if placement.kind not in entry.placements:
            continue
        step = entry.match(chain)
        if step is not None:
            return Plan(entry.name, step)
    return None
