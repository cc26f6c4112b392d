"""Gradient release under FSDP2: each unit's chain runs as soon as its reduce-scatter is done.

``ShardedGradientRelease(chain, model)`` is ``GradientRelease`` (``pgs.runtime.optim.release``) for
a model sharded by ``pgs.runtime.dist.fsdp.shard_model``, and has the surface of
``ShardedBoundOptimizer`` (``pgs.runtime.optim.sharded_bind``): the chain runs on the local
shards (``p.to_local()``) with ``ctx.reduce_sum`` / ``ctx.whole_tensors``, and
``dcp_state()`` / ``load_dcp_state()`` feed ``pgs.runtime.store.dcp``.  The
difference is *when*: inside backward, one FSDP unit (a decoder layer; the root: embeddings,
final norm, head) at a time, right after FSDP2 has reduce-scattered that unit's gradients;
then the unit's sharded gradients are set to None.  So at most one unit's sharded gradients
exist at a time (plus FSDP's reduce-scatter buffers), instead of all of them until ``step``.

The mechanism (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
``foreach_reduce``): after the reduce-scatter of a unit, FSDP2 assigns each sharded
gradient (``sharded_param.grad = DTensor``) and then calls that sharded parameter's
``_post_accumulate_grad_hooks`` itself (the sharded parameters are not in the autograd graph,
so autograd never would).  ``register_post_accumulate_grad_hook`` on the DTensor parameters
is therefore FSDP2's supported per-unit "optimizer in backward" hook.  The hooks are called
inside ``with device_handle.stream(post_reduce_stream)``: on CUDA every kernel the chain
launches is queued on the reduce-scatter stream, behind the reduce-scatter, so no explicit
event wait is needed before reading the gradient; FSDP2 records its post-reduce event after
the hooks, and ``finalize_backward`` makes the compute stream wait on it, so the next
forward's all-gather reads the updated shards.  The reduce-scatter stream waits for the
compute stream before each reduce-scatter, so state written outside the hooks (``finish``)
is ready; the old chain state, allocated on another stream and dropped inside a hook, is
``record_stream``-ed so that the allocator does not reuse it early.  On gloo (CPU)
everything is synchronous; the CUDA path is reasoned from FSDP2's code, not yet run on GPUs.

Order and collectives.  Units reduce-scatter in the same order on every rank (FSDP2's own
collectives depend on it), so the chain's collectives inside the hooks (``reduce_sum`` for
per-tensor norms, the gathers/scatters of ``whole_tensors`` for Muon) also line up across
ranks.  A *global* transform (global-norm clip, ZClip, AdaGC's global phase) is refused: the
global norm is unknown while backward still runs.  ``grad_accum > 1`` and ``accumulate(...)``
are refused (the step happens at every backward); so are transforms that are not shard-aware
(``Transform.shard_aware`` / ``trust=``), as in ``bind_sharded``.

State.  One chain state per unit (``chain.init`` of that unit's local shards); every unit
steps once per backward, so the step counts advance in lockstep.  Parameters of a unit that
received no gradient (unused in this forward) are stepped with zero gradients when backward
ends (a callback queued on the autograd engine after FSDP2's own final callback), as
``ShardedBoundOptimizer`` would; ``finish()`` / ``step()`` do the same by hand and are
no-ops after a normal backward.  The end-of-backward callback also all-reduces Σ‖g‖² of
the step once (``metrics().grad_norm``): every rank must run the same backwards.

Exactness: for elementwise chains (AdamW, Lion) each element's update is the same
arithmetic as in ``ShardedBoundOptimizer.step`` on the same reduced gradient, so the weights
equal the non-release sharded run bit for bit (tests/integration/test_fsdp_release.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

import pgs.func as pf
from pgs.errors import InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.func.plan import SHARDED, plan_for
from pgs.func.step import NO_CONTEXT
from pgs.runtime.optim.interface import StepMetrics, binder_options
from pgs.runtime.optim.release import Arrivals, check_released_chain, release_metrics, released_step
from pgs.runtime.optim.sharded_bind import RANK_KEY, ShardedBoundOptimizer, is_dtensor, local, refuse_unaware

#: Group key of the parameters that the root FSDP unit manages (embeddings, final norm, head).
ROOT_GROUP = "root"


def fsdp_units(model: torch.nn.Module, names: Sequence[str]) -> dict[str, list[str]]:
    """``{unit: [parameter names]}``: each parameter under the innermost ``fully_shard`` module
    that holds it (``"model.layers.3"``; :data:`ROOT_GROUP` for the root), in unit order of
    ``named_modules`` and parameter order within a unit."""
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out: dict[str, list[str]] = {(u or ROOT_GROUP): [] for u in units}
    for name in names:
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len, default=None)
        if owner is None:
            raise InvalidArgument(f"ShardedGradientRelease: parameter {name!r} is in no fully_shard unit")
        out[owner or ROOT_GROUP].append(name)
    return {u: ns for u, ns in out.items() if ns}


def _record_stream(tree) -> None:
    """On CUDA, tell the caching allocator that the tensors of ``tree`` are in use on the
    current stream (inside FSDP2's hooks: the reduce-scatter stream), so that freeing them
    (the pure chain returns a new state) does not hand their memory to the compute stream
    while queued reduce-scatter-stream kernels still read them.  A no-op on the CPU."""
    if not torch.cuda.is_available():
        return
    stream = None
    for x in T.leaves(tree):
        if isinstance(x, torch.Tensor) and x.is_cuda:
            stream = stream or torch.cuda.current_stream(x.device)
            x.record_stream(stream)


class ShardedGradientRelease(ShardedBoundOptimizer):
    """A pure chain applied inside backward, one FSDP2 unit at a time.  See the module docstring.

    Args:
        chain: any ``pgs.func.Transform`` without ``global`` parts (and shard-aware).
        model: a module after ``pgs.runtime.dist.fsdp.shard_model``.
        trust: as ``bind_sharded``.
        memory: as ``bind_sharded``.
        grad_accum: must be 1 (refused otherwise, with the reason).
        track_grad_norm: Σ‖g‖² over the shards as they stream by, all-reduced once per backward.
    """

    in_backward = True

    def __init__(self, chain: pf.Transform, model: torch.nn.Module, *, trust: Sequence[str] = (),
                 memory: pf.MemoryOptions = pf.NO_MEMORY_OPTIONS, grad_accum: int = 1,
                 track_grad_norm: bool = True):
        from torch.distributed.fsdp import FSDPModule

        who = "ShardedGradientRelease"
        check_released_chain(chain, grad_accum, who, "unit")
        if not isinstance(model, FSDPModule):
            raise InvalidArgument(f"{who}: the model is not sharded; call pgs.runtime.dist.fsdp.shard_model "
                                  "first (or use pgs.runtime.optim.release.GradientRelease on one process)")
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not params:
            raise InvalidArgument(f"{who}: the module has no trainable parameters")
        plain = [n for n, p in params.items() if not is_dtensor(p)]
        if plain:
            raise InvalidArgument(f"{who}: parameter {plain[0]!r} is not sharded; its gradient would never "
                                  "be reduced (shard the whole model)")
        mesh = next(iter(params.values())).device_mesh
        if mesh.ndim != 1:
            raise InvalidArgument(f"{who}: only a 1-D data-parallel mesh is supported")
        for n, p in params.items():
            if p.device_mesh != mesh or [type(pl).__name__ for pl in p.placements] != ["Shard"] \
                    or p.placements[0].dim != 0:
                raise InvalidArgument(f"{who}: parameter {n!r} has placements {p.placements}; "
                                      "expected Shard(0) on the data-parallel mesh (FSDP2's default)")
        refuse_unaware(chain, trust, who)
        self.chain = chain
        self.plan = plan_for(chain, SHARDED)  # a fused step on shards, if the registry has one
        self.model = model
        self.params = params
        self.memory = binder_options(memory, who)
        self.group = mesh.get_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.track_grad_norm = track_grad_norm
        self.units = fsdp_units(model, list(params))
        self._unit_of = {n: u for u, names in self.units.items() for n in names}
        with torch.no_grad():
            self.states = self._init_states()
        self.steps = 0  # completed optimizer steps (backward passes)
        self._finishing = False
        self._streamed = 0
        #: units stepped by the hooks (as their reduce-scatter finished) in the last backward;
        #: the others were stepped with zero gradients when backward ended
        self.last_streamed = 0
        self._sumsq: torch.Tensor | None = None
        self._last_sumsq: torch.Tensor | None = None
        # on_end is queued after FSDP2's root final callback (queued at the root's pre-backward),
        # so the root unit's reduce-scatter and hooks have run when finish() runs
        self._arrivals = Arrivals(self.units, on_complete=self._step_unit, on_start=self._begin, on_end=self.finish)
        self._handles = [p.register_post_accumulate_grad_hook(self._arrivals.hook_for(self._unit_of[n]))
                         for n, p in params.items()]

    # ``ShardedBoundOptimizer`` keeps one state; here it is one per unit.
    @property
    def state(self):
        return self.states

    @state.setter
    def state(self, value):
        self.states = value

    def _init_states(self) -> dict:
        """Every unit's chain state, ``chain.init`` of its local shards."""
        return {u: self.chain.init(self._unit_params(u), **self.hooks()) for u in self.units}

    # -- the hooks --------------------------------------------------------------------------
    def _begin(self) -> None:
        self._sumsq = None

    def _unit_params(self, unit: str) -> dict[str, torch.Tensor]:
        return {n: local(self.params[n]).detach() for n in self.units[unit]}

    @torch.no_grad()
    def _step_unit(self, unit: str) -> None:
        names = self.units[unit]
        params = self._unit_params(unit)
        grads = {n: (local(self.params[n].grad) if self.params[n].grad is not None else torch.zeros_like(params[n]))
                 for n in names}
        if self.track_grad_norm:
            s = sum(g.float().pow(2).sum() for g in grads.values())
            self._sumsq = s if self._sumsq is None else self._sumsq + s
        old = self.states[unit]
        out = None
        if self.plan is not None:  # a fused update-and-apply on shards (in place), if the registry has one
            out = self.plan.step(grads, old, params, ctx=self.hooks().get("ctx", NO_CONTEXT), donate=True,
                                 memory=self.memory)
        if out is None:
            updates, self.states[unit] = self.chain.update(grads, old, params, **self.hooks())
        else:
            new, self.states[unit] = out
        _record_stream(old)  # allocated on another stream (init, or finish), read on this one
        del grads
        for n in names:
            self.params[n].grad = None  # frees this unit's reduce-scatter output
        if out is None:
            new = self._apply(params, updates, self.states[unit])
        for n in names:
            if new[n] is not params[n]:
                params[n].copy_(new[n])
        self._arrivals.done.add(unit)
        if self._arrivals.active and not self._finishing:
            self._streamed += 1

    # -- the public surface -----------------------------------------------------------------
    def finish(self) -> None:
        """Step the units that this backward has not stepped (zeros for missing gradients),
        and all-reduce the step's Σ‖g‖².  Runs by itself at the end of every backward; a no-op
        otherwise.  Collective: every rank runs the same backwards."""
        if not self._arrivals.active:
            return
        self._finishing = True
        try:
            for u in self._arrivals.pending():
                self._step_unit(u)
        finally:
            self._finishing = False
        self.last_streamed, self._streamed = self._streamed, 0
        self._arrivals.reset()
        if self._sumsq is not None:
            self._last_sumsq = self.reduce_sum({"s": self._sumsq.reshape(1)})["s"][0]
        self.steps += 1

    def step(self, **extra) -> None:
        """For loops written for ``bind_sharded``: the update already ran inside backward."""
        released_step(self, extra)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are already None after a backward; clears any left by other code."""
        for p in self.params.values():
            p.grad = None

    def grad_norm(self) -> float | None:
        """‖g‖ of the last backward over all shards (None before the first, or untracked)."""
        return None if self._last_sumsq is None else float(self._last_sumsq.sqrt())

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def metrics(self, *, tensors: bool = False) -> StepMetrics:
        """lr (used by the last step), grad_norm (of the last backward), ``release_steps``;
        ``tensors=True``: lr and grad_norm as device tensors."""
        return release_metrics(self.states, self.steps, self._last_sumsq, tensors=tensors)

    # -- state for checkpoints (as ShardedBoundOptimizer's, keys prefixed by the unit) ------
    def dcp_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for path, x in pf.state_to_dict(self.states).items():
            out.update(self._entry(path, x, DTensor))
        return out

    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        prefix = RANK_KEY.format(rank=self.rank) + "."
        flat = {(k[len(prefix):] if k.startswith(prefix) else k): local(v).detach().clone() for k, v in loaded.items()}
        try:
            self.states = pf.state_from_dict(self.states, flat)
        except TreeMismatch as err:
            raise TreeMismatch(f"optimizer state in the checkpoint does not fit this chain (saved with "
                               f"gradient release per FSDP unit?): {err}") from None
