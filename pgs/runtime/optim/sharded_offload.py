"""Optimizer state in host memory with FSDP2: each rank streams its own shards' state.

``ShardedOffloadedRelease(chain, model)`` is ``ShardedGradientRelease``
(pgs/runtime/optim/sharded_release.py: the chain runs inside backward, one FSDP2 unit right
after its reduce-scatter) whose per-unit chain state lives in host memory (pinned where a CUDA
device is present) and visits the device only for that unit's step, through the staging slots
of ``OffloadedRelease`` (pgs/runtime/optim/offload.py: ``StateStager``, ``StreamedStates``).
A unit is what FSDP2 reduce-scatters at once (a decoder layer; the root: embeddings, final
norm, head), so it is also what is fetched, stepped and written back at once.

Each rank holds the state of its own shards only (``chain.init`` of ``p.to_local()``: rows
``r·⌈rows/N⌉ …`` of every parameter), so the host state of each process, its device staging
and its PCIe traffic per step are about 1/N of one process's: at 8 B parameters and an 8-bit
state (≈ 1 B/param) on 4 ranks, ≈ 2 GiB of pinned host memory per rank instead of 8.  Eight
ranks of one host together hold one copy of the state, as one process would.

Per unit and step, on its rank: host → device S_u/N bytes, device → host S_u/N bytes, where
S_u is the unit's whole state.  The fetch of the next units overlaps the backward of the
layers in between, as on one process; the order is learned from the backward before (units
complete in reverse layer order, the root last).  On CUDA the hooks run on FSDP2's
reduce-scatter stream: the step's reads wait for the copy's event on that stream, and the
write-back waits for an event recorded on it (``StateStager`` orders everything by events on
the current stream, whichever that is).

Exactness: the same chain on the same values (the staged views are the state), so the
weights and state equal the on-device ``ShardedGradientRelease`` bit for bit, 8-bit state
included (tests/integration/test_fsdp_offload.py).  Checkpoints are DCP, per rank, as the
on-device sharded release writes them (same keys: the files load into either): leaves that
mirror a parameter's shard are DTensors, 8-bit codes and scales per rank; ``dcp_state``
hands DCP views of the host buffer (no second host copy), and a resume loads into it.
"""

from __future__ import annotations

import torch

import pgs.func as pf
from pgs.errors import TreeMismatch
from pgs.runtime.optim.offload import StreamedStates, stager_for
from pgs.runtime.optim.sharded_bind import RANK_KEY, local
from pgs.runtime.optim.sharded_release import ShardedGradientRelease


class ShardedOffloadedRelease(StreamedStates, ShardedGradientRelease):
    """``ShardedGradientRelease`` with each unit's state (this rank's shards) in host memory,
    streamed through ``slots`` device staging buffers inside backward.  See the module docstring.

    Takes ``ShardedGradientRelease``'s arguments, plus ``slots`` (as ``OffloadedRelease``'s:
    None takes ``offload.auto_slots`` of the units' state sizes).
    """

    def __init__(self, chain, model, *, slots: int | None = None, **kw):
        self._slots = slots
        self.step_extras: dict[str, float] = {}
        super().__init__(chain, model, **kw)
        self._start_streaming(list(self.units))

    def _init_states(self) -> dict:
        """Each unit's state (of this rank's shards) made on the device and moved to the host
        before the next one's is made (``stager_for``)."""
        self.stager = stager_for(self.chain, self.units, self._unit_params, self._slots, **self.hooks())
        return {u: self.stager.home(u) for u in self.units}

    def _begin(self) -> None:
        super()._begin()
        self._stream_begin()

    @torch.no_grad()
    def _step_unit(self, unit: str) -> None:
        self._stream_step(unit, super()._step_unit)

    def finish(self) -> None:
        active = self._arrivals.active
        super().finish()
        if active:
            self.step_extras = self._stream_end(self.units)

    # -- state for checkpoints --------------------------------------------------------------
    def dcp_state(self) -> dict[str, torch.Tensor]:
        """As ``ShardedGradientRelease.dcp_state`` once every copy is done, its values views of
        the host buffer and the 0-d leaves (no copy: DCP reads them during the save, and a load
        writes into them)."""
        from torch.distributed.tensor import DTensor

        self.stager.synchronize()
        out: dict[str, torch.Tensor] = {}
        for path, x in pf.state_to_dict(self.states, copy=False).items():
            out.update(self._entry(path, x, DTensor))
        return out

    @torch.no_grad()
    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        """Restore what ``dcp_state()`` returned after a DCP load: each entry into its leaf of
        the host buffer (DCP usually wrote it there already) or the device (0-d leaves); any
        staged copy is dropped."""
        self.stager.synchronize()
        prefix = RANK_KEY.format(rank=self.rank) + "."
        flat = {(k[len(prefix):] if k.startswith(prefix) else k): local(v).detach() for k, v in loaded.items()}
        try:
            for leaf, entry in pf.state_entries(self.states, flat):
                if leaf.data_ptr() != entry.data_ptr() or leaf.device != entry.device:
                    leaf.copy_(entry)
        except TreeMismatch as err:
            raise TreeMismatch(f"optimizer state in the checkpoint does not fit this chain (saved with "
                               f"gradient release per FSDP unit?): {err}") from None
        for u in self.units:
            self.stager.forget(u)
