"""Gradient release: the bound chain runs inside backward, and each gradient is freed at once.

``GradientRelease(chain, model)`` is the memory-lean sibling of ``bind(chain, model)``
(docs/techniques/gradient_release.md).  It registers ``register_post_accumulate_grad_hook`` on every trainable
parameter.  Parameters are split into *groups* (by default one per decoder layer, one per
parameter outside the layers); the hook counts arrivals per group and, when the last
parameter of a group has its gradient, runs ``chain.update`` on that group's sub-tree,
writes the new values into the parameters and sets every ``p.grad`` of the group to None.
So at most one layer's gradients exist at a time, instead of the whole gradient set:

    release = GradientRelease(pf.adamw(3e-4), model)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()          # the parameters are updated during this call
        release.finish()         # optional: backward already did it (see below)

Why it is exact.  A parameter's post-accumulate hook fires after the autograd node that
produced its gradient has run, and that node has also produced the gradient of its input,
so the updated value is never read again by the same backward (a tied weight's hook fires
once, after both of its uses).  The chain's maths per tensor is the same as ``bind``'s, so
for any chain without a ``global`` transform the parameters after N steps equal the normal
path's bit for bit in fp32 (tests/unit/test_release.py).

State.  Each group has its own chain state (``chain.init(group_params)``), so each has its
own step ``count``; every group steps exactly once per backward, so the counts (and the
learning-rate schedules read from them) advance in lockstep, once per optimizer step.

End of backward.  The first hook of a backward queues a callback on the autograd engine that
runs when backward returns: it steps any group that received no gradient at all or only part
of its gradients (as ``bind`` does, with zeros in place of missing gradients), so that every
group's count still advances once.  ``finish()`` does the same by hand and is a no-op after
a normal backward.

Refused (``InvalidArgument``): a chain with a ``global`` transform (global-norm clipping,
ZClip, AdaGC's global phase), because the global norm is unknown while backward is still
running; ``accumulate(...)`` or ``grad_accum > 1``, because the step happens at every
backward.  Per-tensor and matrix transforms (per-tensor clipping, Muon per layer) are fine.

Precision.  ``memory.stochastic_rounding`` (``memory``: a ``pf.MemoryOptions``) rounds bf16
parameters stochastically in the update (no fp32 master copy), with noise seeded by the group
state's step count and the tensor's index (``pf.apply_updates``; the fused kernels seed alike),
never by torch's global generator.
``master_weights="fp32"`` instead keeps an fp32 copy of every low-precision parameter in the
optimizer (4 more bytes per parameter); the chain sees fp32
parameters and gradients, and the model's bf16 weights are the rounded masters.

Fused update.  Where the plan registry has a fused update-and-apply for the chain inside
backward (``pgs.func.plan.plan_for(chain, RELEASE)``: ``lion8bit``/``adamw8bit``'s own step,
called on the group's per-parameter tree; the AdamW/Lion kernels) and the device runs it, a group
steps with one kernel per tensor that writes parameter and state in place (stochastic
rounding inside the 8-bit kernels) — no update tensor, no fp32 temporaries.  The state is
the chain's own, so the fused and the plain path share checkpoints; ``fused=False`` forces
the plain path.

Deferred contributions.  ``before_step(param, fn)`` runs ``fn(param.grad)`` right before
``param``'s group steps in the coming backward: how the chunked loss's deferred head gradient
(``token_loss(..., memory=pf.MemoryOptions(defer_head_grad=True))``) joins a tied embedding's
own gradient, so that one V×D gradient buffer exists, and only at the end of backward (docs/memory.md).

Row slabs (``memory.tied_slabs = rows``, opt-in).  The input embedding's backward keeps its
looked-up rows' gradients instead of building a dense V×D gradient, and the weight is stepped slab by
slab over the vocabulary at the end of backward: each slab's gradient is the rows' sums that
fall in it plus each ``before_step`` contribution's ``add_rows_to`` (the deferred head
gradient rebuilt for those vocabulary rows only), then the chain's update on the slab alone.
Needs an elementwise chain (``slab_refusal``); equal to the dense path up to summation order.
The machinery is ``TiedSlabs`` in pgs/runtime/optim/tied_slabs.py.

Non-finite losses: the update happens inside backward, so a step cannot be skipped after
the fact; check the loss before calling ``backward``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any, Callable, Iterator, Mapping

import torch

import pgs.func as pf
from pgs.errors import CheckpointError, InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.func.base import GLOBAL, no_step_stage
from pgs.func.plan import RELEASE, plan_for
from pgs.func.schedule_free_iterates import eval_point, has_schedule_free, schedule_free_state
from pgs.func.step import StepContext
from pgs.runtime.optim.bound import trainable_parameters
from pgs.runtime.optim.interface import StepMetrics, binder_options
from pgs.runtime.optim.tied_slabs import TiedSlabs, slab_refusal  # noqa: F401  (slab_refusal: re-exported)

_LAYOUT_KEY = "__pgs_release_groups__"
_MASTER_PREFIX = "__master__."
_LAYER_RE = re.compile(r"^(.*?(?:^|\.)layers\.\d+)\.")
MASTER_DTYPES = ("fp32",)


def group_of(name: str) -> str:
    """The ``"layer"`` group of a parameter: ``"model.layers.3"`` for ``model.layers.3.mlp.up_proj.weight``,
    the name itself for parameters outside the decoder layers (embedding, final norm, head)."""
    m = _LAYER_RE.match(name)
    return m.group(1) if m else name


#: A decoder layer's parameters that belong to its MLP half (``groups="sublayer"``): the MLP or
#: mixture of experts and the norm that feeds it (Llama/Qwen ``post_attention_layernorm``,
#: Gemma's feed-forward norms); everything else in the layer is its attention half.
_MLP_HALF_RE = re.compile(r"(?:^|\.)(?:mlp|ffn|feed_forward|block_sparse_moe|experts|"
                          r"post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.")


def sublayer_group_of(name: str) -> str:
    """The ``"sublayer"`` group of a parameter: ``"model.layers.3/mlp"`` for the MLP half of a
    decoder layer (``_MLP_HALF_RE``), ``"model.layers.3/attn"`` for the rest of the layer, the
    name itself outside the decoder layers."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    rest = name[m.end():]
    return m.group(1) + ("/mlp" if _MLP_HALF_RE.search("." + rest) else "/attn")


