"""The runtime's optimizer interface: what the loop, checkpoints and tools ask of a chain bound to a model.

A pure chain (``pgs.func``) knows nothing of modules, hooks or processes.  A *binder* holds its
state next to a model's parameters and applies it; the training loop, checkpoints and tools talk
to every binder through :class:`Optimizer` only.  Four binders implement it:

================================  ==========================  ============================
binder                            when the chain runs          parameters
================================  ==========================  ============================
``BoundOptimizer`` (bound.py)      ``step()`` after backward    whole tensors (flat buffers
                                                               with ``compile=True``)
``GradientRelease`` (release.py)   inside backward, per group   whole tensors, gradients freed
                                                               as each group steps
``ShardedBoundOptimizer``          ``step()`` after backward    FSDP2 shards
(sharded_bind.py)
``ShardedGradientRelease``         inside backward, per unit    FSDP2 shards
(sharded_release.py)
================================  ==========================  ============================

``OffloadedRelease`` (offload.py) is ``GradientRelease`` with each group's state in host memory,
streamed through the device inside backward (``memory.offload_optimizer``);
``ShardedOffloadedRelease`` (sharded_offload.py) is ``ShardedGradientRelease`` with each unit's
state of this rank's shards streamed alike.

:func:`pgs.runtime.optim.make.make_optimizer` is the only place that chooses among them, from
``[memory]``, ``[optimizer]`` and the process layout; ``pgs.runtime.loop.train`` and ``pgs
profile`` call it.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable

import attrs
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.func.memory_options import memory_options


@attrs.frozen
class StepMetrics:
    """What the last optimizer step reports (None: the chain or binder does not track it).

    ``lr``: the learning rate the step used.  ``grad_norm``: ‖g‖ before any clipping (kept by a
    clip/ZClip stage, or measured by a release over the backward's gradients).  ``spike``: a
    stage of the chain vetoed the step (``pf.skip_signal``: ZClip in mode "skip" on a spike, or
    a non-finite norm), so the weights and the chain state are as they were before it.  A
    spike that ZClip only clipped is not one.  ``spikes_skipped``: how many it
    has skipped so far.  ``release_steps``: backwards a release has stepped.  With
    ``tensors=True`` the numbers may be 0-d device tensors (no host read)."""

    lr: Any = None
    grad_norm: Any = None
    spike: bool = False
    spikes_skipped: int | None = None
    release_steps: int | None = None


@runtime_checkable
class Optimizer(Protocol):
    """A pure chain bound to a model's trainable parameters.

    ``in_backward``: True when the chain runs inside backward (gradient release): the loop must
    agree on the loss before backward, and ``step()`` only completes what backward started.
    """

    in_backward: bool
    #: The memory options it was built with (``pf.MemoryOptions``: ``MemorySpec.options()`` of the
    #: run's ``[memory]``); the objectives take it to the losses (``defer_head_grad``).
    memory: pf.MemoryOptions

    def step(self) -> None:
        """Apply the chain to the current gradients (after backward), or finish a release."""

    def zero_grad(self) -> None:
        """Drop gradients and any pending ``before_step`` contribution."""

    def before_step(self, param: torch.Tensor, contribution: Any) -> None:
        """Add ``contribution`` into ``param``'s gradient right before ``param`` steps.

        ``contribution``: a function ``fn(grad)`` adding in place, or an object with
        ``add_to(grad)`` (and ``add_rows_to(out, r0, r1)`` where the weight steps in row slabs),
        e.g. ``token_loss(..., memory=pf.MemoryOptions(defer_head_grad=True)).head_grad``.  Binders
        that cannot do it raise ``InvalidArgument``; :attr:`defers_contributions` says which can."""

    @property
    def defers_contributions(self) -> bool:
        """Whether ``before_step`` is supported."""

    def metrics(self, *, tensors: bool = False) -> StepMetrics:
        """What the last step reports (see :class:`StepMetrics`)."""

    def grad_norm(self) -> float | None:
        """‖g‖ of the current (or, for a release, the last backward's) gradients."""

    def state_dict(self, device: str | torch.device | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
        """The state for a single-process checkpoint, ``{key: tensor}`` with a layout fingerprint;
        ``copy=False``: the live state's tensors themselves (views, for a streaming write)."""

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict``'s output; refuses another parameter layout."""

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """The state as entries of a sharded (DCP) checkpoint: leaves that mirror a parameter
        keyed by path (DTensors on several processes), the rest per rank."""

    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        """Restore entries shaped like ``dcp_state()``'s, as loaded by DCP."""

    def state_bytes(self) -> int:
        """Bytes the optimizer holds beyond the model (chain state, fp32 masters)."""

    def eval_weights(self) -> ContextManager[None]:
        """Inside: the parameters hold the point the model is evaluated and exported at (a
        schedule-free chain's x, ``pf.schedule_free_eval_params``); after: the parameters it
        steps, bit for bit.  A chain that evaluates where it steps moves nothing."""


def binder_options(memory: pf.MemoryOptions | None, who: str, *, slabs: bool = False) -> pf.MemoryOptions:
    """``memory`` checked for the binder ``who``: a ``pf.MemoryOptions`` (None: none of them), and
    ``tied_slabs`` only where the binder steps the tied weight in row slabs (``slabs``:
    ``GradientRelease`` on one process); elsewhere it would be silently dropped, so it is refused."""
    memory = memory_options(memory, who)
    if memory.tied_slabs and not slabs:
        raise InvalidArgument(f"{who}: memory.tied_slabs={memory.tied_slabs}: the tied weight is stepped in row "
                              "slabs by gradient release on one process (GradientRelease); set tied_slabs=0")
    return memory


def step_metrics(state: Any, chain: pf.Transform, *, tensors: bool = False) -> StepMetrics:
    """The :class:`StepMetrics` that a chain's state reports (``pf.reported_metrics``); whether
    the step was skipped is the chain's veto (``pf.skip_signal``), not a stage's spike flag."""
    found = pf.reported_metrics(state)
    read = (lambda x: x.detach().reshape(())) if tensors else (lambda x: x.item())
    vetoed = pf.skip_signal(chain, state)
    return StepMetrics(
        lr=read(found["lr"]) if "lr" in found else None,
        grad_norm=read(found["grad_norm"]) if "grad_norm" in found else None,
        spike=False if vetoed is None else (read(vetoed) if tensors else bool(vetoed)),
        spikes_skipped=int(found["spikes_skipped"]) if "spikes_skipped" in found else None,
    )
