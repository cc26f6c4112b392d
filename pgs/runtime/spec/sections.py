"""The sections of a run spec (``[model]``, ``[optimizer]``, ``[schedule]``, ``[loss]``,
``[train]``, ``[checkpoint]``, ``[log]``, ``[memory]``, ``[moe]``, ``[parallel]``, ``[preference]``, ``[distill]``; ``[data]`` is ``DataConfig``): frozen attrs
classes whose validators check every field's type and range and name it in a ``SpecError``.
``pgs.runtime.spec.load`` assembles them into a ``Spec`` (and re-exports these names).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import ClassVar

import attrs

from pgs.errors import SpecError
from pgs.func.losses import DISTILL_KINDS, PREFERENCE_KINDS, REFERENCE_FREE
from pgs.runtime.common import describe as _describe, is_int as _is_int, parse_size, suggest
from pgs.runtime.data.config import DataConfig
from pgs.runtime.optim.memory import head_grad_wanted

#: ``"pgs:quickstart/train.jsonl"`` names a file bundled with the package.
ASSET_PREFIX = "pgs:"
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"  # pgs/assets

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "varlen", "eager", "flash_attention_2", "flex_attention")
VARLEN_KERNELS = ("auto", "cudnn", "flash")  # pgs.runtime.model.attention.VARLEN_KERNELS
#: transformers' expert implementations of MoE layers that run without a hub download ("auto":
#: transformers' own default); pgs.runtime.model.moe.experts_implementation checks the model.
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm")
FREEZE_POLICIES = ("none", "non_attention")
SCHEDULES = ("constant", "linear_warmup", "cosine", "wsd", "power_decay")
WSD_SHAPES = ("linear", "cosine", "1-sqrt", "power", "exponential")
DEVICES = ("auto", "cpu", "cuda")
CHECKPOINT_POLICIES = ("none", "full", "selective", "sublayer")
MASTER_WEIGHTS = ("none", "fp32")
RELEASE_GROUPS = ("layer", "sublayer", "parameter")
REFERENCE_MODES = ("cached", "live")
MERGE_METHODS = ("none", "linear", "slerp")  # pgs.func.merge.METHODS, and "none"


# --------------------------------------------------------------------------- field checks


def _where(instance, attribute) -> str:
    return f"{type(instance).section}.{attribute.name}"


def _expect(kind: str, ok):
    def check(instance, attribute, value):
        if not ok(value):
            raise SpecError(f"{_where(instance, attribute)}: expected {kind}, got {_describe(value)}")

    return check


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and not math.isnan(v)


def _int_at_least(lo: int):
    return _expect(f"an integer >= {lo}", lambda v: _is_int(v) and v >= lo)


def _number_in(lo: float, hi: float = math.inf):
    where = f"a number >= {lo}" if hi == math.inf else f"a number in [{lo}, {hi}]"
    return _expect(where, lambda v: _is_number(v) and lo <= v <= hi)


def _one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            options = ", ".join(map(repr, choices))
            hint = suggest(value, choices) if isinstance(value, str) else ""
            raise SpecError(f"{_where(instance, attribute)}: {value!r} is not one of {options}{hint}")

    return check


_bool = _expect("true or false", lambda v: isinstance(v, bool))
_str = _expect("a string", lambda v: isinstance(v, str))
_table = _expect("a table", lambda v: isinstance(v, dict))


def _to_float(v):
    """TOML ``peak = 1`` is an integer; number fields keep floats."""
    return float(v) if _is_int(v) else v


# --------------------------------------------------------------------------- sections


@attrs.frozen
class ModelSpec:
    """``[model]``: where the weights (or the architecture) and the tokenizer come from."""

    section: ClassVar[str] = "model"

    path: str | None = attrs.field(default=None, validator=attrs.validators.optional(_str))
    config: dict | None = attrs.field(default=None, validator=attrs.validators.optional(_table))
    tokenizer: str | None = attrs.field(default=None, validator=attrs.validators.optional(_str))
    dtype: str = attrs.field(default="float32", validator=_one_of(DTYPES))
    attn_implementation: str = attrs.field(default="auto", validator=_one_of(ATTN_IMPLEMENTATIONS))
    varlen_kernel: str = attrs.field(default="auto", validator=_one_of(VARLEN_KERNELS))
    experts_implementation: str = attrs.field(default="auto", validator=_one_of(EXPERTS_IMPLEMENTATIONS))
    freeze: str | tuple[str, ...] = attrs.field(default="none")
    trust_remote_code: bool = attrs.field(default=False, validator=_bool)
    init_seed: int = attrs.field(default=0, validator=_int_at_least(0))

    @freeze.validator
    def _check_freeze(self, attribute, value):
        if isinstance(value, str):
            _one_of(FREEZE_POLICIES)(self, attribute, value)
            return
        if not isinstance(value, tuple) or not value:
            raise SpecError(
                f"model.freeze: expected \"none\", \"non_attention\" or a non-empty array of "
                f"regular expressions, got {_describe(value)}"
            )
        for i, pattern in enumerate(value):
            if not isinstance(pattern, str):
                raise SpecError(f"model.freeze[{i}]: expected a regular expression string, got {_describe(pattern)}")
            try:
                re.compile(pattern)
            except re.error as err:
                raise SpecError(f"model.freeze[{i}]: bad regular expression {pattern!r} ({err})") from None


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

    alias: str | None = attrs.field(default=None, validator=attrs.validators.optional(_str))
    chain: tuple[ChainEntry, ...] | None = attrs.field(default=None)
    args: dict = attrs.field(factory=dict, validator=_table)
    clip: float = attrs.field(default=1.0, converter=_to_float, validator=_number_in(0.0))
    compile: bool = attrs.field(default=False, validator=_bool)
    jit: bool = attrs.field(default=True, validator=_bool)


@attrs.frozen
class ScheduleSpec:
    """``[schedule]``: the learning rate as a function of the step (``pgs.func.schedules``).

    ``total = 0`` means the run's number of optimizer steps.  ``wsd``: ``decay = 0`` means
    20% of ``total``, ``stable = 0`` means whatever remains after warmup and decay.
    """

    section: ClassVar[str] = "schedule"

    name: str = attrs.field(default="cosine", validator=_one_of(SCHEDULES))
    peak: float = attrs.field(default=3e-4, converter=_to_float, validator=_number_in(0.0))
    warmup: int = attrs.field(default=0, validator=_int_at_least(0))
    total: int = attrs.field(default=0, validator=_int_at_least(0))
    final: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    init: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    shape: str = attrs.field(default="linear", validator=_one_of(WSD_SHAPES))
    stable: int = attrs.field(default=0, validator=_int_at_least(0))
    decay: int = attrs.field(default=0, validator=_int_at_least(0))
    gamma: float = attrs.field(default=4.0, converter=_to_float, validator=_number_in(0.0))

    #: The fields each schedule reads; setting another one is a mistake worth reporting.
    USES: ClassVar[dict[str, tuple[str, ...]]] = {
        "constant": ("peak",),
        "linear_warmup": ("peak", "warmup", "init"),
        "cosine": ("peak", "warmup", "total", "final", "init"),
        "wsd": ("peak", "warmup", "total", "final", "init", "shape", "stable", "decay"),
        "power_decay": ("peak", "warmup", "total", "gamma", "init"),
    }


@attrs.frozen
class LossSpec:
    """``[loss]``: the token objective and the output-head backend (``pgs.func.losses``).

    ``args`` go to the objective's class (``deft``: ``alpha``; ``infosft``: ``p_bar``, ...).
    ``neftune_alpha`` / ``symnoise_alpha`` (at most one > 0): noise on the input embeddings
    while training, NEFTune's uniform (arXiv 2310.05914) or SymNoise's symmetric Rademacher
    (arXiv 2312.01523) with the same scale α/√(L·d) (``pgs.func.losses.noise``).
    """

    section: ClassVar[str] = "loss"

    objective: str = attrs.field(default="ce", validator=_str)
    backend: str = attrs.field(default="chunked", validator=_str)
    chunk_size: int = attrs.field(default=1024, validator=_int_at_least(1))
    z_loss: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    neftune_alpha: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    symnoise_alpha: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    args: dict = attrs.field(factory=dict, validator=_table)

    def __attrs_post_init__(self) -> None:
        if self.neftune_alpha > 0 and self.symnoise_alpha > 0:
            raise SpecError(f"loss.symnoise_alpha: {self.symnoise_alpha:g} and loss.neftune_alpha = "
                            f"{self.neftune_alpha:g} are two kinds of embedding noise; set one of them (the other 0)")

    def embedding_noise(self):
        """``(noise function, α)`` of the input-embedding noise (``neftune`` or ``symnoise``,
        same signature), or None when both alphas are 0."""
        from pgs.func.losses import neftune, symnoise

        if self.symnoise_alpha > 0:
            return symnoise, self.symnoise_alpha
        if self.neftune_alpha > 0:
            return neftune, self.neftune_alpha
        return None


@attrs.frozen
class TrainSpec:
    """``[train]``: how long, how big, how often, and when to give up.

    Exactly one of ``steps`` (optimizer steps) and ``epochs`` (passes over the mix) is set.
    ``batch_size`` is global (packed sequences per optimizer step), split into ``grad_accum``
    micro-batches.  ``entropy_warn`` warns, ``entropy_halt`` (0: off) halts with exit 80 when an
    interval's mean next-token entropy is below it; ``health_every`` (0: ``log_every``) is that
    interval, the health summary's (``pgs.runtime.loop.health``).
    """

    section: ClassVar[str] = "train"

    steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    epochs: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    batch_size: int = attrs.field(default=8, validator=_int_at_least(1))
    grad_accum: int = attrs.field(default=1, validator=_int_at_least(1))
    seed: int = attrs.field(default=0, validator=_int_at_least(0))
    max_wall_seconds: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    eval_every: int = attrs.field(default=50, validator=_int_at_least(0))
    log_every: int = attrs.field(default=10, validator=_int_at_least(1))
    max_consecutive_skips: int = attrs.field(default=3, validator=_int_at_least(0))
    max_skip_fraction: float = attrs.field(default=0.05, converter=_to_float, validator=_number_in(0.0, 1.0))
    entropy_warn: float = attrs.field(default=0.18, converter=_to_float, validator=_number_in(0.0))
    entropy_halt: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    health_every: int = attrs.field(default=0, validator=_int_at_least(0))
    device: str = attrs.field(default="auto", validator=_one_of(DEVICES))


@attrs.frozen
class CheckpointSpec:
    """``[checkpoint]``: where and how often; ``keep`` newest periodic ones (0 keeps all).

    ``best_metric`` (``""`` disables) also keeps the best checkpoint by that eval metric
    (lower is better unless the name contains ``accuracy``); it needs ``data.eval``.
    ``export`` writes a plain HF folder (config + safetensors + tokenizer) at the end;
    ``max_shard_size`` (``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes) is its largest weights
    file: larger models are sharded with an index, as ``save_pretrained`` does.
    ``background`` writes each periodic checkpoint on a thread from a host snapshot while
    training goes on (``pgs.runtime.store.background``; host memory for one checkpoint, or
    each rank's shards with several processes); stops, halts and the last step still save in
    the foreground.
    """

    section: ClassVar[str] = "checkpoint"

    dir: str = attrs.field(default="runs/run", validator=_str)
    every: int = attrs.field(default=100, validator=_int_at_least(0))
    keep: int = attrs.field(default=2, validator=_int_at_least(0))
    best_metric: str = attrs.field(default="eval_loss", validator=_str)
    export: bool = attrs.field(default=True, validator=_bool)
    max_shard_size: str | int = attrs.field(default="5GB", validator=lambda _s, _a, v: _shard_size(v))
    background: bool = attrs.field(default=False, validator=_bool)


def _shard_size(value) -> None:

    parse_size(value)


@attrs.frozen
class LogSpec:
    """``[log]``: where metrics go besides the console (``metrics.jsonl`` in the run folder).

    ``wandb``, ``trackio``, ``tensorboard``, ``mlflow`` turn on a tracker (an optional extra,
    ``pgs.runtime.loop.trackers``); ``project`` and ``run_name`` name the run there (``""``:
    the spec file's name, the run folder's name)."""

    section: ClassVar[str] = "log"

    jsonl: bool = attrs.field(default=True, validator=_bool)
    wandb: bool = attrs.field(default=False, validator=_bool)
    trackio: bool = attrs.field(default=False, validator=_bool)
    tensorboard: bool = attrs.field(default=False, validator=_bool)
    mlflow: bool = attrs.field(default=False, validator=_bool)
    project: str = attrs.field(default="", validator=_str)
    run_name: str = attrs.field(default="", validator=_str)


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
    an elementwise chain; ``GradientRelease(..., tied_slabs=rows)``).  ``release_groups``
    (``"layer"``, ``"sublayer"`` or ``"parameter"``) is what steps together inside backward: a
    decoder layer's parameters, its MLP half and its attention half apart (the MLP's gradients
    are stepped before the attention's backward runs), or each parameter as soon as its
    gradient exists (a layer's gradients then never all exist at once).  ``mlp_tiles`` (0: off) computes each decoder layer's gated MLP in that
    many token slices, forward and backward (``pgs.runtime.model.tiled_mlp``): the MLP's
    [tokens, intermediate] tensors never exist whole.  ``offload_optimizer`` keeps each release
    group's chain state in pinned host memory and streams it through device staging slots
    inside backward (``pgs.runtime.optim.offload``; gradient release, one process).
    ``device_limit_gib`` (0: none) caps what CUDA's caching allocator may reserve on the device,
    as on a card of that size: past the cap it returns its cached free blocks to the driver
    and retries instead of reserving more, and a step that needs more than the cap fails as
    out of memory (``train.configure_allocator``).
    """

    section: ClassVar[str] = "memory"

    gradient_release: bool = attrs.field(default=False, validator=_bool)
    activation_checkpointing: str = attrs.field(default="none", validator=_one_of(CHECKPOINT_POLICIES))
    checkpoint_every: int = attrs.field(default=1, validator=_int_at_least(1))
    compile_layers: bool = attrs.field(default=False, validator=_bool)
    liger: bool = attrs.field(default=False, validator=_bool)
    master_weights: str = attrs.field(default="none", validator=_one_of(MASTER_WEIGHTS))
    stochastic_rounding: bool = attrs.field(default=False, validator=_bool)
    defer_head_grad: bool | str = attrs.field(
        default="auto", validator=_expect('true, false or "auto"', lambda v: isinstance(v, bool) or v == "auto"))
    offload_checkpoints: bool = attrs.field(default=False, validator=_bool)
    offload_prefetch: int | str = attrs.field(
        default="auto", validator=_expect('an integer >= 1 or "auto"', lambda v: v == "auto" or (_is_int(v) and v >= 1)))
    tied_slabs: int = attrs.field(default=0, validator=_int_at_least(0))
    release_groups: str = attrs.field(default="layer", validator=_one_of(RELEASE_GROUPS))
    mlp_tiles: int = attrs.field(default=0, validator=_int_at_least(0))
    offload_optimizer: bool = attrs.field(default=False, validator=_bool)
    device_limit_gib: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))

    def head_grad_deferred(self) -> bool:
        """``defer_head_grad`` resolved: ``"auto"`` defers where memory is what the spec trades
        for (activation checkpointing or tied slabs; slabs need it).  Deferring costs one more head
        matmul per step and saves one V×D buffer through backward (docs/memory.md): worth it
        where memory is tight, not where activations dwarf it."""
        return head_grad_wanted(self.defer_head_grad, self.activation_checkpointing, self.tied_slabs)