#: with ``groups="parameter"``, parameters below this many elements step with the other small
#: parameters of their layer (norm weights, biases: their gradients are tiny, and a call each
#: would cost more host time than their update)
SMALL_PARAMETER = 65536


def group_parameters(names, groups: str | Callable[[str], str] = "layer",
                     sizes: dict | None = None) -> dict[str, list[str]]:
    """``{group: [parameter names]}`` in the parameters' order.

    ``groups``: ``"layer"`` (a decoder layer's parameters step together; the others alone),
    ``"sublayer"`` (a layer's MLP half and its attention half step apart, ``sublayer_group_of``:
    under ``"sublayer"`` activation checkpointing backward finishes the MLP half's gradients
    before it recomputes the attention half, so they are stepped and freed before that
    backward's peak, for two group steps per layer instead of one), ``"parameter"`` (every
    parameter alone; with ``sizes`` (name → numel), the ones under ``SMALL_PARAMETER`` elements
    together per layer, in a group ``"<layer>/small"``), or a function ``name -> group key``.
    """
    if groups == "layer":
        key = group_of
    elif groups == "sublayer":
        key = sublayer_group_of
    elif groups == "parameter":
        def key(n):
            if sizes is not None and sizes[n] < SMALL_PARAMETER:
                return group_of(n) + "/small"
            return n
    elif callable(groups):
        key = groups
    else:
        raise InvalidArgument(f"GradientRelease: groups={groups!r} is not \"layer\", \"sublayer\", \"parameter\" "
                              "or a function name -> group")
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(str(key(n)), []).append(n)
    return out


def refusal(chain: pf.Transform, grad_accum: int = 1) -> str | None:
    """Why ``chain`` cannot run inside backward (a sentence), or None when it can."""
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        return f"grad_accum={grad_accum!r} must be an int >= 1"
    if grad_accum > 1:
        return (f"gradient accumulation (grad_accum={grad_accum}) needs whole gradients summed over "
                "micro-batches, but gradient release steps at every backward; use grad_accum = 1 "
                "(a larger micro-batch) or bind(...) without gradient release")

    def walk(t: pf.Transform, where: str) -> str | None:
        if t.name == "accumulate":
            return (f"{where} is accumulate(...): gradient accumulation cannot run inside backward "
                    "(the step happens at every backward)")
        for i, c in enumerate(t.children):
            found = walk(c, f"{where}[{i}] ({c.name})" if t.name == "chain" else f"{where} > {c.name}")
            if found:
                return found
        if t.locality == GLOBAL:
            return (f"{where} is global (it reduces over every gradient, e.g. a global-norm clip), "
                    "and the global norm is unknown while backward is still running; use a "
                    "per-tensor rule (clip_by_norm_per_tensor) or bind(...) without gradient release")
        return None

    return walk(chain, f"the chain ({chain.name})" if chain.name != "chain" else "chain")


