"""``make_optimizer``: the one place that picks a binder for a run (``pgs.runtime.optim.interface``)."""

from __future__ import annotations

import torch

import pgs.func as pf
from pgs.errors import SpecError
from pgs.func.schedule_free_iterates import wraps_schedule_free
from pgs.runtime.optim.bound import BoundOptimizer
from pgs.runtime.optim.interface import Optimizer
from pgs.runtime.optim.offload import OffloadedRelease
from pgs.runtime.optim.release import GradientRelease
from pgs.runtime.optim.sharded_bind import ShardedBoundOptimizer
from pgs.runtime.optim.sharded_release import ShardedGradientRelease


def single_process_refusal(memory) -> str | None:
    """Why ``[memory]`` cannot run on several processes (None: it can).  Checked by ``pgs run
    --nproc`` before it launches (pgs/runtime/dist/launch.py) and by each rank here."""
    if getattr(memory, "offload_optimizer", False):
        return ("memory.offload_optimizer: runs on one process (each process already holds only its "
                "shard of the state with several); set offload_optimizer = false or run one process")
    if int(getattr(memory, "tied_slabs", 0) or 0):
        return ("memory.tied_slabs: the row-slab step of the tied weight runs on one process; "
                "set tied_slabs = 0 with several processes")
    return None


def make_optimizer(chain: pf.Transform, model: torch.nn.Module, memory, *, sharded: bool = False,
                   grad_accum: int = 1, compile: bool = False, jit: bool = False) -> Optimizer:
    """The binder for a run: ``memory`` is the spec's ``[memory]`` (``MemorySpec``), ``sharded``
    whether ``model`` is FSDP2-sharded over several processes, ``compile``/``jit`` the spec's
    ``optimizer.compile``/``optimizer.jit`` (flat fused buffers; the plain binder only).

    =====================  ======================  ==========================
    ``gradient_release``   one process              several processes
    =====================  ======================  ==========================
    false                  ``BoundOptimizer``       ``ShardedBoundOptimizer``
    true                   ``GradientRelease``      ``ShardedGradientRelease``
    =====================  ======================  ==========================

    ``memory.offload_optimizer`` (gradient release on one process) takes ``OffloadedRelease``:
    the release with each group's state in pinned host memory (pgs/runtime/optim/offload.py).
    """
    tied_slabs = int(getattr(memory, "tied_slabs", 0) or 0)
    offload = bool(getattr(memory, "offload_optimizer", False))
    why = memory.refusal()  # the [memory] rules, written once (MemorySpec.refusal)
    if why:
        raise SpecError(why)
    if sharded:
        why = single_process_refusal(memory)
        if why:
            raise SpecError(why)
        if wraps_schedule_free(chain):
            raise SpecError("optimizer: a schedule-free optimizer is evaluated and exported at its averaged point x, "
                            "which pgs computes on one process only for now; run it with WORLD_SIZE = 1")
        if memory.gradient_release:
            # each FSDP unit's chain runs right after its reduce-scatter, inside backward; a bf16
            # model already has fp32 sharded masters (mixed precision), so master_weights adds nothing
            return ShardedGradientRelease(chain, model, stochastic_rounding=memory.stochastic_rounding,
                                          grad_accum=grad_accum)
        return ShardedBoundOptimizer(chain, model, stochastic_rounding=memory.stochastic_rounding)
    if memory.gradient_release:
        binder = OffloadedRelease if offload else GradientRelease
        return binder(chain, model, stochastic_rounding=memory.stochastic_rounding,
                               master_weights=None if memory.master_weights == "none" else memory.master_weights,
                               grad_accum=grad_accum, tied_slabs=tied_slabs or None,
                               groups=getattr(memory, "release_groups", "layer"))
    return BoundOptimizer(chain, model, compile=compile, jit=jit, stochastic_rounding=memory.stochastic_rounding)
