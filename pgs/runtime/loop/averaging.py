"""Weight averaging in the loop (``[averaging]``, docs/techniques/ema.md and merge.md): an EMA of the weights held on
the CPU, and merge-back toward the base weights (SFA, linear or SLERP).

**EMA** (Polyak averaging; ``pgs.func.ema``, docs/techniques/ema.md): every ``ema_every`` steps the
trainable weights are copied to the CPU and θ^ema ← δ θ^ema + (1 − δ) θ in fp32, δ = ``ema``
per update (the first update copies θ).  The copy is queued on the device without waiting
(pinned host buffers, ``non_blocking``) and the average is taken on the host at the next step
boundary that needs it (the next step's end, an eval, a checkpoint, the export), so the device's
queue is not drained.  The shadow weights are evaluated beside the model (``ema_eval_loss``,
...), exported as their own HF folder (``<run dir>/final-ema``) and written into every
checkpoint (``averaging.safetensors``), so a resumed run continues the same average.

**Merge-back** (SFA, Kleiman et al., arXiv 2501.05559; ``pgs.func.merge_back``,
docs/techniques/merge.md): every ⌈p·T⌉ steps (p = ``merge_period``, T = the run's steps) and at the last step, the
weights are pulled toward the base weights θ_o (those the run started from): θ ← (1 − β) θ + β θ_o
(``merge = "linear"``, the paper's) or ``slerp(1 − β, θ_o, θ)`` per tensor (``"slerp"``).  The
base is copied to the CPU when the run is set up, before any checkpoint is restored: the model
is then built exactly as at step 0 (the same weights or the same ``init_seed``), so the base
needs no room in a checkpoint.  A merge happens right after its step, before that step's
checkpoint and EMA update; the optimizer's state is left as it is.

**Several processes** (FSDP2, docs/distributed.md): every parameter is a DTensor whose local
shard is this rank's, and everything above is done on the local shards: each rank keeps the
EMA (and the merge base) of its own shard in host memory, so the host memory per rank falls
with N.  The EMA and the merge are elementwise, so on shards they compute what one process
computes on the whole tensor; SLERP's norms and dot product are per tensor, so their shard
sums are all-reduced first (equal to one process up to the order of the sums).  The EMA goes
into the sharded checkpoint as DTensors of the parameters' placements (each rank writes its
shard; a resume on another world size reshards it by global shape), and the exported
``final-ema`` is gathered like ``final/``.  Before the shards are written (a merge, the EMA
swapped in and out for an eval or the export) the gathered parameters an eval forward left
are freed, so the next forward gathers the written shards.
"""

from __future__ import annotations

import contextlib
import math
from typing import ClassVar, Iterator

import attrs
import torch

import pgs.func as pf
from pgs.func.merge import DOT_THRESHOLD, NORM_EPS
from pgs.errors import CheckpointError, SpecError
from pgs.runtime.spec.fields import expect, int_at_least, is_number, number_in, one_of, to_float

#: The name of the EMA's checkpoint state (``Service.state_name``) and the one-process file of it.
CHECKPOINT_NAME = "averaging"
CHECKPOINT_FILE = f"{CHECKPOINT_NAME}.safetensors"
#: The HF folder of the EMA weights, beside ``final/``.
EXPORT_DIR = "final-ema"
MERGE_METHODS = ("none", "linear", "slerp")  # pgs.func.merge.METHODS, and "none"