def check_released_chain(chain, grad_accum: int, who: str, unit: str) -> None:
    """Refuse, naming ``who``, what a release cannot run: a compiled chain (each ``unit``'s update
    runs on its own sub-tree), a non-transform, a chain ``refusal`` names, or one without a step."""
    if isinstance(chain, pf.FlatChain):
        raise InvalidArgument(f"{who}: pass the plain chain, not pf.compile(chain) "
                              f"(each {unit}'s update runs on its own sub-tree)")
    if not isinstance(chain, pf.Transform):
        raise InvalidArgument(f"{who}: expected a pgs.func.Transform, got {type(chain).__name__}")
    why = refusal(chain, grad_accum) or no_step_stage(chain)
    if why:
        raise InvalidArgument(f"{who}: {why}")


def released_step(release, extra: dict) -> None:
    """``step()`` of a release: nothing to add at call time (the chain ran inside backward); ``finish()``."""
    if extra:
        raise InvalidArgument(f"{type(release).__name__}.step: call-time extras {sorted(extra)} cannot reach "
                              "a chain that runs inside backward")
    release.finish()


def _foreach_norm_takes_dtype() -> bool:
    try:
        return any(a.name == "dtype" for a in torch.ops.aten._foreach_norm.Scalar._schema.arguments)
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch
        return False


#: torch._foreach_norm takes ``dtype=`` (torch >= 2.4; the signature is checked, not assumed)
_FOREACH_NORM_DTYPE = _foreach_norm_takes_dtype()


def grad_norms(grads: list) -> list:
    """‖g‖ (fp32) of each gradient in ``grads``: one multi-tensor ``torch._foreach_norm`` (a
    kernel or two for the whole list on a GPU, against a norm, a square and an add per tensor),
    fp32 accumulation inside the reduction, no fp32 copy of g.  Equal to
    ``torch.linalg.vector_norm(g, dtype=torch.float32)`` up to the reduction's summation order."""
    if _FOREACH_NORM_DTYPE:
        try:
            return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
        except (TypeError, RuntimeError, NotImplementedError):  # pragma: no cover - older torch
            pass
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]


def sum_of_squares(norms: list) -> torch.Tensor | None:
    """Σ‖g‖² over a backward's per-tensor norms (``grad_norms``), reduced once: a stack, a
    square and a sum (the per-group steps only keep the norms: no reduction kernels inside
    backward).  Equal to summing the squares one by one up to fp32 summation order."""
    if not norms:
        return None
    dev = norms[0].device
    return torch.stack([n if n.device == dev else n.to(dev) for n in norms]).square().sum()


def release_metrics(states: dict, steps: int, last_sumsq: torch.Tensor | None, *,
                    tensors: bool = False) -> StepMetrics:
    """What a release reports: the lr of the last step (declared by the first group's state —
    every group steps once per backward with the same schedule), ‖g‖ of the last backward, steps.

    ``tensors=True`` leaves lr and ‖g‖ as 0-d device tensors (no host read: the training loop
    copies them to the host asynchronously and reads them a step later)."""
    read = (lambda x: x.detach().reshape(())) if tensors else float
    lr = pf.reported_metrics(next(iter(states.values()))).get("lr")
    return StepMetrics(lr=None if lr is None else read(lr),
                       grad_norm=None if last_sumsq is None else read(last_sumsq.sqrt()), release_steps=steps)


