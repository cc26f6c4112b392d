"""``[optimizer]``, ``[schedule]`` and ``[memory]``: the optimizer binder's typed configs
(``pgs.runtime.optim.make_optimizer``, ``pgs.runtime.spec.chain``) and the memory options it binds with."""

from __future__ import annotations

from typing import ClassVar

import attrs

import pgs.func as pf
from pgs.errors import PgsError, SpecError
from pgs.func.memory_options import MemoryOptions
from pgs.runtime.spec.fields import (boolean, expect, int_at_least, is_int, number_in, one_of, string, table,
                                     to_float)

SCHEDULES = ("constant", "linear_warmup", "cosine", "wsd", "power_decay")
WSD_SHAPES = ("linear", "cosine", "1-sqrt", "power", "exponential")
CHECKPOINT_POLICIES = ("none", "full", "selective", "sublayer")
MASTER_WEIGHTS = ("none", "fp32")
RELEASE_GROUPS = ("layer", "sublayer", "parameter")


@attrs.frozen
class ChainEntry:
    """One ``optimizer.chain`` element: a ``pgs.func`` factory name and its keyword arguments."""

    name: str
    args: dict = attrs.field(factory=dict)


@attrs.frozen
class OptimizerSpec:
    """``[optimizer]``: a named alias with ``args``, or an explicit ``chain`` of transforms.

    ``clip`` prepends ``clip_by_global_norm(clip)`` to an alias (0 turns it off); a chain
    spells its own clipping.  ``compile`` runs the chain through ``pf.compile`` (``jit``:
    one ``torch.compile`` graph).
    """

    section: ClassVar[str] = "optimizer"

    alias: str | None = attrs.field(default=None, validator=attrs.validators.optional(string))
    chain: tuple[ChainEntry, ...] | None = attrs.field(default=None)
    args: dict = attrs.field(factory=dict, validator=table)
    clip: float = attrs.field(default=1.0, converter=to_float, validator=number_in(0.0))
    compile: bool = attrs.field(default=False, validator=boolean)
    jit: bool = attrs.field(default=True, validator=boolean)


@attrs.frozen
class ScheduleSpec:
    """``[schedule]``: the learning rate as a function of the step (``pgs.func.schedules``).

    ``total = 0`` means the run's number of optimizer steps.  ``wsd``: ``decay = 0`` means
    20% of ``total``, ``stable = 0`` means whatever remains after warmup and decay.
    """

    section: ClassVar[str] = "schedule"

    name: str = attrs.field(default="cosine", validator=one_of(SCHEDULES))
    peak: float = attrs.field(default=3e-4, converter=to_float, validator=number_in(0.0))
    warmup: int = attrs.field(default=0, validator=int_at_least(0))
    total: int = attrs.field(default=0, validator=int_at_least(0))
    final: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    init: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    shape: str = attrs.field(default="linear", validator=one_of(WSD_SHAPES))
    stable: int = attrs.field(default=0, validator=int_at_least(0))
    decay: int = attrs.field(default=0, validator=int_at_least(0))
    gamma: float = attrs.field(default=4.0, converter=to_float, validator=number_in(0.0))

    #: The fields each schedule reads; setting another one is a mistake worth reporting.
    USES: ClassVar[dict[str, tuple[str, ...]]] = {
        "constant": ("peak",),
        "linear_warmup": ("peak", "warmup", "init"),
        "cosine": ("peak", "warmup", "total", "final", "init"),
        "wsd": ("peak", "warmup", "total", "final", "init", "shape", "stable", "decay"),
        "power_decay": ("peak", "warmup", "total", "gamma", "init"),
    }

    def build(self, run_steps: int | None = None):
        """This schedule as a ``pgs.func`` schedule (``step -> 0-d float64 tensor``): the learning
        rate that ``pgs.runtime.spec.chain.build_chain`` hands to the factories declaring
        ``takes_learning_rate``.  ``run_steps`` (the run's optimizer steps) is the length where
        ``total = 0``; a decaying schedule needs one of the two."""
        total = self.total or run_steps
        if total is None and self.name not in ("constant", "linear_warmup"):
            raise SpecError(f"schedule.total: the {self.name} schedule needs the run length; set schedule.total "
                            "or pass the number of steps once the data is counted")
        if total is not None and self.name != "constant" and self.warmup > total:
            raise SpecError(f"schedule.warmup: {self.warmup} steps is more than the run's {total} steps")
        try:
            return self._schedule(total)
        except PgsError as err:
            if isinstance(err, SpecError):
                raise
            raise SpecError(f"schedule: {err}") from None

    def _schedule(self, total: int | None):
        if self.name == "constant":
            return pf.constant_schedule(self.peak)
        if self.name == "linear_warmup":
            return pf.linear_warmup(self.peak, self.warmup, init=self.init)
        if self.name == "cosine":
            return pf.cosine_schedule(self.peak, self.warmup, total, final=self.final, init=self.init)
        if self.name == "power_decay":
            if total <= self.warmup:
                raise SpecError(f"schedule.warmup: power_decay needs warmup ({self.warmup}) < total ({total})")
            return pf.power_decay_schedule(self.peak, total, gamma=self.gamma, warmup=self.warmup, init=self.init)
        decay = self.decay or max(1, round(0.2 * (total - self.warmup)))
        stable = self.stable or total - self.warmup - decay
        if stable < 0:
            raise SpecError(f"schedule: warmup ({self.warmup}) + decay ({decay}) is more than total ({total})")
        return pf.wsd_schedule(self.peak, self.warmup, stable, decay, shape=self.shape, final=self.final,
                               init=self.init)


