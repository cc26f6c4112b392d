"""Binding a pure chain to FSDP2-sharded parameters: ``bind_sharded(chain, model)``.

Under ``fully_shard`` every parameter is a DTensor whose rank-local part (``p.to_local()``)
holds some rows of the tensor.  The chain runs on those local shards, as if they were the
parameters:

- elementwise stages (Adam, Lion, weight decay, learning rate) need nothing else: each
  element's update depends only on itself, so running them on shards is exact;
- per-tensor and global reductions (norms for clipping, Hyperball, AdaGC) see partial sums.
  The binding hands the chain ``ctx.reduce_sum`` (``pgs.func.step.StepContext``), a function that sums a pytree of
  tensors over the ranks in ONE all-reduce; ``pgs.func.layout.per_tensor_sumsq`` /
  ``per_tensor_dot`` and ``pgs.func.clip.global_norm`` apply it when a transform forwards it
  (``layout.reduced`` documents the contract);
- transforms that need whole matrices (Muon's Newton–Schulz) get
  ``ctx.whole_tensors(op, paths, tensors)``: each listed shard-local tensor is gathered
  to an owner rank (round-robin over the list), ``op`` maps the owner's list of full tensors
  to full tensors of the same shapes (each independently), and the results are scattered
  back to shards, cast to each input's dtype.  On one process a transform calls ``op``
  directly.

Which transforms may run sharded is checked when binding: every leaf transform whose
``locality`` is not elementwise must declare that it forwards these hooks (``shard_aware``) or
be named in ``trust=``; otherwise binding refuses (a shard-local norm is a silent bug).

State leaves keep the shard-local shapes.  ``dcp_state()`` hands ``pgs.runtime.store.dcp``
the state with every leaf that mirrors a parameter wrapped as a DTensor of that parameter's
placement (so DCP can reshard it), scalars as replicated tensors, and any other leaf (for
example block-wise 8-bit codes of a shard) under a per-rank key.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import pgs.func as pf
from pgs.errors import CheckpointError, InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.func.base import ELEMENTWISE, no_step_stage
from pgs.func.plan import SHARDED, plan_for
from pgs.func.step import NO_CONTEXT, StepContext
from pgs.runtime.dist.fsdp import reshard
from pgs.runtime.optim.interface import StepMetrics, binder_options, step_metrics

#: Prefix of per-rank state keys in a checkpoint.
RANK_KEY = "__rank{rank}__"


def is_dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def local(x: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor (a view of its storage), or ``x`` itself."""
    return x.to_local() if is_dtensor(x) else x


def unaware_transforms(chain: pf.Transform, trust: Sequence[str] = ()) -> list[str]:
    """Names of the leaf transforms of ``chain`` that cannot run on shards."""
    bad: list[str] = []

    def walk(t):
        if t.children:
            for c in t.children:
                walk(c)
        elif t.locality != ELEMENTWISE and not t.shard_aware and t.name not in trust:
            bad.append(f"{t.name} ({t.locality})")

    walk(chain)
    return bad


def refuse_unaware(chain: pf.Transform, trust: Sequence[str], who: str) -> None:
    """``InvalidArgument`` naming the first transform of ``chain`` that would see partial norms on shards."""
    bad = unaware_transforms(chain, trust)
    if bad:
        raise InvalidArgument(
            f"{who}: transform {bad[0]} reduces over whole tensors but does not declare "
            "sharded reductions; on shards it would see partial norms. Make it forward "
            "ctx.reduce_sum (or ctx.whole_tensors) and list it in trust= "
            "(docs/distributed.md)")