class Arrivals:
    """Per-backward bookkeeping of gradient release: which groups have all their gradients.

    ``hook_for(group)`` makes a post-accumulate-grad hook.  The first hook of a backward
    calls ``on_start()`` and queues ``on_end`` on the autograd engine (it runs once the whole
    backward is over); when the last parameter of a group arrives, ``on_complete(group)``
    runs.  ``pending()`` lists the groups not stepped yet; ``reset()`` ends the backward.
    """

    def __init__(self, groups: dict[str, list[str]], *, on_complete: Callable[[str], None],
                 on_start: Callable[[], None], on_end: Callable[[], None]):
        self.sizes = {g: len(names) for g, names in groups.items()}
        self.on_complete, self.on_start, self.on_end = on_complete, on_start, on_end
        self.reset()

    def reset(self) -> None:
        self.arrived = dict.fromkeys(self.sizes, 0)
        self.done: set[str] = set()
        self.active = False  # inside a backward that has released something
        self.held = False  # gradients accumulate in .grad without counting (``GradientRelease.accumulating``)

    def touch(self) -> None:
        """A backward is under way (called from inside it): start it if not started yet."""
        if not self.active:
            self.active = True
            self.on_start()
            torch.autograd.Variable._execution_engine.queue_callback(self.on_end)

    def hook_for(self, group: str):
        def hook(p: torch.Tensor) -> None:
            if self.held:
                return
            self.touch()
            self.arrived[group] += 1
            if self.arrived[group] == self.sizes[group] and group not in self.done:
                self.on_complete(group)

        return hook

    def pending(self) -> list[str]:
        return [g for g in self.sizes if g not in self.done]