@attrs.frozen
class MemorySpec:
    """``[memory]``: trading compute or precision for memory (docs/memory.md).

    ``gradient_release`` runs the chain inside backward, one decoder layer at a time
    (``pgs.runtime.optim.release``); it needs ``train.grad_accum = 1``, ``optimizer.clip = 0`` and
    a chain without global transforms.  ``activation_checkpointing`` (``"none"``, ``"full"``,
    ``"selective"``) applies to layers ``0, k, 2k, …`` with ``k = checkpoint_every``.
    ``compile_layers`` compiles each decoder layer; ``liger`` patches in Liger's kernels.
    ``master_weights = "fp32"`` and ``stochastic_rounding`` are for low-precision weights;
    ``master_weights`` needs ``gradient_release``.  ``defer_head_grad`` (with gradient release,
    a tied head and the chunked loss) adds the head's gradient into the embedding's own
    gradient buffer at the end of backward instead of holding a second V×D buffer through it
    (``"auto"``, the default: with activation checkpointing or tied slabs; ``head_grad_deferred``).
    ``offload_checkpoints`` keeps each checkpointed layer's input in pinned host memory
    instead of on the device (``activation_checkpointing = "full"`` or ``"sublayer"``;
    ``"sublayer"`` checkpoints each layer's attention half and MLP half apart);
    ``offload_prefetch`` is how many checkpointed inputs ahead backward starts copying them back
    (that many on the device at a time; ``"auto"``, the default: 2 with ``offload_optimizer``,
    whose state fetches share the host→device copy engine, else 1; ``prefetch_depth``).  ``tied_slabs``
    (0: off) steps the input embedding's (tied) weight in slabs of that many vocabulary rows
    at the end of backward, so no dense V×D gradient exists (gradient release, one process,
    an elementwise chain; ``GradientRelease(..., memory=pf.MemoryOptions(tied_slabs=rows))``).  ``release_groups``
    (``"layer"``, ``"sublayer"`` or ``"parameter"``) is what steps together inside backward: a
    decoder layer's parameters, its MLP half and its attention half apart (the MLP's gradients
    are stepped before the attention's backward runs), or each parameter as soon as its
    gradient exists (a layer's gradients then never all exist at once).  ``mlp_tiles`` (0: off)
    computes each decoder layer's gated MLP in that many token slices, forward and backward
    (``pgs.runtime.model.tiled_mlp``): the MLP's [tokens, intermediate] tensors never exist whole.
    ``offload_optimizer`` keeps each release group's chain state in pinned host memory and streams
    it through device staging slots inside backward (``pgs.runtime.optim.offload``; gradient release; with
    several processes each rank streams its own shards' state, ``pgs.runtime.optim.sharded_offload``).
    ``device_limit_gib`` (0: none) caps what CUDA's caching allocator may reserve on the device,
    as on a card of that size: past the cap it returns its cached free blocks to the driver
    and retries instead of reserving more, and a step that needs more than the cap fails as
    out of memory (``train.configure_allocator``).
    ``seco_chunk`` (0: off) trains each row chunk-wise (SeCO, arXiv 2505.16710;
    ``pgs.runtime.model.seco``): the forward runs chunks of that many tokens without autograd,
    keeping each layer's keys/values, and the backward recomputes one chunk at a time in reverse,
    routing the gradient of the cached keys/values back to their chunks (exact; one chunk's
    activations alive, plus the cache and its gradient).  ``spaco_keep`` (1: off) < 1 makes it
    SpaCO: each chunk's backward runs with that probability, what it sends scaled by
    ``1/spaco_keep`` (an unbiased estimate of the gradient at ``spaco_keep`` of the backward's cost;
    docs/techniques/seco.md).
    """

    section: ClassVar[str] = "memory"

    gradient_release: bool = attrs.field(default=False, validator=boolean)
    activation_checkpointing: str = attrs.field(default="none", validator=one_of(CHECKPOINT_POLICIES))
    checkpoint_every: int = attrs.field(default=1, validator=int_at_least(1))
    compile_layers: bool = attrs.field(default=False, validator=boolean)
    liger: bool = attrs.field(default=False, validator=boolean)
    master_weights: str = attrs.field(default="none", validator=one_of(MASTER_WEIGHTS))
    stochastic_rounding: bool = attrs.field(default=False, validator=boolean)
    defer_head_grad: bool | str = attrs.field(
        default="auto", validator=expect('true, false or "auto"', lambda v: isinstance(v, bool) or v == "auto"))
    offload_checkpoints: bool = attrs.field(default=False, validator=boolean)
    offload_prefetch: int | str = attrs.field(
        default="auto", validator=expect('an integer >= 1 or "auto"', lambda v: v == "auto" or (is_int(v) and v >= 1)))
    tied_slabs: int = attrs.field(default=0, validator=int_at_least(0))
    release_groups: str = attrs.field(default="layer", validator=one_of(RELEASE_GROUPS))
    mlp_tiles: int = attrs.field(default=0, validator=int_at_least(0))
    offload_optimizer: bool = attrs.field(default=False, validator=boolean)
    device_limit_gib: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    seco_chunk: int = attrs.field(default=0, validator=int_at_least(0))
    spaco_keep: float = attrs.field(default=1.0, converter=to_float, validator=number_in(0.0, 1.0))

    def refusal(self) -> str | None:
        """Why these ``[memory]`` settings cannot work together (None: they can): the rules that
        read this section alone, each written here once.  ``pgs validate`` / ``pgs run`` check
        them with the spec (``pgs.runtime.spec.chain.check_memory_options``), ``make_optimizer`` with its
        arguments."""
        if self.offload_checkpoints and self.activation_checkpointing not in ("full", "sublayer"):
            return (f"memory.offload_checkpoints: offloads the inputs of \"full\" or \"sublayer\" checkpointed "
                    f"layers; activation_checkpointing is {self.activation_checkpointing!r} (set it to \"full\" "
                    "or \"sublayer\", or offload_checkpoints = false)")
        if self.offload_prefetch not in (1, "auto") and not self.offload_checkpoints:
            return (f"memory.offload_prefetch = {self.offload_prefetch}: how far ahead backward fetches the "
                    "offloaded checkpoint inputs; set memory.offload_checkpoints = true, or leave "
                    "offload_prefetch at \"auto\"")
        why = self.seco_refusal()
        if why:
            return why
        if self.gradient_release:
            return None
        if self.tied_slabs:
            return (f"memory.tied_slabs = {self.tied_slabs}: the embedding's weight is stepped in row slabs by "
                    "gradient release at the end of backward; set memory.gradient_release = true or tied_slabs = 0")
        if self.offload_optimizer:
            return ("memory.offload_optimizer: the state is streamed to the device group by group as "
                    "gradient release steps inside backward; set memory.gradient_release = true or "
                    "offload_optimizer = false")
        if self.master_weights != "none":
            return (f"memory.master_weights: {self.master_weights!r} is kept by gradient release only; "
                    "set memory.gradient_release = true or master_weights = \"none\"")
        return None

    def seco_refusal(self) -> str | None:
        """Why ``seco_chunk`` / ``spaco_keep`` cannot run with the other ``[memory]`` settings."""
        if self.spaco_keep <= 0.0:
            return "memory.spaco_keep: 0 would run no chunk's backward; set a probability in (0, 1] (1: SeCO, exact)"
        if self.spaco_keep < 1.0 and not self.seco_chunk:
            return (f"memory.spaco_keep = {self.spaco_keep:g}: SpaCO is the sparse variant of chunk-wise training; "
                    "set memory.seco_chunk (tokens per chunk) too, or spaco_keep = 1")
        if not self.seco_chunk:
            return None
        clashes = (("tied_slabs", self.tied_slabs, "0"), ("defer_head_grad", self.defer_head_grad is True, "\"auto\""),
                   ("offload_optimizer", self.offload_optimizer, "false"),
                   ("compile_layers", self.compile_layers, "false"))
        for field, on, off in clashes:
            if on:
                return (f"memory.seco_chunk: memory.{field} does not compose with chunk-wise training (the gradients "
                        f"of a row complete only after its last chunk); set memory.{field} = {off}, or seco_chunk = 0")
        return None

    def head_grad_deferred(self) -> bool:
        """``defer_head_grad`` resolved: ``"auto"`` defers where memory is what the spec trades
        for (activation checkpointing or tied slabs; slabs need it).  Deferring costs one more head
        matmul per step and saves one V×D buffer through backward (docs/memory.md): worth it
        where memory is tight, not where activations dwarf it."""
        if self.seco_chunk:  # each chunk's loss backward is its own: nothing to defer to the end
            return False
        return head_grad_wanted(self.defer_head_grad, self.activation_checkpointing, self.tied_slabs)

    def options(self) -> MemoryOptions:
        """What code below the optimizer binder reads of this section, as one ``pf.MemoryOptions``
        (the one place it is made from a spec; ``"auto"`` resolved): stochastic rounding, the
        deferred head gradient (``head_grad_deferred``), tied slabs.  ``make_optimizer`` hands it
        to the binder, which passes it to the kernels; the objectives take the binder's to the
        losses.  The rules between these fields are ``refusal``'s."""
        return MemoryOptions(stochastic_rounding=self.stochastic_rounding, defer_head_grad=self.head_grad_deferred(),
                             tied_slabs=self.tied_slabs)


