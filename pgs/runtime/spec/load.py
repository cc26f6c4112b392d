"""The run spec: one TOML file that says everything about a run (docs/spec.md).

``load_spec(path, overrides)`` reads the file, applies ``--set dotted.key=value`` overrides,
checks every field (unknown keys with a suggestion, types, ranges, conflicts, files that must
exist, transform names and their arguments) and returns a frozen :class:`Spec` whose paths are
absolute.  Nothing here touches a model or reads training data; ``pgs validate`` and ``pgs
run`` do that on top, through the same checks (``pgs.runtime.spec.preflight``).  Every problem is
a ``SpecError`` naming the dotted field.

Each section's typed config lives next to its component's code (``pgs.runtime.spec.sections``
says which is where, and re-exports them, as does this module); the rules that read several
sections are each section's ``check(spec)``, run here once the ``Spec`` is composed.  The
schedule builds itself from ``[schedule]`` (``ScheduleSpec.build``); building the optimizer
chain from ``[optimizer]`` and that schedule lives in ``chain.py``; ``Spec.build_schedule()``
and ``Spec.build_chain()`` are thin doors into them.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

import attrs

import pgs.func as pf
from pgs.errors import SpecError
from pgs.runtime import userpath
from pgs.runtime.data.config import DataConfig, DataSource
from pgs.runtime.data.templates import resolve_chat_template
from pgs.runtime.model.hub import parse as hub_name, resolve as resolve_hub
from pgs.runtime.spec.chain import build_chain, build_token_loss, check_spec
from pgs.runtime.spec.sections import (  # noqa: F401  (re-exported)
    ASSET_PREFIX,
    ASSETS_DIR,
    DTYPES,
    ATTN_IMPLEMENTATIONS,
    FREEZE_POLICIES,
    SCHEDULES,
    WSD_SHAPES,
    DEVICES,
    CHECKPOINT_POLICIES,
    MASTER_WEIGHTS,
    RELEASE_GROUPS,
    ModelSpec,
    ChainEntry,
    OptimizerSpec,
    ScheduleSpec,
    LossSpec,
    TrainSpec,
    CheckpointSpec,
    LogSpec,
    MemorySpec,
    MoESpec,
    ParallelSpec,
    PreferenceSpec,
    DistillSpec,
    AveragingSpec,
    EvalSpec,
    SECTIONS,
)
from pgs.runtime import process
from pgs.runtime.common import describe as _describe, is_int as _is_int, suggest
from pgs.runtime.spec.toml import dumps, parse_value, read_toml  # noqa: F401  (re-exported)



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
    moe: MoESpec = attrs.field(factory=MoESpec)
    parallel: ParallelSpec = attrs.field(factory=ParallelSpec)
    preference: PreferenceSpec | None = None  # a preference run (``[preference]``), else SFT
    distill: DistillSpec | None = None  # a distillation run (``[distill]``)
    averaging: AveragingSpec | None = None  # weight EMA / merge-back (``[averaging]``), else none
    eval: EvalSpec = attrs.field(factory=EvalSpec)  # what an evaluation adds (``[eval]``: samples)
    source: str | None = attrs.field(default=None, eq=False)
    #: hub names resolved to local snapshots, by field (``"model.path"``: ``model.hub.HubSource``)
    hub: dict = attrs.field(factory=dict, eq=False)

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
        """The ``[schedule]`` as a ``pgs.func`` schedule (``ScheduleSpec.build``); ``total = 0``
        becomes ``total_steps``, else ``train.steps``."""

        return self.schedule.build(total_steps or self.train.steps)

    def build_chain(self, total_steps: int | None = None):
        """The ``[optimizer]`` as one pure ``pgs.func.Transform`` whose learning rate is
        :meth:`build_schedule` (``pgs.runtime.spec.chain.build_chain``)."""

        return build_chain(self.optimizer, self.build_schedule(total_steps))

    def build_optimizer(self, total_steps: int | None = None):
        """``build_chain``, run through ``pf.compile(jit=optimizer.jit)`` when ``optimizer.compile``."""
        chain = self.build_chain(total_steps)
        if not self.optimizer.compile:
            return chain

        return pf.compile(chain, jit=self.optimizer.jit)

    def build_token_loss(self):
        """The ``[loss]`` token objective instance (``pgs.func.losses``), with ``loss.args``.
        (What a run trains, SFT or preference or distillation, is ``loop.objective.build_objective``.)"""

        return build_token_loss(self.loss)

    def to_dict(self) -> dict:
        """The spec as plain TOML-ready data (None fields left out)."""
        out = {name: _section_dict(getattr(self, name)) for name in SECTIONS if getattr(self, name) is not None}
        if self.optimizer.chain is not None:  # alias-only fields would not reload
            del out["optimizer"]["args"], out["optimizer"]["clip"]
        used = ("name",) + ScheduleSpec.USES[self.schedule.name]
        out["schedule"] = {k: v for k, v in out["schedule"].items() if k in used}
        # a hub snapshot as its name and commit, so that the resolved spec pins the revision
        refs = {source.path: source.ref for source in self.hub.values()}
        for section in ("model", "preference", "distill"):
            for key, value in (out.get(section) or {}).items():
                if isinstance(value, str) and value in refs:
                    out[section][key] = refs[value]
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
    ("distill", "teacher_path"): ("distill", "teacher_config"),
    ("distill", "teacher_config"): ("distill", "teacher_path"),
}


_CHAIN_ARG = re.compile(r"^optimizer\.chain\[(\d+)\]\.([A-Za-z0-9_\-]+)$")


def _swap_transform(raw: dict, key: str, value, given: dict[int, set[str]]) -> None:
    """``--set optimizer.chain[i].name=NEW``: a new transform starts from its own defaults.

    The replaced entry's other arguments belonged to the old transform (``min_8bit_size`` of
    ``scale_by_lion8bit`` means nothing to ``muon``); only those given on the same command
    line (``given[i]``) are kept.  The same name again changes nothing."""
    m = _CHAIN_ARG.match(key)
    if not m:
        return
    index, arg = int(m.group(1)), m.group(2)
    chain = raw.get("optimizer", {}).get("chain") if isinstance(raw.get("optimizer"), dict) else None
    entry = chain[index] if isinstance(chain, list) and index < len(chain) else None
    if arg != "name":
        given.setdefault(index, set()).add(arg)
    elif isinstance(entry, dict) and entry.get("name") != value:
        kept = {k: v for k, v in entry.items() if k in given.get(index, ())}
        entry.clear()
        entry.update(kept)


def apply_override(raw: dict, assignment: str, given: dict[int, set[str]] | None = None) -> None:
    """Apply one ``dotted.key[index].key=value`` to the parsed spec tables, in place.

    ``given``: the chain arguments set by earlier overrides of the same command line, by entry
    index (``load_spec`` passes one dict through all of them); a new ``optimizer.chain[i].name``
    keeps only those of the entry's arguments.
    """
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.steps=20")
    value = parse_value(text.strip())
    _swap_transform(raw, key, value, {} if given is None else given)
    if given is not None:  # a whole new chain or entry: no earlier argument of it applies
        if key == "optimizer.chain":
            given.clear()
        elif re.match(r"^optimizer\.chain\[\d+\]$", key):
            given.pop(int(key[len("optimizer.chain["):-1]), None)
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


def _construct(cls: type, table: dict, where: str):
    """``cls(**table)``; the ``TypeError`` of an attrs type check (``instance_of``: a string where
    a boolean goes) becomes one ``SpecError`` line naming the field."""
    try:
        return cls(**table)
    except TypeError as err:
        if len(err.args) == 4 and isinstance(err.args[1], attrs.Attribute):
            _, field, expected, value = err.args
            names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
            raise SpecError(f"{where}.{field.name}: expected {_TYPE_WORDS.get(names, names)}, "
                            f"got {_describe(value)}") from None
        raise


_TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


def _require_table(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a table, got {_describe(value)}")
    return value


def _must_exist(path: str, where: str, kind: str = "file", folder_ok: bool = False) -> None:
    """A path field must name a readable regular file (or folder): one line otherwise
    (``pgs.runtime.userpath``: special files, link loops, unreadable files included)."""
    why = userpath.problem(path, kind, folder_ok)
    if why == userpath.MISSING:
        raise SpecError(f"{where}: no such {kind}: {path}")
    if why == userpath.FOLDER:
        raise SpecError(f"{where}: {path} is a folder, expected a file")
    if why == userpath.FILE:
        raise SpecError(f"{where}: {path} is a file, expected a folder")
    if why is not None:
        raise SpecError(f"{where}: {path} is {why}")


#: ``model.tokenizer = "model"``: the model folder's own tokenizer (as leaving it out).
MODEL_TOKENIZER = "model"


def _folder(value: str, base: Path, field: str, hub: dict, kind: str = "model", trust_remote_code: bool = False) -> str:
    """A model (or tokenizer) folder of the spec: ``value`` resolved as a path, or, when no such
    path exists and ``value`` has the form of a hub name (``org/name[@revision]``), the local
    snapshot of that name in the Hugging Face cache (``pgs.runtime.model.hub``; recorded in
    ``hub[field]``)."""
    path = resolve_path(value, base)
    if value.startswith(ASSET_PREFIX) or os.path.exists(path) or hub_name(value) is None:
        return path
    source = resolve_hub(value, field, kind, trust_remote_code)
    hub[field] = source
    return source.path


def _model(table: dict, base: Path, hub: dict | None = None) -> ModelSpec:
    hub = {} if hub is None else hub
    _check_keys(table, ModelSpec, "model")
    t = dict(table)
    if isinstance(t.get("freeze"), list):
        t["freeze"] = tuple(t["freeze"])
    spec = _construct(ModelSpec, t, "model")
    if (spec.path is None) == (spec.config is None):
        both = "both are set" if spec.path is not None else "neither is set"
        raise SpecError(f"model: set exactly one of model.path (a local Hugging Face folder) or "
                        f"model.config (random init); {both}")
    path = tokenizer = None
    if spec.path is not None:
        path = _folder(spec.path, base, "model.path", hub, trust_remote_code=spec.trust_remote_code)
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
        if spec.tokenizer is None or spec.tokenizer == MODEL_TOKENIZER:
            raise SpecError("model.tokenizer: needed when the model comes from model.config "
                            "(e.g. tokenizer = \"pgs:quickstart/tokenizer\")")
    own = spec.tokenizer is None or spec.tokenizer == MODEL_TOKENIZER  # the model folder's own
    tokenizer = path if own else _folder(spec.tokenizer, base, "model.tokenizer", hub, "tokenizer",
                                         spec.trust_remote_code)
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
            source = _construct(DataSource, {**src, "path": resolve_path(src["path"], base)}, where)
        except SpecError as err:
            msg = str(err)
            prefix = "data.sources" if msg.startswith("data.sources") else "data"
            raise SpecError(where + msg[len(prefix):]) from None
        _must_exist(source.path, f"{where}.path", folder_ok=True)  # a datasets folder
        if source.eval is not None:
            source = attrs.evolve(source, eval=resolve_path(source.eval, base))
            _must_exist(source.eval, f"{where}.eval")
        resolved.append(source)
    t["sources"] = tuple(resolved)
    if isinstance(t.get("eval"), str) and t["eval"]:
        t["eval"] = resolve_path(t["eval"], base)
        _must_exist(t["eval"], "data.eval", folder_ok=True)
    elif t.get("eval") == "":
        t["eval"] = None
    if t.get("chat_template") is not None:
        t["chat_template"] = resolve_chat_template(t["chat_template"], base)
    return _construct(DataConfig, t, "data")


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
    spec = _construct(OptimizerSpec, t, "optimizer")
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
    return _construct(cls, table, name)


def spec_from_dict(raw: dict, base: str | os.PathLike, source: str | None = None) -> Spec:
    """A checked :class:`Spec` from parsed TOML tables; relative paths are relative to ``base``."""
    base = Path(base).resolve()
    check_numbers(raw)
    for key, value in raw.items():
        if key not in SECTIONS:
            raise SpecError(f"{key}: unknown section{suggest(key, SECTIONS)}")
        _require_table(value, key)
    for required in ("model", "data"):
        if required not in raw:
            raise SpecError(f"{required}: the [{required}] section is needed")
    hub: dict = {}
    sections = {
        "model": _model(raw["model"], base, hub),
        "data": _data(raw["data"], base),
        "optimizer": _optimizer(raw.get("optimizer", {})),
    }
    for name in ("schedule", "loss", "train", "checkpoint", "log", "memory", "moe", "parallel", "eval"):
        sections[name] = _section(name, raw.get(name, {}))
    if "preference" in raw:
        preference = _section("preference", raw["preference"])
        if preference.reference_path is not None:
            where = "preference.reference_path"
            path = _folder(preference.reference_path, base, where, hub,
                           trust_remote_code=sections["model"].trust_remote_code)
            _must_exist(path, where, "folder")
            preference = attrs.evolve(preference, reference_path=path)
        sections["preference"] = preference
    if "distill" in raw:
        if "preference" in raw:
            raise SpecError("distill: a run is either preference optimization ([preference]) or distillation "
                            "([distill]), not both")
        distill = _section("distill", raw["distill"])
        if distill.teacher_path is not None:
            path = _folder(distill.teacher_path, base, "distill.teacher_path", hub,
                           trust_remote_code=sections["model"].trust_remote_code)
            _must_exist(path, "distill.teacher_path", "folder")
            _must_exist(os.path.join(path, "config.json"), "distill.teacher_path")
            distill = attrs.evolve(distill, teacher_path=path)
        sections["distill"] = distill
    if "averaging" in raw:
        sections["averaging"] = _section("averaging", raw["averaging"])
    ckpt = sections["checkpoint"]
    if not isinstance(ckpt.dir, str) or not ckpt.dir.strip():  # "" would make the spec's own folder the run folder
        raise SpecError(f"checkpoint.dir: expected the run folder's path, got "
                        f"{'an empty string' if isinstance(ckpt.dir, str) else _describe(ckpt.dir)}")
    sections["checkpoint"] = attrs.evolve(ckpt, dir=resolve_path(ckpt.dir, base))
    if "preference" in sections and "best_metric" not in raw.get("checkpoint", {}):
        # a preference run's eval reports preference metrics, not eval_loss
        best = "eval_preference_accuracy" if sections["data"].eval else ""
        sections["checkpoint"] = attrs.evolve(sections["checkpoint"], best_metric=best)
    if "distill" in sections and "best_metric" not in raw.get("checkpoint", {}):
        # a distillation run's eval reports the teacher-student KL on held-out prompts
        best = "eval_distill_kl" if sections["data"].eval else ""
        sections["checkpoint"] = attrs.evolve(sections["checkpoint"], best_metric=best)
    spec = Spec(**sections, source=source, hub=hub)
    spec.train.check(spec)
    world = process.launch_world_size()
    if world > 1:
        check_world_size(spec.train, world, spec.parallel.context)
    _check_schedule_fields(spec.schedule, raw.get("schedule", {}))
    check_spec(spec)
    return spec


#: every integer in a spec fits in 64 bits (torch, numpy and the checkpoint's JSON take it as
#: such; a larger one used to hang the schedule's construction or raise deep in torch)
INT_RANGE = (-(2**63), 2**63 - 1)


def check_numbers(raw, where: str = "") -> None:
    """One check for every number of a spec, whatever its field: an integer within
    ``INT_RANGE``, a float finite (``inf`` or ``nan`` in a loss weight or a rate trains nothing,
    or nonsense).  ``where``: the dotted name of ``raw`` (the fields' own checks come later)."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            check_numbers(value, f"{where}.{key}" if where else str(key))
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            check_numbers(value, f"{where}[{i}]")
    elif isinstance(raw, int) and not isinstance(raw, bool) and not INT_RANGE[0] <= raw <= INT_RANGE[1]:
        raise SpecError(f"{where}: {raw} is out of range (a spec's integers fit in 64 bits, "
                        f"{INT_RANGE[0]}..{INT_RANGE[1]})")
    elif isinstance(raw, float) and not math.isfinite(raw):
        raise SpecError(f"{where}: {raw} is not a finite number")


def check_world_size(train: TrainSpec, world: int, context: int = 1) -> None:
    """The global ``train.batch_size`` must split into ``grad_accum`` micro-batches on each of the
    ``world / context`` data-parallel ranks (``context``: ranks that split each row, ``[parallel]``)."""
    if world % context:
        raise SpecError(f"parallel.context: {context} ranks per sequence do not divide {world} processes")
    world //= context
    if world > 1 and train.batch_size % (train.grad_accum * world):
        raise SpecError(
            f"train.batch_size: {train.batch_size} sequences per step do not split evenly over "
            f"{world} processes x train.grad_accum = {train.grad_accum} micro-batches; use a multiple of "
            f"{train.grad_accum * world} "
            "(batch_size is global: each rank gets batch_size / (grad_accum x processes) rows)")


def _check_schedule_fields(schedule: ScheduleSpec, table: dict) -> None:
    used = ScheduleSpec.USES[schedule.name]
    for key in table:
        if key != "name" and key not in used:
            raise SpecError(f"schedule.{key}: not used by the {schedule.name} schedule "
                            f"(it reads {', '.join(used)})")


def load_spec(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Spec:
    """Read, override (``--set``), check and resolve the spec file at ``path``."""
    raw = read_toml(path)
    given: dict[int, set[str]] = {}
    for assignment in overrides:
        apply_override(raw, assignment, given)
    return spec_from_dict(raw, Path(path).resolve().parent, source=str(Path(path).resolve()))