@attrs.frozen
class AveragingSpec:
    """``[averaging]``: weight averaging in the loop (``pgs.runtime.loop.averaging``,
    docs/techniques/ema.md and merge.md).

    ``ema`` (δ in [0, 1), 0: off): an EMA of the weights held on the CPU, updated every
    ``ema_every`` steps (δ per update), evaluated beside the model, exported as
    ``<run dir>/final-ema`` and kept in checkpoints.  ``merge`` (``"none"``, ``"linear"``: SFA,
    arXiv 2501.05559; ``"slerp"``): every ⌈``merge_period``·T⌉ steps and at the last one, pull the
    weights toward the run's starting weights with weight ``merge_weight`` (β).
    """

    section: ClassVar[str] = "averaging"

    ema: float = attrs.field(default=0.0, converter=to_float,
                             validator=expect("a number in [0, 1)", lambda v: is_number(v) and 0 <= v < 1))
    ema_every: int = attrs.field(default=1, validator=int_at_least(1))
    merge: str = attrs.field(default="none", validator=one_of(MERGE_METHODS))
    merge_weight: float = attrs.field(default=0.25, converter=to_float, validator=number_in(0.0, 1.0))
    merge_period: float = attrs.field(default=1.0, converter=to_float,
                                      validator=expect("a number in (0, 1]", lambda v: is_number(v) and 0 < v <= 1))

    def check(self, spec) -> None:
        """``[averaging]`` against the rest: a merge-back writes the model's weights, which fp32
        master weights (kept by gradient release) would overwrite at the next step."""
        if self.merge != "none" and spec.memory.master_weights != "none":
            raise SpecError(f"averaging.merge: {self.merge!r} writes the model's weights, "
                            f"but memory.master_weights = {spec.memory.master_weights!r} keeps the weights "
                            "the optimizer steps elsewhere (the merge would be undone at the next step); "
                            "set averaging.merge = \"none\" or master_weights = \"none\"")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage on this rank: the local shard of an FSDP2 DTensor, else itself."""
    return p.to_local() if _is_dtensor(p) else p


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class WeightAverager:
    """The EMA and the merge-back of one run (see the module docstring).  ``sharded``: the
    model's parameters are FSDP2 DTensors (several processes); everything is done on the local
    shards, and :meth:`state_dict` returns DTensors."""

    def __init__(self, model, *, total_steps: int, ema: float = 0.0, ema_every: int = 1, merge: str = "none",
                 merge_weight: float = 0.25, merge_period: float = 1.0):
        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sharded = any(_is_dtensor(p) for _, p in self.named)
        self.total = int(total_steps)
        self.decay = float(ema)
        self.ema_every = max(1, int(ema_every))
        self.merge = merge
        self.merge_weight = float(merge_weight)
        self.merge_every = max(1, math.ceil(float(merge_period) * self.total))
        self._transform = pf.ema(self.decay) if self.decay > 0 else None
        self._states: dict[str, pf.EmaState] = {}
        self._host: dict[str, torch.Tensor] | None = None  # pinned copies waiting to be averaged
        self._event = None
        self._waiting = False
        if self._transform is not None:
            for name, p in self.named:
                self._states[name] = self._transform.init({name: torch.empty(_local(p).shape, dtype=torch.float32)})
        self.base = {n: _local(p).detach().to("cpu", copy=True) for n, p in self.named} if merge != "none" else None

    @classmethod
    def from_spec(cls, spec, model, total_steps: int) -> "WeightAverager | None":
        a = spec.averaging
        if a is None or (a.ema == 0 and a.merge == "none"):
            return None
        return cls(model, total_steps=total_steps, ema=a.ema, ema_every=a.ema_every, merge=a.merge,
                   merge_weight=a.merge_weight, merge_period=a.merge_period)

    @property
    def has_ema(self) -> bool:
        return self._transform is not None

    @property
    def ready(self) -> bool:
        """An EMA that has taken (or queued) at least one update: before that it holds nothing
        to evaluate (the eval before the first step evaluates the model only)."""
        if not self.has_ema:
            return False
        return self._waiting or any(int(s.count) > 0 for s in list(self._states.values())[:1])

    def _release_gathered(self) -> None:
        """Several processes: free the parameters an eval forward left gathered (the root and the
        last layer keep theirs after forward), so that the next forward gathers the shards as
        they are after a write."""
        if self.sharded:
            from pgs.runtime.dist.fsdp import reshard

            reshard(self.model)

    # -- after every step ---------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """Step ``step`` is done: merge back if due, then queue the EMA's copy if due."""
        self.settle()
        if self.base is not None and (step % self.merge_every == 0 or step == self.total):
            self.merge_back()
        if self.has_ema and (step % self.ema_every == 0 or step == self.total):
            self._queue_copy()

    @torch.no_grad()
    def merge_back(self) -> None:
        """θ ← merge_back(θ, θ_o, β), one tensor at a time on the parameters' device (each rank
        its own shards)."""
        self._release_gathered()
        for name, p in self.named:
            mine = _local(p)
            base = self.base[name].to(mine.device, non_blocking=True)
            if self.sharded and self.merge == "slerp":
                mine.copy_(_sharded_slerp(1.0 - self.merge_weight, base, mine.detach()))
                continue
            merged = pf.merge_back({name: mine.detach()}, {name: base}, self.merge_weight, method=self.merge)
            mine.copy_(merged[name])

    def _queue_copy(self) -> None:
        if self._host is None:
            pin = self.named[0][1].device.type == "cuda" if self.named else False
            self._host = {n: torch.empty(_local(p).shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                          for n, p in self.named}
        for name, p in self.named:
            self._host[name].copy_(_local(p).detach(), non_blocking=True)
        self._event = None
        if self.named and self.named[0][1].device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._waiting = True

    def settle(self) -> None:
        """Take the queued average now (waits for the copy only if it is still in flight)."""
        if not self._waiting:
            return
        if self._event is not None:
            self._event.synchronize()
        for name, weight in self._host.items():
            _, self._states[name] = self._transform.update({name: weight}, self._states[name])
        self._waiting = False

    # -- what the EMA is used for -------------------------------------------------------
    def ema_params(self) -> dict[str, torch.Tensor]:
        """The averaged weights, fp32 on the CPU (by parameter name; this rank's shards when sharded)."""
        self.settle()
        return {name: pf.ema_params(state)[name] for name, state in self._states.items()}

    @contextlib.contextmanager
    @torch.no_grad()
    def ema_weights(self, model) -> Iterator[None]:
        """Inside: the model holds the EMA weights (for an eval or an export); after: its own.
        Several processes: every rank swaps its own shards (a collective: every rank enters)."""
        averaged = self.ema_params()
        kept = {name: _local(p).detach().to("cpu", copy=True) for name, p in self.named}
        self._release_gathered()
        try:
            for name, p in self.named:
                _local(p).copy_(averaged[name])
            yield
        finally:
            self._release_gathered()
            for name, p in self.named:
                _local(p).copy_(kept[name])

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA for ``averaging.safetensors``: ``ema.<name>`` fp32, its update count and
        correction (equal for every tensor: they are updated together).  Sharded: each
        ``ema.<name>`` is a DTensor of its parameter's mesh and placements over this rank's
        shard (DCP writes each rank's part), count and correction replicated."""
        self.settle()
        out: dict[str, torch.Tensor] = {}
        params = dict(self.named)
        for name, state in self._states.items():
            ema = state.ema[name].contiguous()
            if self.sharded:
                ema = _host_dtensor(ema, params[name])
            out[f"ema.{name}"] = ema
            out["count"], out["correction"] = state.count.reshape(1), state.correction.reshape(1)
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor] | None, folder: str) -> None:
        if not self.has_ema:
            return
        if tensors is None:
            raise CheckpointError(f"{folder}: no {CHECKPOINT_FILE}, but [averaging] ema is on; the checkpoint "
                                  "was written without it (resume with the spec it was written with)")
        missing = [n for n in self._states if f"ema.{n}" not in tensors]
        if missing:
            raise CheckpointError(f"{folder}: {CHECKPOINT_FILE} lacks the EMA of {missing[0]}")
        count = tensors["count"].reshape(()).to(torch.int32)
        correction = tensors["correction"].reshape(()).to(torch.float32)
        for name in self._states:
            ema = _local(tensors[f"ema.{name}"]).to("cpu", torch.float32)  # the average lives in host memory
            self._states[name] = pf.EmaState(count.clone(), {name: ema.clone() if self.sharded else ema},
                                             correction.clone())


