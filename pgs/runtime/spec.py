"""The run spec: one TOML file that says everything about a run (docs/spec.md).

``load_spec(path, overrides)`` reads the file, applies ``--set dotted.key=value`` overrides,
checks every field (unknown keys with a suggestion, types, ranges, conflicts, files that must
exist, transform names and their arguments) and returns a frozen :class:`Spec` whose paths are
absolute.  Nothing here touches a model or reads training data; ``pgs validate`` does that on
top (``pgs/cli.py``).  Every problem is a ``SpecError`` naming the dotted field.

Building the optimizer chain and the schedule from a spec lives in ``spec_chain.py``;
``Spec.build_chain()`` and ``Spec.build_schedule()`` are thin doors into it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Iterable

import attrs

from pgs.errors import SpecError
from pgs.runtime.data.config import DataConfig, DataSource
from pgs.runtime.spec_toml import dumps, parse_value, read_toml  # noqa: F401  (re-exported)

#: ``"pgs:quickstart/train.jsonl"`` names a file bundled with the package.
ASSET_PREFIX = "pgs:"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "varlen", "eager", "flash_attention_2", "flex_attention")
FREEZE_POLICIES = ("none", "non_attention")
SCHEDULES = ("constant", "linear_warmup", "cosine", "wsd", "power_decay")
WSD_SHAPES = ("linear", "cosine", "1-sqrt", "power", "exponential")
DEVICES = ("auto", "cpu", "cuda")
CHECKPOINT_POLICIES = ("none", "full", "selective", "sublayer")
MASTER_WEIGHTS = ("none", "fp32")
RELEASE_GROUPS = ("layer", "parameter")


# --------------------------------------------------------------------------- field checks


def suggest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def _where(instance, attribute) -> str:
    return f"{type(instance).section}.{attribute.name}"


def _describe(value) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) else kind


def _expect(kind: str, ok):
    def check(instance, attribute, value):
        if not ok(value):
            raise SpecError(f"{_where(instance, attribute)}: expected {kind}, got {_describe(value)}")

    return check


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    """

    section: ClassVar[str] = "loss"

    objective: str = attrs.field(default="ce", validator=_str)
    backend: str = attrs.field(default="chunked", validator=_str)
    chunk_size: int = attrs.field(default=1024, validator=_int_at_least(1))
    z_loss: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    neftune_alpha: float = attrs.field(default=0.0, converter=_to_float, validator=_number_in(0.0))
    args: dict = attrs.field(factory=dict, validator=_table)