def _kind_known(instance, attribute, value):
    if value not in PREFERENCE_KINDS:
        hint = suggest(value, PREFERENCE_KINDS) if isinstance(value, str) else ""
        raise SpecError(f"preference.kind: {value!r} is not one of {', '.join(map(repr, PREFERENCE_KINDS))}{hint}")


def _optional_path(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"preference.{attribute.name}: expected a local model folder, got {_describe(value)}")


@attrs.frozen
class PreferenceSpec:
    """``[preference]``: train on preference pairs with an offline objective (docs/preference.md).

    ``kind`` is one of ``pgs.func.losses.PREFERENCE_KINDS`` (``dpo``, ``ipo``, ``hinge``,
    ``dpop``, ``simpo``, ``orpo``); ``beta`` (ORPO: the odds-ratio term's weight),
    ``label_smoothing`` (cDPO's ε, dpo only), ``gamma`` (SimPO's margin, simpo only), ``lam``
    (DPOP's λ, dpop only) and ``nll_weight`` (an NLL term on the chosen answers, any kind) are
    its arguments (``pgs.func.losses.preference_loss``).  ``reference``: ``"cached"`` computes the
    reference log-probs of every pair once before training and keeps them in the run folder;
    ``"live"`` keeps a frozen copy that computes them every step.  ``reference_path`` names a
    local model folder as the reference (default: the initial policy).  ``simpo``/``orpo`` use
    no reference.
    """

    section: ClassVar[str] = "preference"

    kind: str = attrs.field(default="dpo", validator=_kind_known)
    beta: float = attrs.field(default=0.1, converter=_to_float,
                              validator=_expect("a number > 0", lambda v: _is_number(v) and v > 0 and v != math.inf))
    label_smoothing: float = attrs.field(default=0.0, converter=_to_float,
                                         validator=_expect("a number in [0, 0.5)",
                                                           lambda v: _is_number(v) and 0 <= v < 0.5))
    gamma: float = attrs.field(default=0.0, converter=_to_float,
                               validator=_expect("a finite number", lambda v: _is_number(v) and math.isfinite(v)))
    lam: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    nll_weight: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    reference: str = attrs.field(default="cached", validator=_one_of(REFERENCE_MODES))
    reference_path: str | None = attrs.field(default=None, validator=_optional_path)

    def __attrs_post_init__(self) -> None:
        for name, kind in (("label_smoothing", "dpo"), ("gamma", "simpo"), ("lam", "dpop")):
            if getattr(self, name) != 0 and self.kind != kind:
                raise SpecError(f"preference.{name}: {getattr(self, name)!r} has no effect with kind = {self.kind!r} "
                                f"(only kind = {kind!r} reads it)")
        if self.reference_path is not None and not self.uses_reference:
            raise SpecError(f"preference.reference_path: kind = {self.kind!r} uses no reference model")

    @property
    def uses_reference(self) -> bool:
        """Whether the objective reads reference log-probs (``simpo``/``orpo`` do not)."""
        return self.kind not in REFERENCE_FREE