def _host_dtensor(local: torch.Tensor, param) -> torch.Tensor:
    """``local`` (this rank's shard of the EMA of ``param``, fp32 in host memory) as a DTensor of
    ``param``'s mesh, placements and global shape, without a copy.  ``DTensor.from_local`` would
    move a host tensor to the mesh's device (a GPU copy of the shard at every checkpoint); DCP
    writes a DTensor's local shard wherever it lives, as it does for FSDP2's own offloaded
    parameters, so the shard is wrapped where it is."""
    from torch.distributed.tensor import DTensor

    mesh = param.device_mesh
    if local.device.type == mesh.device_type:
        return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(param.placements), tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _sharded_slerp(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``pf.merge.slerp(t, a, b)`` of two tensors of which this rank holds the local shards
    ``a``, ``b``: the norms and the dot product are shard sums all-reduced over the ranks (one
    all-reduce of three numbers), the interpolation is elementwise on the shard."""
    from pgs.runtime.process import all_reduce_sum

    cd = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    x, y = a.to(cd).reshape(-1), b.to(cd).reshape(-1)
    sums = all_reduce_sum(torch.stack([(x * x).sum(), (y * y).sum(), (x * y).sum()]).double()).to(cd)
    nx, ny = sums[0].sqrt(), sums[1].sqrt()
    d = sums[2] / (torch.where(nx > NORM_EPS, nx, 1.0) * torch.where(ny > NORM_EPS, ny, 1.0))
    colinear = d.abs() > DOT_THRESHOLD
    omega = torch.arccos(torch.where(colinear, torch.zeros_like(d), d.clamp(-1.0, 1.0)))
    sin_o = torch.where(colinear, torch.ones_like(omega), torch.sin(omega))
    s0 = torch.sin((1.0 - t) * omega) / sin_o
    s1 = torch.sin(t * omega) / sin_o
    out = torch.where(colinear, (1.0 - t) * x + t * y, s0 * x + s1 * y)
    return out.reshape(a.shape).to(b.dtype)
