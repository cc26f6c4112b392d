"""``make_optimizer``: the one place that picks a binder for a run (``pgs.runtime.optim.interface``)."""

from __future__ import annotations

import torch

import pgs.func as pf
from pgs.errors import SpecError
from pgs.func.schedule_free_iterates import wraps_schedule_free
from pgs.runtime.optim.bound import BoundOptimizer
from pgs.runtime.optim.interface import Optimizer
from pgs.runtime.optim.memory import MemorySetup, single_process_refusal
from pgs.runtime.optim.offload import OffloadedRelease
from pgs.runtime.optim.release import GradientRelease
from pgs.runtime.optim.sharded_bind import ShardedBoundOptimizer
from pgs.runtime.optim.sharded_offload import ShardedOffloadedRelease
from pgs.runtime.optim.sharded_release import ShardedGradientRelease


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

    ``memory.offload_optimizer`` (gradient release) takes ``OffloadedRelease`` on one process:
    the release with each group's state in pinned host memory (pgs/runtime/optim/offload.py);
    ``ShardedOffloadedRelease`` on several, each rank's shards' state in its host memory, one
    FSDP unit at a time (pgs/runtime/optim/sharded_offload.py).
    """
    setup = MemorySetup.of(memory)  # the [memory] rules checked once (MemorySpec.refusal)
    options = setup.options  # what the binder passes down to the kernels (pf.MemoryOptions)
    if sharded:
        why = single_process_refusal(options)
        if why:
            raise SpecError(why)
        if wraps_schedule_free(chain):
            raise SpecError("optimizer: a schedule-free optimizer is evaluated and exported at its averaged point x, "
                            "which pgs computes on one process only for now; run it with WORLD_SIZE = 1")
        if setup.gradient_release:
            # each FSDP unit's chain runs right after its reduce-scatter, inside backward; a bf16
            # model already has fp32 sharded masters (mixed precision), so master_weights adds nothing
            binder = ShardedOffloadedRelease if setup.offload_optimizer else ShardedGradientRelease
            return binder(chain, model, memory=options, grad_accum=grad_accum)
        return ShardedBoundOptimizer(chain, model, memory=options)
    if setup.gradient_release:
        binder = OffloadedRelease if setup.offload_optimizer else GradientRelease
        return binder(chain, model, memory=options, master_weights=setup.master_weights, grad_accum=grad_accum,
                      groups=setup.release_groups)
    return BoundOptimizer(chain, model, compile=compile, jit=jit, memory=options)