class ShardedBoundOptimizer:
    """A pure chain bound to the local shards of FSDP2 parameters (a
    ``pgs.runtime.optim.Optimizer``).  See the module docstring.

    Args:
        chain: the pure transform.
        model: a module after ``pgs.runtime.dist.fsdp.shard_model`` (its trainable
            parameters are DTensors); on one process a plain module also works.
        trust: names of non-elementwise leaf transforms to run although they do not declare
            ``shard_aware`` (you have checked that they forward the hooks).
        memory: a ``pf.MemoryOptions``: ``stochastic_rounding`` as ``pf.apply_updates``
            (``tied_slabs`` is refused: FSDP2 reduce-scatters the embedding's whole gradient).
    """

    in_backward = False
    defers_contributions = False

    def __init__(self, chain: pf.Transform, model: torch.nn.Module, *, trust: Sequence[str] = (),
                 memory: pf.MemoryOptions = pf.NO_MEMORY_OPTIONS):
        if not isinstance(chain, pf.Transform):
            raise InvalidArgument(f"bind_sharded: expected a pgs.func.Transform, got {type(chain).__name__}")
        why = no_step_stage(chain)
        if why:
            raise InvalidArgument(f"bind_sharded: {why}")
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not params:
            raise InvalidArgument("bind_sharded: the module has no trainable parameters")
        self.group = None
        sharded = [n for n, p in params.items() if is_dtensor(p)]
        if sharded:
            plain = [n for n in params if n not in set(sharded)]
            if plain:
                raise InvalidArgument(f"bind_sharded: parameter {plain[0]!r} is not sharded while others are; "
                                      "its gradient would never be reduced (shard the whole model)")
            mesh = params[sharded[0]].device_mesh
            if mesh.ndim != 1:
                raise InvalidArgument("bind_sharded: only a 1-D data-parallel mesh is supported")
            self.group = mesh.get_group()
            for n, p in params.items():
                if p.device_mesh != mesh or [type(pl).__name__ for pl in p.placements] != ["Shard"] \
                        or p.placements[0].dim != 0:
                    raise InvalidArgument(f"bind_sharded: parameter {n!r} has placements {p.placements}; "
                                          "expected Shard(0) on the data-parallel mesh (FSDP2's default)")
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise InvalidArgument("bind_sharded: several processes but no parameter is sharded; "
                                  "call pgs.runtime.dist.fsdp.shard_model(model) first")
        if self.group is not None:
            refuse_unaware(chain, trust, "bind_sharded")
        self.chain = chain
        self.plan = plan_for(chain, SHARDED)  # a fused step on shards, if the registry has one
        self.model = model
        self.params = params
        self.memory = binder_options(memory, "bind_sharded")
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        with torch.no_grad():
            self.state = chain.init(self._local_params(), **self.hooks())

    # -- the hooks the pure side calls --------------------------------------------------
    def hooks(self) -> dict[str, StepContext]:
        """The keyword arguments of ``chain.init`` / ``chain.update``: the step context with the
        sharding hooks (empty on one process)."""
        if self.group is None:
            return {}
        return {"ctx": StepContext(reduce_sum=self.reduce_sum, whole_tensors=self.whole_tensors)}

    def reduce_sum(self, tree):
        """Every tensor leaf of ``tree`` summed over the ranks: one all-reduce per dtype."""
        leaves, spec = T.flatten(tree)
        out = list(leaves)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                by_dtype.setdefault(x.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            flat = torch.cat([leaves[i].reshape(-1) for i in idx])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            off = 0
            for i in idx:
                n = leaves[i].numel()
                out[i] = flat[off:off + n].view(leaves[i].shape)
                off += n
        return T.unflatten(out, spec)

    def whole_tensors(self, op: Callable[[list[torch.Tensor]], list[torch.Tensor]], paths: Sequence[str],
                      tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``op`` on the full tensors of ``paths``, each computed on one owner rank, re-sharded.

        ``tensors[i]`` is shaped like the local shard of parameter ``paths[i]``.  Owner of
        item ``i`` is rank ``i % world``; the collectives run in list order on every rank.
        """
        if len(paths) != len(tensors):
            raise InvalidArgument("whole_tensors: paths and tensors differ in length")
        fulls: list[torch.Tensor | None] = []
        for i, (path, x) in enumerate(zip(paths, tensors)):
            fulls.append(self._gather(path, x, owner=i % self.world))
        mine = [i for i in range(len(paths)) if i % self.world == self.rank]
        results = op([fulls[i] for i in mine]) if mine else []
        if len(results) != len(mine):
            raise InvalidArgument(f"whole_tensors: op returned {len(results)} tensors for {len(mine)}")
        full_out: dict[int, torch.Tensor] = {}
        for i, r in zip(mine, results):
            if r.shape != fulls[i].shape:
                raise InvalidArgument(f"whole_tensors: op changed the shape of {paths[i]!r} "
                                      f"from {tuple(fulls[i].shape)} to {tuple(r.shape)}")
            full_out[i] = r.to(tensors[i].dtype)
        return [self._scatter(path, x, full_out.get(i), owner=i % self.world)
                for i, (path, x) in enumerate(zip(paths, tensors))]

    def _rows(self, path: str) -> tuple[int, int]:
        """(rows of the full tensor, rows per rank before padding): torch.chunk's split."""
        p = self.params.get(path)
        if p is None:
            raise InvalidArgument(f"whole_tensors: {path!r} is not a trainable parameter of the bound model")
        rows = p.shape[0]
        return rows, math.ceil(rows / self.world)

    def _gather(self, path: str, x: torch.Tensor, owner: int) -> torch.Tensor | None:
        rows, chunk = self._rows(path)
        padded = x.new_zeros((chunk, *x.shape[1:]))
        padded[: x.shape[0]] = x
        if self.rank == owner:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.gather(padded, parts, dst=dist.get_global_rank(self.group, owner), group=self.group)
            return torch.cat(parts)[:rows]
        dist.gather(padded, None, dst=dist.get_global_rank(self.group, owner), group=self.group)
        return None

    def _scatter(self, path: str, x: torch.Tensor, full: torch.Tensor | None, owner: int) -> torch.Tensor:
        rows, chunk = self._rows(path)
        recv = x.new_empty((chunk, *x.shape[1:]))
        parts = None
        if self.rank == owner:
            padded = full.new_zeros((chunk * self.world, *full.shape[1:]))
            padded[:rows] = full
            parts = list(padded.contiguous().split(chunk))
        dist.scatter(recv, parts, src=dist.get_global_rank(self.group, owner), group=self.group)
        return recv[: x.shape[0]].clone()

    # -- parameters and gradients -------------------------------------------------------
    def _local_params(self):
        return {n: local(p).detach() for n, p in self.params.items()}

    def _local_grads(self):
        return {n: (local(p.grad) if p.grad is not None else torch.zeros_like(local(p)))
                for n, p in self.params.items()}

    @torch.no_grad()
    def step(self, **extra) -> None:
        """Apply the chain to the current gradients (shard by shard) and update in place."""
        if self.group is not None:
            reshard(self.model)  # an eval forward may have left the root gathered
        params = self._local_params()
        if self.plan is not None:
            out = self.plan.step(self._local_grads(), self.state, params, ctx=self.hooks().get("ctx", NO_CONTEXT),
                                 donate=True, memory=self.memory, extra=extra)
            if out is not None:
                new, self.state = out
                for n, p in self.params.items():
                    if new[n] is not params[n]:
                        local(p).copy_(new[n])
                return
        updates, self.state = self.chain.update(self._local_grads(), self.state, params, **self.hooks(), **extra)
        new = self._apply(params, updates, self.state)
        for n, p in self.params.items():
            local(p).copy_(new[n])

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        """Each parameter's place in the model's order: its stream of rounding noise."""
        return {n: i for i, n in enumerate(self.params)}

    def _apply(self, params: dict, updates: dict, state) -> dict:
        """θ ← θ + u on the local shards (``pf.apply_updates``).  With stochastic rounding a shard
        draws its part of the whole tensor's noise stream: the seed of the chain state's step
        count and the parameter's index, from the shard's first element on (FSDP2's Shard(0):
        rank r holds rows from r·⌈rows/world⌉), so the ranks draw what one process would."""
        if not self.memory.stochastic_rounding:
            return pf.apply_updates(params, updates)
        new = {}
        for n, p in params.items():
            start = 0
            if self.group is not None:
                rows, chunk = self._rows(n)
                start = min(self.rank * chunk, rows) * (self.params[n].numel() // max(rows, 1))
            new[n] = pf.apply_updates(p, updates[n], memory=self.memory, state=state, first=self._index[n],
                                      start=start)
        return new

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The global norm of the current gradients over all shards (fp32)."""
        return float(pf.global_norm(self._local_grads(), None, self.reduce_sum if self.group is not None else None))

    def eval_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights as they are: several processes evaluate where they step (a schedule-free
        chain, whose x differs, is refused there by ``make_optimizer``)."""
        return contextlib.nullcontext()

    def metrics(self, *, tensors: bool = False) -> StepMetrics:
        """As ``BoundOptimizer.metrics`` (0-d state leaves are the same on every rank)."""
        return step_metrics(self.state, self.chain, tensors=tensors)

    def before_step(self, param: torch.Tensor, contribution) -> None:
        raise InvalidArgument(f"{type(self).__name__}.before_step: a contribution to a sharded gradient is not "
                              "supported (memory.defer_head_grad needs one process)")

    def state_dict(self, device=None, copy: bool = True) -> dict[str, torch.Tensor]:
        raise CheckpointError(f"{type(self).__name__}: sharded optimizer state is saved with DCP "
                              "(pgs.runtime.store.dcp, dcp_state)")

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        raise CheckpointError(f"{type(self).__name__}: sharded optimizer state is loaded with DCP "
                              "(pgs.runtime.store.dcp, load_dcp_state)")

    def state_bytes(self) -> int:
        """Bytes of this rank's chain state."""
        return int(pf.state_bytes(self.state))

    # -- state for checkpoints ----------------------------------------------------------
    def _mirror(self, path: str, x: torch.Tensor) -> str | None:
        """The parameter whose shard ``x`` mirrors (the longest name that ends ``path``), or None."""
        parts = path.split(".")
        for i in range(len(parts)):
            name = ".".join(parts[i:])
            p = self.params.get(name)
            if p is not None:
                return name if x.shape == local(p).shape else None
        return None

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """The state for DCP: DTensors for leaves that mirror a parameter, replicated
        tensors for scalars, per-rank keys for anything else.  Values share storage with
        the live state (DCP loads in place)."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for path, x in pf.state_to_dict(self.state).items():
            out.update(self._entry(path, x, DTensor))
        return out

    def _entry(self, path: str, x: torch.Tensor, DTensor) -> dict[str, torch.Tensor]:
        if self.group is None or x.ndim == 0:
            return {path: x}
        name = self._mirror(path, x)
        if name is not None:
            p = self.params[name]
            return {path: DTensor.from_local(x, p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())}
        return {f"{RANK_KEY.format(rank=self.rank)}.{path}": x}

    def per_rank_keys(self) -> list[str]:
        """State paths saved per rank (cannot be resharded to another world size)."""
        return [k for k in self.dcp_state() if k.startswith(RANK_KEY.format(rank=self.rank))]

    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        """Restore the state from what ``dcp_state()`` returned after a DCP load."""
        prefix = RANK_KEY.format(rank=self.rank) + "."
        flat = {}
        for k, v in loaded.items():
            k = k[len(prefix):] if k.startswith(prefix) else k
            flat[k] = local(v).detach().clone()
        try:
            self.state = pf.state_from_dict(self.state, flat)
        except TreeMismatch as err:
            raise TreeMismatch(f"optimizer state in the checkpoint does not fit this chain: {err}") from None


def bind_sharded(chain: pf.Transform, model: torch.nn.Module, **kwargs) -> ShardedBoundOptimizer:
    """Bind ``chain`` to the (FSDP2-sharded) trainable parameters of ``model``."""
    return ShardedBoundOptimizer(chain, model, **kwargs)
