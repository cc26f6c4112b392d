"""Public data configuration: what to read, how to cut it, how to pack it.

Plain attrs classes, so that the spec loader can build them from a TOML ``[data]`` table and
a checkpoint can record them.  Validators say which field is wrong and what was expected.
"""

from __future__ import annotations

import attrs

from pgs.errors import SpecError

FORMATS = ("auto", "messages", "sharegpt", "prompt_completion", "text")
TRUNCATION_POLICIES = ("drop", "truncate")
BAD_RECORD_POLICIES = ("error", "skip")
#: Roles whose turns can be trained (``data.train_roles``); the assistant's always are.
TRAIN_ROLES = ("assistant", "tool")


def _one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            raise SpecError(
                f"data.{attribute.name}: {value!r} is not one of {', '.join(map(repr, choices))}"
            )

    return check


def _positive_weight(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SpecError(f"data.sources.weight: expected a number > 0, got {value!r}")


def _path(instance, attribute, value):
    if not isinstance(value, str) or not value:
        raise SpecError(f"data.{attribute.name}: expected a file path, got {value!r}")


def _optional_path(instance, attribute, value):
    if value is not None:
        _path(instance, attribute, value)


def _optional_field(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"data.sources.{attribute.name}: expected a column name, got {value!r}")


@attrs.frozen
class DataSource:
    """One data file (JSONL, JSON array, Parquet, Arrow) or ``datasets`` folder, and its share of
    the training mix (``weight`` is relative to the others).

    The ``*_field`` names say which column holds what when a dataset names it otherwise
    (``messages_field = "conversation"``); unset, the usual names are looked for.
    ``eval``: this source's own held-out file; its eval loss is logged as ``eval_loss_<name>``
    at every evaluation (and mSFT, ``data.msft_round``, needs one per source).
    """

    path: str = attrs.field(converter=lambda p: str(p) if p is not None else p, validator=_path)
    format: str = attrs.field(default="auto", validator=_one_of(FORMATS))
    weight: float = attrs.field(default=1.0, validator=_positive_weight)
    eval: str | None = attrs.field(default=None, validator=_optional_path)
    messages_field: str | None = attrs.field(default=None, validator=_optional_field)
    tools_field: str | None = attrs.field(default=None, validator=_optional_field)
    prompt_field: str | None = attrs.field(default=None, validator=_optional_field)
    completion_field: str | None = attrs.field(default=None, validator=_optional_field)
    text_field: str | None = attrs.field(default=None, validator=_optional_field)

    def fields(self) -> dict[str, str]:
        """The renamed columns: ``{usual name: this source's column}``."""
        named = {"messages": self.messages_field, "tools": self.tools_field, "prompt": self.prompt_field,
                 "completion": self.completion_field, "text": self.text_field}
        return {k: v for k, v in named.items() if v is not None}


def _sources(value) -> tuple[DataSource, ...]:
    if isinstance(value, (str, DataSource)) or hasattr(value, "__fspath__"):
        value = [value]
    out = []
    for item in value:
        if isinstance(item, DataSource):
            out.append(item)
        elif isinstance(item, dict):
            out.append(DataSource(**item))
        else:
            out.append(DataSource(path=str(item)))
    if not out:
        raise SpecError("data.sources: at least one source is needed")
    return tuple(out)


def _train_roles(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, str) for r in value):
        raise SpecError(f"data.train_roles: expected an array of role names, got {value!r}")
    for role in value:
        if role not in TRAIN_ROLES:
            raise SpecError(f"data.train_roles: {role!r} is not one of {', '.join(map(repr, TRAIN_ROLES))}")
    if "assistant" not in value:
        raise SpecError("data.train_roles: must include \"assistant\" (the turns the model learns to write)")
    return tuple(r for r in TRAIN_ROLES if r in value)


def _positive_int(minimum: int):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"data.{attribute.name}: expected an integer >= {minimum}, got {value!r}")

    return check


@attrs.frozen
class DataConfig:
    """Everything the data pipeline needs besides the tokenizer.

    ``truncation``: a sample longer than ``max_seq_len`` is dropped (``"drop"``) or cut to
    ``max_seq_len`` tokens (``"truncate"``); both are counted.  ``on_bad_record``: a malformed
    record raises ``DataError`` (``"error"``) or is skipped and counted (``"skip"``).
    ``allow_packing_leakage`` lets a model whose layers cannot isolate packed documents
    (linear attention) train on packs anyway.  ``chat_template`` replaces the tokenizer's chat
    template (docs/data.md).  ``train_roles``: the roles whose turns are trained;
    ``["assistant", "tool"]`` also trains the tool results (ECHO, docs/data.md).
    ``msft_round``: steps per mSFT round (arXiv 2603.21606, ``pgs.runtime.loop.msft``; 0: off).
    """

    sources: tuple[DataSource, ...] = attrs.field(converter=_sources)
    eval: str | None = attrs.field(default=None, validator=_optional_path)
    max_seq_len: int = attrs.field(default=2048, validator=_positive_int(2))
    packing: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    truncation: str = attrs.field(default="drop", validator=_one_of(TRUNCATION_POLICIES))
    on_bad_record: str = attrs.field(default="error", validator=_one_of(BAD_RECORD_POLICIES))
    last_turn_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    supervise_empty_think: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    seed: int = attrs.field(default=0, validator=_positive_int(0))
    train_roles: tuple[str, ...] = attrs.field(default=("assistant",), converter=_train_roles)
    msft_round: int = attrs.field(default=0, validator=_positive_int(0))
    allow_packing_leakage: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    #: a Jinja file, or the name of a training template pgs ships, that replaces the tokenizer's
    #: chat template (``pgs.runtime.data.templates``); the spec loader resolves it to a file
    chat_template: str | None = attrs.field(default=None, validator=_optional_path)

    def check(self, spec) -> None:
        """mSFT rounds (``msft_round``) need an eval file per source and evaluations inside each round."""
        c = self.msft_round
        if not c:
            return
        missing = [i for i, s in enumerate(self.sources) if s.eval is None]
        if missing:
            raise SpecError(f"data.msft_round: every source needs its own eval file "
                            f"(data.sources[{missing[0]}].eval is not set)")
        if not 0 < spec.train.eval_every <= c:
            raise SpecError(f"data.msft_round = {c}: train.eval_every must be in 1..{c} "
                            f"(each round needs evaluations to find each source's best step)")
        if spec.preference is not None:
            raise SpecError("data.msft_round: mSFT rounds are for SFT; a [preference] run has none")