@attrs.frozen
class TrainSpec:
    """``[train]``: how long, how big, how often, and when to give up.

    Exactly one of ``steps`` (optimizer steps) and ``epochs`` (passes over the mix) is set.
    ``batch_size`` is global (packed sequences per optimizer step), split into ``grad_accum``
    micro-batches.
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
    device: str = attrs.field(default="auto", validator=_one_of(DEVICES))


@attrs.frozen
class CheckpointSpec:
    """``[checkpoint]``: where and how often; ``keep`` newest periodic ones (0 keeps all).

    ``best_metric`` (``""`` disables) also keeps the best checkpoint by that eval metric
    (lower is better unless the name contains ``accuracy``); it needs ``data.eval``.
    ``export`` writes a plain HF folder (config + safetensors + tokenizer) at the end.
    """

    section: ClassVar[str] = "checkpoint"

    dir: str = attrs.field(default="runs/run", validator=_str)
    every: int = attrs.field(default=100, validator=_int_at_least(0))
    keep: int = attrs.field(default=2, validator=_int_at_least(0))
    best_metric: str = attrs.field(default="eval_loss", validator=_str)
    export: bool = attrs.field(default=True, validator=_bool)


@attrs.frozen
class LogSpec:
    """``[log]``: where metrics go besides the console (``metrics.jsonl`` in the run folder)."""

    section: ClassVar[str] = "log"

    jsonl: bool = attrs.field(default=True, validator=_bool)
    wandb: bool = attrs.field(default=False, validator=_bool)
    trackio: bool = attrs.field(default=False, validator=_bool)


@attrs.frozen
class MemorySpec:
    """``[memory]``: trading compute or precision for memory (docs/memory.md).

    ``gradient_release`` runs the chain inside backward, one decoder layer at a time
    (``pgs.runtime.release``); it needs ``train.grad_accum = 1``, ``optimizer.clip = 0`` and
    a chain without global transforms.  ``activation_checkpointing`` (``"none"``, ``"full"``,
    ``"selective"``) applies to layers ``0, k, 2k, …`` with ``k = checkpoint_every``.
    ``compile_layers`` compiles each decoder layer; ``liger`` patches in Liger's kernels.
    ``master_weights = "fp32"`` and ``stochastic_rounding`` are for low-precision weights;
    ``master_weights`` needs ``gradient_release``.  ``defer_head_grad`` (with gradient release,
    a tied head and the chunked loss) adds the head's gradient into the embedding's own
    gradient buffer at the end of backward instead of holding a second V×D buffer through it.
    ``offload_checkpoints`` keeps each checkpointed layer's input in pinned host memory
    instead of on the device (``activation_checkpointing = "full"`` or ``"sublayer"``;
    ``"sublayer"`` checkpoints each layer's attention half and MLP half apart).  ``tied_slabs``
    (0: off) steps the input embedding's (tied) weight in slabs of that many vocabulary rows
    at the end of backward, so no dense V×D gradient exists (gradient release, one process,
    an elementwise chain; ``GradientRelease(..., tied_slabs=rows)``).  ``release_groups``
    (``"layer"`` or ``"parameter"``) is what steps together inside backward: a decoder layer's
    parameters, or each parameter as soon as its gradient exists (a layer's gradients then never
    all exist at once).  ``mlp_tiles`` (0: off) computes each decoder layer's gated MLP in that
    many token slices, forward and backward (``pgs.runtime.tiled_mlp``): the MLP's
    [tokens, intermediate] tensors never exist whole.
    """

    section: ClassVar[str] = "memory"

    gradient_release: bool = attrs.field(default=False, validator=_bool)
    activation_checkpointing: str = attrs.field(default="none", validator=_one_of(CHECKPOINT_POLICIES))
    checkpoint_every: int = attrs.field(default=1, validator=_int_at_least(1))
    compile_layers: bool = attrs.field(default=False, validator=_bool)
    liger: bool = attrs.field(default=False, validator=_bool)
    master_weights: str = attrs.field(default="none", validator=_one_of(MASTER_WEIGHTS))
    stochastic_rounding: bool = attrs.field(default=False, validator=_bool)
    defer_head_grad: bool = attrs.field(default=True, validator=_bool)
    offload_checkpoints: bool = attrs.field(default=False, validator=_bool)
    tied_slabs: int = attrs.field(default=0, validator=_int_at_least(0))
    release_groups: str = attrs.field(default="layer", validator=_one_of(RELEASE_GROUPS))
    mlp_tiles: int = attrs.field(default=0, validator=_int_at_least(0))


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
}


@attrs.frozen
class Spec:
    """A checked run spec; paths are absolute.  ``source`` is the file it came from."""

    model: ModelSpec
    data: DataConfig
    optimizer: OptimizerSpec = attrs.field(factory=OptimizerSpec)
    schedule: ScheduleSpec = attrs.field(factory=ScheduleSpec)
    loss: LossSpec = attrs.field(factory=LossSpec)
    train: TrainSpec = attrs.field(factory=TrainSpec)
    checkpoint: CheckpointSpec = attrs.field(factory=CheckpointSpec)
    log: LogSpec = attrs.field(factory=LogSpec)
    memory: MemorySpec = attrs.field(factory=MemorySpec)
    source: str | None = attrs.field(default=None, eq=False)

    @property
    def run_dir(self) -> str:
        """The run's folder (``checkpoint.dir``)."""
        return self.checkpoint.dir

    def total_steps(self, steps_per_epoch: int | None = None) -> int:
        """Optimizer steps of the whole run: ``train.steps``, or ``epochs × steps_per_epoch``."""
        if self.train.steps is not None:
            return self.train.steps
        if steps_per_epoch is None:
            raise SpecError("train.epochs: the number of steps is known only once the data is counted")
        return self.train.epochs * steps_per_epoch

    def build_schedule(self, total_steps: int | None = None):
        """The ``[schedule]`` as a ``pgs.func`` schedule; ``total = 0`` becomes ``total_steps``."""
        from pgs.runtime.spec_chain import build_schedule

        return build_schedule(self, total_steps)

    def build_chain(self, total_steps: int | None = None, schedule=None):
        """The ``[optimizer]`` as one pure ``pgs.func.Transform`` (learning rate = the schedule)."""
        from pgs.runtime.spec_chain import build_chain

        return build_chain(self, total_steps, schedule)

    def build_optimizer(self, total_steps: int | None = None):
        """``build_chain``, run through ``pf.compile(jit=optimizer.jit)`` when ``optimizer.compile``."""
        chain = self.build_chain(total_steps)
        if not self.optimizer.compile:
            return chain
        import pgs.func as pf

        return pf.compile(chain, jit=self.optimizer.jit)

    def build_objective(self):
        """The ``[loss]`` objective instance (``pgs.func.losses``), with ``loss.args``."""
        from pgs.runtime.spec_chain import build_objective

        return build_objective(self.loss)

    def to_dict(self) -> dict:
        """The spec as plain TOML-ready data (None fields left out)."""
        out = {name: _section_dict(getattr(self, name)) for name in SECTIONS}
        if self.optimizer.chain is not None:  # alias-only fields would not reload
            del out["optimizer"]["args"], out["optimizer"]["clip"]
        used = ("name",) + ScheduleSpec.USES[self.schedule.name]
        out["schedule"] = {k: v for k, v in out["schedule"].items() if k in used}
        return out

    def to_toml(self, path: str | os.PathLike | None = None) -> str:
        """The resolved spec as TOML text (written to ``path`` when given; reloads equal)."""
        header = "# resolved by pgs" + (f" from {self.source}" if self.source else "") + "\n"
        text = header + dumps(self.to_dict())
        if path is not None:
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        return text


def _section_dict(section) -> dict:
    out: dict[str, Any] = {}
    for field in attrs.fields(type(section)):
        value = getattr(section, field.name)
        if value is None:
            continue
        if field.name == "sources":
            value = [attrs.asdict(s) for s in value]
        elif field.name == "chain":
            value = [{"name": e.name, **e.args} for e in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[field.name] = value
    return out


# --------------------------------------------------------------------------- loading


_SEGMENT = re.compile(r"^([A-Za-z0-9_\-]+)(?:\[(\d+)\])?$")

#: Setting one of these on the command line drops the other from the file (the command line wins);
#: likewise a new ``schedule.name`` drops the file's fields that the new schedule does not read.
_EXCLUSIVE = {
    ("optimizer", "alias"): ("optimizer", "chain"),
    ("optimizer", "chain"): ("optimizer", "alias"),
    ("train", "steps"): ("train", "epochs"),
    ("train", "epochs"): ("train", "steps"),
    ("model", "path"): ("model", "config"),
    ("model", "config"): ("model", "path"),
}


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one ``dotted.key[index].key=value`` to the parsed spec tables, in place."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.steps=20")
    value = parse_value(text.strip())
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        m = _SEGMENT.match(part)
        if not m:
            raise SpecError(f"--set {key}: {part!r} is not a key name")
        name, index = m.group(1), m.group(2)
        last = depth == len(parts) - 1
        if not isinstance(node, dict):
            raise SpecError(f"--set {key}: {'.'.join(parts[:depth])} is not a table")
        if index is None:
            if last:
                node[name] = value
            else:
                node = node.setdefault(name, {})
            continue
        items = node.get(name)
        if not isinstance(items, list) or int(index) >= len(items):
            size = len(items) if isinstance(items, list) else 0
            raise SpecError(f"--set {key}: {'.'.join(parts[:depth] + [name])} has {size} entries, no [{index}]")
        if last:
            items[int(index)] = value
        else:
            node = items[int(index)]
    if len(parts) == 2:
        other = _EXCLUSIVE.get((parts[0], parts[1]))
        if other and isinstance(raw.get(other[0]), dict):
            raw[other[0]].pop(other[1], None)
    if key == "schedule.name" and value in ScheduleSpec.USES:  # drop what the new schedule does not read
        used = ("name",) + ScheduleSpec.USES[value]
        raw["schedule"] = {k: v for k, v in raw["schedule"].items() if k in used}


def resolve_path(value: str, base: Path) -> str:
    """``pgs:x`` -> the bundled asset ``x``; relative -> relative to ``base``; ``~`` expanded."""
    if value.startswith(ASSET_PREFIX):
        return str(ASSETS_DIR / value[len(ASSET_PREFIX):])
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _check_keys(table: dict, cls: type, where: str, extra: tuple[str, ...] = ()) -> None:
    names = [f.name for f in attrs.fields(cls)] + list(extra)
    for key in table:
        if key not in names:
            raise SpecError(f"{where}.{key}: unknown key{suggest(key, names)}")


def _require_table(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a table, got {_describe(value)}")
    return value


def _must_exist(path: str, where: str, kind: str = "file") -> None:
    if not os.path.exists(path):
        raise SpecError(f"{where}: no such {kind}: {path}")
    if kind == "file" and os.path.isdir(path):
        raise SpecError(f"{where}: {path} is a folder, expected a file")
    if kind == "folder" and not os.path.isdir(path):
        raise SpecError(f"{where}: {path} is a file, expected a folder")


def _model(table: dict, base: Path) -> ModelSpec:
    _check_keys(table, ModelSpec, "model")
    t = dict(table)
    if isinstance(t.get("freeze"), list):
        t["freeze"] = tuple(t["freeze"])
    spec = ModelSpec(**t)
    if (spec.path is None) == (spec.config is None):
        both = "both are set" if spec.path is not None else "neither is set"
        raise SpecError(f"model: set exactly one of model.path (a local Hugging Face folder) or "
                        f"model.config (random init); {both}")
    path = tokenizer = None
    if spec.path is not None:
        path = resolve_path(spec.path, base)
        _must_exist(path, "model.path", "folder")
        _must_exist(os.path.join(path, "config.json"), "model.path")
    else:
        cfg = spec.config
        if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
            raise SpecError("model.config.model_type: needed (a string such as \"qwen3\") to pick the architecture")
        vocab = cfg.get("vocab_size", 0)
        if not _is_int(vocab) or vocab < 0:
            raise SpecError(f"model.config.vocab_size: expected an integer >= 0 (0 = the tokenizer's size), "
                            f"got {_describe(vocab)}")
        if spec.tokenizer is None:
            raise SpecError("model.tokenizer: needed when the model comes from model.config "
                            "(e.g. tokenizer = \"pgs:quickstart/tokenizer\")")
    tokenizer = resolve_path(spec.tokenizer, base) if spec.tokenizer is not None else path
    _must_exist(tokenizer, "model.tokenizer", "folder")
    return attrs.evolve(spec, path=path, tokenizer=tokenizer)


def _data(table: dict, base: Path) -> DataConfig:
    _check_keys(table, DataConfig, "data")
    t = dict(table)
    if "sources" not in t:
        raise SpecError("data.sources: needed, e.g. sources = [{ path = \"train.jsonl\" }]")
    sources = t["sources"]
    if isinstance(sources, (str, dict)):
        sources = [sources]
    if not isinstance(sources, list):
        raise SpecError(f"data.sources: expected an array of tables, got {_describe(sources)}")
    if not sources:
        raise SpecError("data.sources: at least one source is needed")
    resolved = []
    for i, src in enumerate(sources):
        where = f"data.sources[{i}]"
        if isinstance(src, str):
            src = {"path": src}
        if not isinstance(src, dict):
            raise SpecError(f"{where}: expected a table such as {{ path = \"train.jsonl\" }}, got {_describe(src)}")
        _check_keys(src, DataSource, where)
        if not isinstance(src.get("path"), str) or not src["path"]:
            raise SpecError(f"{where}.path: expected a file path, got {_describe(src.get('path'))}")
        try:
            source = DataSource(**{**src, "path": resolve_path(src["path"], base)})
        except SpecError as err:
            msg = str(err)
            prefix = "data.sources" if msg.startswith("data.sources") else "data"
            raise SpecError(where + msg[len(prefix):]) from None
        _must_exist(source.path, f"{where}.path")
        resolved.append(source)
    t["sources"] = tuple(resolved)
    if isinstance(t.get("eval"), str) and t["eval"]:
        t["eval"] = resolve_path(t["eval"], base)
        _must_exist(t["eval"], "data.eval")
    elif t.get("eval") == "":
        t["eval"] = None
    return DataConfig(**t)


def _optimizer(table: dict) -> OptimizerSpec:
    _check_keys(table, OptimizerSpec, "optimizer")
    t = dict(table)
    if "chain" in t:
        chain = t["chain"]
        if not isinstance(chain, list) or not chain:
            raise SpecError("optimizer.chain: expected a non-empty array of tables such as "
                            "{ name = \"scale_by_adam\", b2 = 0.95 }")
        entries = []
        for i, item in enumerate(chain):
            if not isinstance(item, dict):
                raise SpecError(f"optimizer.chain[{i}]: expected a table with a name, got {_describe(item)}")
            if not isinstance(item.get("name"), str):
                raise SpecError(f"optimizer.chain[{i}].name: needed (the pgs.func transform, e.g. \"scale_by_adam\")")
            args = {k: v for k, v in item.items() if k != "name"}
            entries.append(ChainEntry(item["name"], args))
        t["chain"] = tuple(entries)
    spec = OptimizerSpec(**t)
    if spec.alias is not None and spec.chain is not None:
        raise SpecError("optimizer: set either alias or chain, not both")
    if spec.alias is None and spec.chain is None:
        spec = attrs.evolve(spec, alias="adamw")
    if spec.chain is not None:
        if spec.args:
            raise SpecError("optimizer.args: only for an alias; a chain entry takes its arguments inline")
        if "clip" in table:
            raise SpecError("optimizer.clip: only for an alias; add { name = \"clip_by_global_norm\", "
                            "max_norm = ... } to the chain instead")
    return spec


def _section(name: str, table: dict):
    cls = SECTIONS[name]
    _check_keys(table, cls, name)
    return cls(**table)


def spec_from_dict(raw: dict, base: str | os.PathLike, source: str | None = None) -> Spec:
    """A checked :class:`Spec` from parsed TOML tables; relative paths are relative to ``base``."""
    base = Path(base).resolve()
    for key, value in raw.items():
        if key not in SECTIONS:
            raise SpecError(f"{key}: unknown section{suggest(key, SECTIONS)}")
        _require_table(value, key)
    for required in ("model", "data"):
        if required not in raw:
            raise SpecError(f"{required}: the [{required}] section is needed")
    sections = {
        "model": _model(raw["model"], base),
        "data": _data(raw["data"], base),
        "optimizer": _optimizer(raw.get("optimizer", {})),
    }
    for name in ("schedule", "loss", "train", "checkpoint", "log", "memory"):
        sections[name] = _section(name, raw.get(name, {}))
    train = sections["train"]
    if train.steps is not None and train.epochs is not None:
        raise SpecError("train: set either steps or epochs, not both")
    if train.steps is None and train.epochs is None:
        raise SpecError("train.steps: needed (or train.epochs = N)")
    if train.batch_size % train.grad_accum:
        raise SpecError(f"train.grad_accum: {train.grad_accum} does not divide train.batch_size = {train.batch_size}")
    world = launch_world_size()
    if world > 1:
        check_world_size(train, world)
    ckpt = sections["checkpoint"]
    sections["checkpoint"] = attrs.evolve(ckpt, dir=resolve_path(ckpt.dir, base))
    _check_schedule_fields(sections["schedule"], raw.get("schedule", {}))
    spec = Spec(**sections, source=source)

    from pgs.runtime.spec_chain import check_spec

    check_spec(spec)
    return spec


def launch_world_size() -> int:
    """The number of processes a launcher started (``$WORLD_SIZE`` under torchrun), else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_world_size(train: TrainSpec, world: int) -> None:
    """The global ``train.batch_size`` must split into ``grad_accum`` micro-batches on each of ``world`` ranks."""
    if world > 1 and train.batch_size % (train.grad_accum * world):
        raise SpecError(
            f"train.batch_size: {train.batch_size} sequences per step do not split evenly over "
            f"{world} processes x train.grad_accum = {train.grad_accum} micro-batches; use a multiple of "
            f"{train.grad_accum * world} (batch_size is global: each rank gets batch_size / (grad_accum x processes) rows)")


def _check_schedule_fields(schedule: ScheduleSpec, table: dict) -> None:
    used = ScheduleSpec.USES[schedule.name]
    for key in table:
        if key != "name" and key not in used:
            raise SpecError(f"schedule.{key}: not used by the {schedule.name} schedule "
                            f"(it reads {', '.join(used)})")


def load_spec(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Spec:
    """Read, override (``--set``), check and resolve the spec file at ``path``."""
    raw = read_toml(path)
    for assignment in overrides:
        apply_override(raw, assignment)
    return spec_from_dict(raw, Path(path).resolve().parent, source=str(Path(path).resolve()))