#: ``[distill.generation]`` keys and their defaults (``pgs.runtime.model.generate.GenerationSettings``).
GENERATION_DEFAULTS = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


def _open_unit(instance, attribute, value):
    if value is not None and not (_is_number(value) and 0 < value < 1):
        raise SpecError(f"distill.{attribute.name}: expected a number in (0, 1) (exclusive), got {_describe(value)}")


def _teacher_path(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"distill.teacher_path: expected a local model folder, got {_describe(value)}")


def _distill_kind(instance, attribute, value):
    if value not in DISTILL_KINDS:
        hint = suggest(value, DISTILL_KINDS) if isinstance(value, str) else ""
        raise SpecError(f"distill.kind: {value!r} is not one of {', '.join(map(repr, DISTILL_KINDS))}{hint}")


def _check_generation(table: dict) -> None:
    for key, value in table.items():
        where = f"distill.generation.{key}"
        if key not in GENERATION_DEFAULTS:
            raise SpecError(f"{where}: unknown key{suggest(key, GENERATION_DEFAULTS)}")
        if key == "max_new_tokens" and not (_is_int(value) and value >= 1):
            raise SpecError(f"{where}: expected an integer >= 1, got {_describe(value)}")
        if key == "temperature" and not (_is_number(value) and 0 <= value < math.inf):
            raise SpecError(f"{where}: expected a number >= 0 (0: greedy), got {_describe(value)}")
        if key == "top_p" and not (_is_number(value) and 0 < value <= 1):
            raise SpecError(f"{where}: expected a number in (0, 1], got {_describe(value)}")