class GradientRelease:
    """A pure chain applied inside backward, group by group.  See the module docstring.

    Args:
        chain: any ``pgs.func.Transform`` without ``global`` parts.
        model: an ``nn.Module`` (its trainable parameters) or a dict ``name -> Parameter``.
        groups: ``"layer"`` (default), ``"sublayer"``, ``"parameter"``, or a function
            ``name -> group`` (``group_parameters``).
        memory: a ``pf.MemoryOptions`` (default: none of them): ``stochastic_rounding`` rounds bf16
            parameters stochastically in the update; ``tied_slabs`` (rows per slab, 0: off): the
            input embedding's weight (``model`` must be the ``nn.Module``) never gets a dense
            gradient; its backward keeps the looked-up rows' gradients, and at the end of backward
            the weight is stepped slab by slab over the vocabulary, each slab's gradient built from
            those rows and from the row-addressable contributions of ``before_step`` (a deferred
            head gradient).  Slabs need an elementwise chain (``slab_refusal``), the weight alone
            in its group, and 8-bit blocks that are whole slabs (``block_size`` divides rows·D).
            docs/memory.md.
        master_weights: None, or ``"fp32"`` to keep fp32 masters of low-precision parameters.
        grad_accum: must be 1 (refused otherwise, with the reason).
        track_grad_norm: keep ‖g‖ of every gradient as they stream by (one multi-tensor norm
            per group), for ``metrics``, which reduces Σ‖g‖² once when it reads it.
        apply_chunk: elements per slab when writing θ + u back (bounds the fp32 temporaries).
        fused: step a group with the fused update-and-apply that ``pgs.func.plan.plan_for``
            has for the chain (``lion8bit``, ``adamw8bit``, ``adamw``, ``lion``) where the device
            runs it; False always takes the plain path.
    """

    in_backward = True
    defers_contributions = True

    def __init__(
        self,
        chain: pf.Transform,
        model,
        *,
        groups: str | Callable[[str], str] = "layer",
        memory: pf.MemoryOptions = pf.NO_MEMORY_OPTIONS,
        master_weights: str | None = None,
        grad_accum: int = 1,
        track_grad_norm: bool = True,
        apply_chunk: int = 1 << 24,
        fused: bool = True,
    ):
        check_released_chain(chain, grad_accum, "GradientRelease", "group")
        if master_weights not in (None, *MASTER_DTYPES):
            raise InvalidArgument(f"GradientRelease: master_weights={master_weights!r} is not None or \"fp32\"")
        params = trainable_parameters(model, "GradientRelease")
        for n, p in params.items():
            if not p.is_leaf:
                raise InvalidArgument(f"GradientRelease: parameter {n!r} is not a leaf tensor")
        self.chain = chain
        self.params = params
        self.memory = binder_options(memory, "GradientRelease", slabs=True)
        self.master_weights = master_weights
        self.track_grad_norm = track_grad_norm
        if not isinstance(apply_chunk, int) or apply_chunk < 1:
            raise InvalidArgument(f"GradientRelease: apply_chunk={apply_chunk!r} must be an int >= 1")
        self.apply_chunk = apply_chunk
        self.groups = group_parameters(list(params), groups, sizes={n: p.numel() for n, p in params.items()})
        self._group_of = {n: g for g, names in self.groups.items() for n in names}
        self.masters: dict[str, torch.Tensor] = {}
        if master_weights == "fp32":
            with torch.no_grad():
                self.masters = {n: p.detach().float().clone() for n, p in params.items()
                                if p.dtype in (torch.bfloat16, torch.float16)}
        self._trees: dict[str, tuple] = {}  # group -> (params tree, live params, targets): _group_tensors
        self.states = self._init_states()
        # the fused path: the plan registry's step for this chain inside backward, if any
        plan = plan_for(chain, RELEASE) if fused else None
        self._fused_step = None if plan is None else plan.step
        # tensors before each group: distinct stochastic-rounding seeds for every tensor of a step
        self._sr_offset, self._sr_index, at = {}, {}, 0
        for g, names in self.groups.items():
            self._sr_offset[g] = at
            self._sr_index.update((n, at + j) for j, n in enumerate(names))
            at += len(names)
        self._n_tensors = at  # slab s of a slabbed weight rounds with stream at + s
        self.fused_group_steps = 0  # group steps that ran the fused path (for benchmarks and tests)
        self.plain_group_steps = 0
        self._name_of = {id(p): n for n, p in params.items()}
        self._before: dict[str, list[Callable[[torch.Tensor], Any]]] = {}
        self.steps = 0  # completed optimizer steps (backward passes)
        self._norms: list[torch.Tensor] = []  # ‖g‖ of each gradient of this backward (track_grad_norm)
        self._last_norms: list[torch.Tensor] = []
        self._last_sumsq_memo: torch.Tensor | None = None
        self._arrivals = Arrivals(self.groups, on_complete=self._timed_step_group, on_start=self._begin,
                                  on_end=self.finish)
        self._host_s = 0.0  # host seconds inside this backward's group steps
        #: what the last backward reports beside the chain's metrics (the step record logs it):
        #: ``release/host_ms``, the host's time inside its group steps (Python, the chain's launches)
        self.step_extras: dict[str, float] = {}
        self._slab_name: str | None = None
        self._row_grads = None
        self._slabs: TiedSlabs | None = None
        if self.memory.tied_slabs:  # the tied weight in row slabs: pgs/runtime/optim/tied_slabs.py
            self._slabs = TiedSlabs(self, model, self.memory.tied_slabs)
            self._slab_name, self._row_grads = self._slabs.name, self._slabs.row_grads
        self._handles = [p.register_post_accumulate_grad_hook(self._arrivals.hook_for(self._group_of[n]))
                         for n, p in params.items()]

    def _init_states(self) -> dict:
        """Every group's chain state, ``chain.init`` of its parameters (or their masters)."""
        return {g: self.chain.init(self._group_tensors(g)[0]) for g in self.groups}

    # -- the hooks --------------------------------------------------------------------------
    def _begin(self) -> None:
        self._norms = []

    @property
    def _last_sumsq(self) -> torch.Tensor | None:
        """Σ‖g‖² of the last backward (None when not tracked), reduced on first read."""
        if self._last_sumsq_memo is None and self._last_norms:
            self._last_sumsq_memo = sum_of_squares(self._last_norms)
        return self._last_sumsq_memo

    def _group_tensors(self, group: str) -> tuple[dict, list, list]:
        """``(params tree, live parameters, what the chain updates)`` of ``group``, built once:
        the tree's detached aliases are reused every step (a detach per parameter per step is
        a dispatcher call each), and rebuilt if a parameter's (or master's) storage moved."""
        cached = self._trees.get(group)
        if cached is not None:
            tree, lives, targets = cached
            if all(a.data_ptr() == t.data_ptr() for a, t in zip(tree.values(), targets)):
                return cached
        names = self.groups[group]
        lives = [self.params[n] for n in names]
        targets = [self.masters.get(n, p) for n, p in zip(names, lives)]
        cached = self._trees[group] = ({n: t.detach() for n, t in zip(names, targets)}, lives, targets)
        return cached

    def _timed_step_group(self, group: str) -> None:
        """``_step_group``, its host time counted (``step_extras``: no device sync, so where the
        launch queue is full it includes the wait for room in it)."""
        t = time.perf_counter()
        try:
            self._step_group(group)
        finally:
            self._host_s += time.perf_counter() - t

    @torch.no_grad()
    def _step_group(self, group: str) -> None:
        names = self.groups[group]
        if self._slab_name is not None and names == [self._slab_name]:
            self._slabs.step(self, group)
            self._arrivals.done.add(group)
            return
        if self._before:
            for n in names:  # contributions added into the gradient buffer right before the step
                fns = self._before.pop(n, None)
                if fns:
                    p = self.params[n]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    for fn in fns:
                        fn(p.grad)
        params, lives, targets = self._group_tensors(group)
        grads = {}
        for n, p, t in zip(names, lives, targets):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            grads[n] = g.to(t.dtype) if g.dtype != t.dtype else g
        if self.track_grad_norm:  # the norms only; Σ‖g‖² is reduced once, when read (_last_sumsq)
            self._norms.extend(grad_norms(list(grads.values())))
        if self._step_fused(group, params, grads):
            del grads
            for n, p in zip(names, lives):
                p.grad = None
                if n in self.masters:
                    p.copy_(self.masters[n])
            self.fused_group_steps += 1
        else:
            updates, self.states[group] = self.chain.update(grads, self.states[group], params)
            del grads
            for n, p in zip(names, lives):
                p.grad = None
                self._apply(n, params[n], updates[n], self.rounding(n, self.states[group]))
            self.plain_group_steps += 1
        self._arrivals.done.add(group)

    def _step_fused(self, group: str, params: dict, grads: dict) -> bool:
        """Update-and-apply in one kernel per tensor, in place (parameters, or their fp32 masters,
        and the chain state); False when the chain has no fused step here (then nothing ran)."""
        new_state = self._fused_call(self.states[group], params, grads, self._sr_offset[group])
        if new_state is None:
            return False
        self.states[group] = new_state
        return True

    def _fused_call(self, state, params: dict, grads: dict, sr_offset: int):
        """The fused update-and-apply of ``params`` (in place) from ``state``; the new state, or
        None when the chain has no fused step here (then nothing ran)."""
        if self._fused_step is None:
            return None
        if not all(t.is_contiguous() for t in (*params.values(), *grads.values())):
            return None
        out = self._fused_step(grads, state, params, ctx=StepContext(sr_offset=sr_offset), donate=True,
                               memory=self.memory)
        return None if out is None else out[1]

    # -- what TiedSlabs (tied_slabs.py) steps a slabbed weight with ----------------------------
    def name_of(self, param: torch.Tensor) -> str | None:
        """The name of a released parameter (None for another tensor)."""
        return self._name_of.get(id(param))

    def group_of(self, name: str) -> str:
        """The release group a parameter steps in."""
        return self._group_of[name]

    def backward_started(self) -> None:
        """Count this backward as started (a gradient arrived outside the parameters' hooks)."""
        self._arrivals.touch()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Inside a backward: the backwards run within accumulate their gradients in ``.grad``
        without stepping; on leaving, every group steps once, with the gradients accumulated, at
        the end of the enclosing backward (its engine callback, as ``finish``).  SeCO's reverse
        sweep (``pgs.runtime.model.seco``) runs one backward per chunk of a row inside the row's
        backward: a parameter's gradient is complete only after the last chunk's, so no group
        may step before (docs/techniques/seco.md)."""
        if self._slab_name is not None or self._before:
            raise InvalidArgument("gradient release: tied slabs and deferred head gradients do not compose with "
                                  "accumulating across backwards")
        self._arrivals.held = True
        try:
            yield
        finally:
            self._arrivals.held = False
        self._arrivals.touch()

    def take_contributions(self, name: str) -> list:
        """The ``before_step`` contributions pending for ``name`` (removed from the release)."""
        return self._before.pop(name, [])

    def record_norm(self, grad: torch.Tensor) -> None:
        """Count ``grad`` in this backward's ‖g‖ (``track_grad_norm``)."""
        if self.track_grad_norm:  # Σ‖g‖² is reduced once, when read (_last_sumsq)
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def state_ready(self, group: str, part) -> None:
        """Called before a step reads ``part`` of ``group``'s chain state (a slab's views): the
        state is where it is read, so nothing to do here (the offloaded release orders the read
        after the copy that brings that part to the device)."""

    def fused_slab_update(self, state, params: dict, grads: dict, slab: int):
        """The fused update-and-apply of slab ``slab`` of a slabbed weight (its own stochastic
        rounding stream), or None where the chain has no fused step (then nothing ran)."""
        return self._fused_call(state, params, grads, self._n_tensors + slab)

    def rounding(self, name: str, state) -> dict:
        """``pf.apply_updates``'s rounding arguments for parameter ``name`` after a plain step to
        ``state`` (its group's new chain state): with stochastic rounding, the noise stream of the
        state's step count and the parameter's index among all released tensors (the index its
        fused step would seed from), so the plain path never reads torch's global generator."""
        if not self.memory.stochastic_rounding:
            return {}
        return {"memory": self.memory, "state": state, "first": self._sr_index[name]}

    def _apply(self, name: str, param: torch.Tensor, update: torch.Tensor, rounding: dict) -> None:
        """θ ← θ + u (``pf.apply_updates`` with ``rounding``), slab by slab, so that the fp32
        temporaries of a large tensor (the embedding: V·D) stay ``apply_chunk`` elements;
        elementwise, and slab s draws elements [lo, lo + apply_chunk) of the tensor's noise stream
        (``start``), so the result equals one whole-tensor call bit for bit."""
        target = self.masters.get(name)
        live = self.params[name]
        if not (live.is_contiguous() and (target is None or target.is_contiguous())):
            new = pf.apply_updates(param, update, **rounding)
            if target is not None:
                target.copy_(new)
            live.copy_(new)
            return
        flat_p, flat_u = param.reshape(-1), update.reshape(-1)
        step = self.apply_chunk
        for lo in range(0, flat_p.numel(), step):
            piece = pf.apply_updates({"p": flat_p[lo:lo + step]}, {"p": flat_u[lo:lo + step]}, start=lo,
                                     **rounding)["p"]
            if target is not None:
                target.view(-1)[lo:lo + step].copy_(piece)
            live.view(-1)[lo:lo + step].copy_(piece)

    # -- the public surface -----------------------------------------------------------------
    def before_step(self, param: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> None:
        """In the coming backward, call ``fn(param.grad)`` right before ``param``'s group steps
        (``fn`` adds into the gradient buffer in place; a zero buffer is made when ``param`` got
        no gradient).  How a tied head's deferred gradient (``token_loss(...,
        memory=pf.MemoryOptions(defer_head_grad=True))``) joins the embedding's own gradient, so that one V×D gradient
        buffer exists, and only at the end of backward.  Dropped by ``zero_grad()``."""
        name = self._name_of.get(id(param))
        if name is None:
            raise InvalidArgument("GradientRelease.before_step: not one of the released parameters")
        if name == self._slab_name:
            if not callable(getattr(fn, "add_rows_to", None)):
                raise InvalidArgument(f"GradientRelease.before_step: {name!r} is stepped in row slabs "
                                      "(memory.tied_slabs), so a contribution must add rows: pass an object with "
                                      "add_rows_to(out, r0, r1) (e.g. result.head_grad), not a whole-tensor function")
        elif not callable(fn) and callable(getattr(fn, "add_to", None)):
            fn = fn.add_to  # a DeferredHeadGrad itself
        self._before.setdefault(name, []).append(fn)

    def finish(self) -> None:
        """Step the groups that this backward has not stepped (zeros for missing gradients).

        Runs by itself at the end of every backward; calling it again is a no-op.
        """
        if not self._arrivals.active:
            return
        for g in self._arrivals.pending():
            self._timed_step_group(g)
        self._arrivals.reset()
        self.step_extras = {"release/host_ms": self._host_s * 1e3}
        self._host_s = 0.0
        self._last_norms, self._last_sumsq_memo = self._norms, None
        self._norms = []
        self.steps += 1

    def step(self, **extra) -> None:
        """For loops written for ``bind``: the update already ran inside backward (``finish``)."""
        released_step(self, extra)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are already None after a backward; clears any left by other code."""
        for p in self.params.values():
            p.grad = None
        self._before.clear()
        if self._row_grads is not None:
            self._row_grads.clear()

    def remove(self) -> None:
        """Unregister the hooks (the parameters then train only through another optimizer)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._slabs is not None:
            self._slabs.remove()

    # -- where the model is evaluated ---------------------------------------------------------
    @property
    def evaluates_elsewhere(self) -> bool:
        """Whether the chain's evaluation point is not the weights it steps (schedule-free)."""
        return any(has_schedule_free(s) for s in self.states.values())

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        """As ``BoundOptimizer.eval_weights``: inside, each parameter holds x, from the weights
        the release steps (its fp32 master where it keeps one) and its group's z, one parameter
        at a time; after, the parameters as they were, bit for bit (kept on the CPU meanwhile)."""
        if not self.evaluates_elsewhere:
            yield
            return
        kept: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for group, names in self.groups.items():
                sf = schedule_free_state(self.states[group])
                for n in names:
                    p = self.params[n].detach()
                    kept[n] = p.to("cpu", copy=True)
                    p.copy_(eval_point(self.masters.get(n, p), sf.z[n], sf.b1))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, saved in kept.items():
                    self.params[n].detach().copy_(saved)

    # -- state ------------------------------------------------------------------------------
    def _fingerprint(self) -> torch.Tensor:
        desc = {"groups": self.groups, "masters": sorted(self.masters)}
        return torch.frombuffer(bytearray(json.dumps(desc, sort_keys=True).encode()), dtype=torch.uint8).clone()

    def state_dict(self, device: str | torch.device | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
        """Every group's chain state as ``{group.path: tensor}`` (safetensors-ready), the fp32
        masters under ``__master__.{name}``, and a fingerprint of the grouping.  ``device``:
        copy each tensor straight there (``"cpu"`` for a checkpoint: no device memory added);
        ``copy=False``: the live tensors themselves (``pf.state_to_dict``), for a streaming write."""
        d = pf.state_to_dict(self.states, device, copy)
        for n, m in self.masters.items():
            if not copy:
                d[_MASTER_PREFIX + n] = m.detach() if device is None else m.detach().to(device)
            else:
                d[_MASTER_PREFIX + n] = (m.detach().contiguous().clone() if device is None
                                         else m.detach().to(device, copy=True).contiguous())
        d[_LAYOUT_KEY] = self._fingerprint()
        return d

    @torch.no_grad()
    def load_state_dict(self, d: Mapping[str, torch.Tensor]) -> None:
        """Restore ``state_dict``'s output; refuses another grouping or parameter set.

        Each entry is copied into the groups' own state tensors and the masters, one at a time
        (``d`` may be a lazily read file): no second copy of the state on the device."""
        fp = d.get(_LAYOUT_KEY)
        if fp is None or not torch.equal(fp.to(torch.uint8), self._fingerprint()):
            raise TreeMismatch("optimizer state was saved for different trainable parameters, groups or "
                               "master weights (freeze policy, model, or gradient-release settings changed)")
        self._load_states(d, lambda k: k == _LAYOUT_KEY or k.startswith(_MASTER_PREFIX))
        # the masters' keys are their tree paths under the prefix: checked as the state's entries are
        for m, saved in pf.state_entries({_MASTER_PREFIX[:-1]: self.masters}, d, ignore=lambda k: True):
            m.copy_(saved)
        for n, m in self.masters.items():
            self.params[n].copy_(m)

    def _load_states(self, d: Mapping[str, torch.Tensor], ignore) -> None:
        for leaf, entry in pf.state_entries(self.states, d, ignore=ignore):
            leaf.copy_(entry)

    def counts(self) -> set[int]:
        """The distinct step counts found in the groups' states (one value when in lockstep)."""
        out = set()
        for state in self.states.values():
            for path, x in T.leaves_with_paths(state):
                if path.rsplit(".", 1)[-1] in ("count", "mini_step") and isinstance(x, torch.Tensor):
                    out.add(int(x))
        return out

    def metrics(self, *, tensors: bool = False) -> StepMetrics:
        """lr (used by the last step), grad_norm (‖g‖ over all gradients of the last backward,
        if tracked), and ``release_steps``; ``tensors=True``: lr and grad_norm as device tensors."""
        return release_metrics(self.states, self.steps, self._last_sumsq, tensors=tensors)

    def grad_norm(self) -> float | None:
        """‖g‖ of the last backward (None before the first, or untracked)."""
        return None if self._last_sumsq is None else float(self._last_sumsq.sqrt())

    def dcp_state(self) -> dict[str, torch.Tensor]:
        raise CheckpointError("gradient release on one process writes single-process checkpoints, not DCP")

    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        raise CheckpointError("a sharded (DCP) checkpoint cannot be loaded into gradient release on one process; "
                              "resume it with as many processes as wrote it, or without gradient_release")

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state (chain states plus fp32 masters)."""
        return pf.state_bytes(self.states) + sum(m.numel() * m.element_size() for m in self.masters.values())