def head_grad_wanted(setting: bool | str, activation_checkpointing: str | None, tied_slabs: int | None) -> bool:
    """``memory.defer_head_grad`` resolved (``MemorySpec.head_grad_deferred``, ``pgs profile``'s
    prediction): ``"auto"`` defers with activation checkpointing or tied slabs, a bool says itself."""
    if setting == "auto":
        return activation_checkpointing not in (None, "none") or bool(tied_slabs)
    return bool(setting)


def prefetch_depth(setting: int | str, offload_optimizer: bool) -> int:
    """``memory.offload_prefetch`` resolved (``pgs run``'s checkpointing, ``pgs profile``'s
    prediction): ``"auto"`` is 2 where the optimizer state is offloaded too, else 1.  Why 2 there:
    each group's state fetch (≈ 0.1 GB per decoder layer at 4B) queues on the same host→device
    copy engine as the next layer's input, so the input copied back one layer ahead arrives late
    and the compute stream waits for it; two layers ahead it is there (docs/memory.md, one layer
    input more on the device: 21 MB at Qwen3-4B's 1×4096).  An int says itself."""
    if setting == "auto":
        return 2 if offload_optimizer else 1
    return int(setting)


def checkpoint_offload(offload_checkpoints: bool, offload_prefetch: int | str, offload_optimizer: bool) -> int | bool:
    """``apply_activation_checkpointing``'s ``offload`` for these ``[memory]`` settings (``pgs run``
    and ``pgs profile`` alike): False without ``offload_checkpoints``, else :func:`prefetch_depth`."""
    return prefetch_depth(offload_prefetch, offload_optimizer) if offload_checkpoints else False