@attrs.frozen
class DistillSpec:
    """``[distill]``: on-policy distillation from a frozen teacher (docs/techniques/distillation.md).

    The teacher is a local Hugging Face folder (``teacher_path``) or, for tests, an architecture
    table with a random init (``teacher_config``, ``teacher_init_seed``), loaded in
    ``teacher_dtype`` without gradients; its tokenizer must be the student's (``pgs validate``).
    ``on_policy`` (GKD's λ) is the probability that a batch's completions are sampled by the
    student from the prompts instead of read from the data.  ``kind`` (``forward_kl``,
    ``reverse_kl``, ``jsd``), ``beta`` (jsd's β ∈ (0, 1), default 0.5; jsd only) and
    ``temperature`` are ``pgs.func.losses.distill_loss``'s arguments.  ``[distill.generation]``
    (``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``) says how the student samples.
    ``eval_prompts``: held-out prompts on which the eval measures the teacher–student KL.
    """

    section: ClassVar[str] = "distill"

    teacher_path: str | None = attrs.field(default=None, validator=_teacher_path)
    teacher_config: dict | None = attrs.field(default=None, validator=attrs.validators.optional(_table))
    teacher_init_seed: int = attrs.field(default=0, validator=_int_at_least(0))
    teacher_dtype: str = attrs.field(default="bfloat16", validator=_one_of(DTYPES))
    on_policy: float = attrs.field(default=0.5, converter=_to_float, validator=_number_in(0.0, 1.0))
    kind: str = attrs.field(default="jsd", validator=_distill_kind)
    beta: float | None = attrs.field(default=None, converter=_to_float, validator=_open_unit)
    temperature: float = attrs.field(default=1.0, converter=_to_float,
                                     validator=_expect("a number > 0", lambda v: _is_number(v) and 0 < v < math.inf))
    generation: dict = attrs.field(factory=dict, validator=_table)
    eval_prompts: int = attrs.field(default=64, validator=_int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if (self.teacher_path is None) == (self.teacher_config is None):
            both = "both are set" if self.teacher_path is not None else "neither is set"
            raise SpecError("distill: set exactly one of distill.teacher_path (a local Hugging Face folder) or "
                            f"distill.teacher_config (random init, for tests); {both}")
        if self.teacher_config is not None and not isinstance(self.teacher_config.get("model_type"), str):
            raise SpecError("distill.teacher_config.model_type: needed (a string such as \"qwen3\")")
        if self.beta is not None and self.kind != "jsd":
            raise SpecError(f"distill.beta: {self.beta!r} has no effect with kind = {self.kind!r} (only kind = 'jsd' reads it)")
        _check_generation(self.generation)

    @property
    def jsd_beta(self) -> float:
        """β as the loss reads it (0.5 unless set)."""
        return 0.5 if self.beta is None else self.beta

    def generation_settings(self) -> dict:
        """``[distill.generation]`` with its defaults filled in."""
        return {**GENERATION_DEFAULTS, **self.generation}


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

    ema: float = attrs.field(default=0.0, converter=_to_float,
                             validator=_expect("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1))
    ema_every: int = attrs.field(default=1, validator=_int_at_least(1))
    merge: str = attrs.field(default="none", validator=_one_of(MERGE_METHODS))
    merge_weight: float = attrs.field(default=0.25, converter=_to_float, validator=_number_in(0.0, 1.0))
    merge_period: float = attrs.field(default=1.0, converter=_to_float,
                                      validator=_expect("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1))


@attrs.frozen
class MoESpec:
    """``[moe]``: mixture-of-experts models (docs/moe.md, ``pgs.runtime.model.moe``).

    ``load_balance``: the coefficient of the Switch load-balancing loss over the global batch
    (arXiv:2101.03961, arXiv:2501.11873); ``router_z_loss``: that of the ST-MoE router z-loss
    (arXiv:2202.08906).  Both 0 by default (post-training keeps the pretrained router's
    balance).  ``telemetry``: log the routers' load statistics (``moe/*``) with every step.
    Ignored for a dense model unless a coefficient is set (then refused).
    """

    section: ClassVar[str] = "moe"

    load_balance: float = attrs.field(default=0.0, validator=_number_in(0.0))
    router_z_loss: float = attrs.field(default=0.0, validator=_number_in(0.0))
    telemetry: bool = attrs.field(default=True, validator=_bool)


@attrs.frozen
class ParallelSpec:
    """``[parallel]``: how the processes of ``pgs run --nproc N`` share the work (docs/distributed.md).

    ``context``: ranks that split each packed row along the sequence (context parallelism,
    ring attention, ``pgs.runtime.dist.context``); it must divide the number of processes, the
    rest is data parallelism (``N / context`` ranks, each with its own rows).  ``layout``:
    ``"zigzag"`` (rank r holds chunks r and 2·context−1−r of the row: equal causal work) or
    ``"contiguous"``.
    """

    section: ClassVar[str] = "parallel"

    context: int = attrs.field(default=1, validator=_int_at_least(1))
    layout: str = attrs.field(default="zigzag", validator=_one_of(("zigzag", "contiguous")))


SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "data": DataConfig,
    "optimizer": OptimizerSpec,
    "schedule": ScheduleSpec,
    "loss": LossSpec,
    "train": TrainSpec,
    "checkpoint": CheckpointSpec,
    "log": LogSpec,
    "memory": MemorySpec,
    "moe": MoESpec,
    "parallel": ParallelSpec,
    "preference": PreferenceSpec,
    "distill": DistillSpec,
    "averaging": AveragingSpec,
}
