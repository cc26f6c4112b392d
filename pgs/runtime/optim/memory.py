"""The memory setup: ``[memory]`` as one typed, frozen object for the runtime code that applies it.

:class:`MemorySetup` is built from the spec's ``[memory]`` (``MemorySetup.of``): every ``"auto"``
resolved (the deferred head gradient, the offloaded checkpoint inputs' prefetch depth), every
rule between two ``[memory]`` options checked (``MemorySpec.refusal``, each rule written once,
also used by the spec's own check).  ``make_optimizer`` picks and builds the binder from it,
``apply_memory`` wraps the model with it.  What code below the binder reads (stochastic
rounding, the deferred head gradient, tied slabs) is its ``options``, a ``pgs.func.MemoryOptions``
made by ``MemorySpec.options()``: the binder keeps it and passes it down to the kernels, the
objectives take the binder's to the losses.
"""

from __future__ import annotations

import attrs

import pgs.func as pf
from pgs.errors import SpecError
from pgs.runtime.optim.config import checkpoint_offload, head_grad_wanted  # noqa: F401  (head_grad_wanted: re-exported)


def single_process_refusal(memory) -> str | None:
    """Why ``[memory]`` cannot run on several processes (None: it can).  Checked by ``pgs run
    --nproc`` before it launches (pgs/runtime/dist/launch.py) and by each rank in ``make_optimizer``."""
    if memory.tied_slabs:
        return ("memory.tied_slabs: with several processes FSDP2 reduce-scatters the embedding's whole V×D "
                "gradient (every rank builds it, then keeps its V/N rows), so row slabs cannot avoid it; "
                "set tied_slabs = 0 (each rank already steps only its own rows; docs/distributed.md)")
    return None


@attrs.frozen
class MemorySetup:
    """``[memory]`` resolved for the runtime code that applies it (see the module docstring).

    Attributes:
        options: what the binder, the kernels and the losses read (``pf.MemoryOptions``:
            stochastic rounding, the deferred head gradient with ``"auto"`` resolved, tied slabs;
            ``single_process_refusal`` says why slabs cannot run on several processes).
        gradient_release: the chain runs inside backward (``GradientRelease`` and kin).
        master_weights: None, or ``"fp32"``: fp32 masters of low-precision parameters (release).
        release_groups: what steps together inside backward (``"layer"``, ``"sublayer"``, ``"parameter"``).
        offload_optimizer: the release state lives in pinned host memory (``OffloadedRelease``).
        activation_checkpointing, checkpoint_every: the checkpointing policy and its stride.
        checkpoint_offload: the checkpointed inputs' offload (False, or the prefetch depth).
        mlp_tiles: token slices of each layer's MLP (0: off).
        compile_layers, liger: per-layer ``torch.compile``; Liger's kernels.
    """

    options: pf.MemoryOptions = pf.NO_MEMORY_OPTIONS
    gradient_release: bool = False
    master_weights: str | None = None
    release_groups: str = "layer"
    offload_optimizer: bool = False
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1
    checkpoint_offload: int | bool = False
    mlp_tiles: int = 0
    compile_layers: bool = False
    liger: bool = False

    @classmethod
    def of(cls, memory) -> "MemorySetup":
        """The setup of a ``MemorySpec``; ``SpecError`` (``MemorySpec.refusal``) when two of
        them cannot run together."""
        why = memory.refusal()
        if why:
            raise SpecError(why)
        return cls(
            options=memory.options(), gradient_release=memory.gradient_release,
            master_weights=None if memory.master_weights == "none" else memory.master_weights,
            release_groups=memory.release_groups, offload_optimizer=memory.offload_optimizer,
            activation_checkpointing=memory.activation_checkpointing, checkpoint_every=memory.checkpoint_every,
            checkpoint_offload=checkpoint_offload(memory.offload_checkpoints, memory.offload_prefetch,
                                                  memory.offload_optimizer),
            mlp_tiles=memory.mlp_tiles, compile_layers=memory.compile_layers, liger=memory.liger)
