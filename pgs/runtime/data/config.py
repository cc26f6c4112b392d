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


def _optional_field(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"data.sources.{attribute.name}: expected a column name, got {value!r}")


@attrs.frozen
class DataSource:
    """One data file (JSONL, JSON array, Parquet, Arrow) or ``datasets`` folder, and its share of
    the training mix (``weight`` is relative to the others).

    The ``*_field`` names say which column holds what when a dataset names it otherwise
    (``messages_field = "conversation"``); unset, the usual names are looked for.
    """

    path: str = attrs.field(converter=lambda p: str(p) if p is not None else p, validator=_path)
    format: str = attrs.field(default="auto", validator=_one_of(FORMATS))
    weight: float = attrs.field(default=1.0, validator=_positive_weight)
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


def _positive_int(minimum: int):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"data.{attribute.name}: expected an integer >= {minimum}, got {value!r}")

    return check


def _optional_path(instance, attribute, value):
    if value is not None:
        _path(instance, attribute, value)


@attrs.frozen
class DataConfig:
    """Everything the data pipeline needs besides the tokenizer.

    ``truncation``: a sample longer than ``max_seq_len`` is dropped (``"drop"``) or cut to
    ``max_seq_len`` tokens (``"truncate"``); both are counted.  ``on_bad_record``: a malformed
    record raises ``DataError`` (``"error"``) or is skipped and counted (``"skip"``).
    ``allow_packing_leakage`` lets a model whose layers cannot isolate packed documents
    (linear attention) train on packs anyway.  ``chat_template`` replaces the tokenizer's chat
    template (docs/data.md).
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
    allow_packing_leakage: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    #: a Jinja file, or the name of a training template pgs ships, that replaces the tokenizer's
    #: chat template (``pgs.runtime.data.templates``); the spec loader resolves it to a file
    chat_template: str | None = attrs.field(default=None, validator=_optional_path)
