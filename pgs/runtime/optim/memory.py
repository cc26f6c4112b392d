"""The memory options: ``[memory]`` as one typed, frozen object for the code that applies it.

:class:`MemoryOptions` is built once from the spec's ``[memory]`` (``MemoryOptions.of``): every
``"auto"`` resolved (the deferred head gradient, the offloaded checkpoint inputs' prefetch
depth), every rule between two ``[memory]`` options checked (``MemorySpec.refusal``, each rule
written once, also used by the spec's own check).  ``make_optimizer`` picks and builds the
binder from it, ``apply_memory`` wraps the model with it, ``pgs profile`` predicts with it.
"""

from __future__ import annotations

import attrs

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
class MemoryOptions:
    """``[memory]`` resolved for the code that applies it (see the module docstring).

    Attributes:
        gradient_release: the chain runs inside backward (``GradientRelease`` and kin).
        stochastic_rounding: bf16 parameters are rounded stochastically in the update.
        master_weights: None, or ``"fp32"``: fp32 masters of low-precision parameters (release).
        tied_slabs: rows per slab of the tied embedding's step (0: off; release, one process:
            ``single_process_refusal`` says why not with several).
        release_groups: what steps together inside backward (``"layer"``, ``"sublayer"``, ``"parameter"``).
        offload_optimizer: the release state lives in pinned host memory (``OffloadedRelease``).
        defer_head_grad: ``memory.defer_head_grad`` with ``"auto"`` resolved.
        activation_checkpointing, checkpoint_every: the checkpointing policy and its stride.
        checkpoint_offload: the checkpointed inputs' offload (False, or the prefetch depth).
        mlp_tiles: token slices of each layer's MLP (0: off).
        compile_layers, liger: per-layer ``torch.compile``; Liger's kernels.
    """

    gradient_release: bool = False
    stochastic_rounding: bool = False
    master_weights: str | None = None
    tied_slabs: int = 0
    release_groups: str = "layer"
    offload_optimizer: bool = False
    defer_head_grad: bool = False
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1
    checkpoint_offload: int | bool = False
    mlp_tiles: int = 0
    compile_layers: bool = False
    liger: bool = False

    @classmethod
    def of(cls, memory) -> "MemoryOptions":
        """The options of a ``MemorySpec``; ``SpecError`` (``MemorySpec.refusal``) when two of
        them cannot run together."""
        why = memory.refusal()
        if why:
            raise SpecError(why)
        return cls(
            gradient_release=memory.gradient_release, stochastic_rounding=memory.stochastic_rounding,
            master_weights=None if memory.master_weights == "none" else memory.master_weights,
            tied_slabs=memory.tied_slabs, release_groups=memory.release_groups,
            offload_optimizer=memory.offload_optimizer,
            defer_head_grad=memory.head_grad_deferred(),
            activation_checkpointing=memory.activation_checkpointing, checkpoint_every=memory.checkpoint_every,
            checkpoint_offload=checkpoint_offload(memory.offload_checkpoints, memory.offload_prefetch,
                                                  memory.offload_optimizer),
            mlp_tiles=memory.mlp_tiles, compile_layers=memory.compile_layers, liger=memory.liger)
