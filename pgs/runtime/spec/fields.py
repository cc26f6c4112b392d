"""Field checks shared by every section's typed config: each names the dotted field
(``<section>.<field>``) and what was expected in one ``SpecError`` line."""

from __future__ import annotations

import math

from pgs.errors import SpecError
from pgs.runtime.common import describe, is_int, suggest  # noqa: F401 - the checks' shared words, re-exported


def where(instance, attribute) -> str:
    return f"{type(instance).section}.{attribute.name}"


def expect(kind: str, ok):
    def check(instance, attribute, value):
        if not ok(value):
            raise SpecError(f"{where(instance, attribute)}: expected {kind}, got {describe(value)}")

    return check


def is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and not math.isnan(v)


def int_at_least(lo: int):
    return expect(f"an integer >= {lo}", lambda v: is_int(v) and v >= lo)


def number_in(lo: float, hi: float = math.inf):
    where = f"a number >= {lo}" if hi == math.inf else f"a number in [{lo}, {hi}]"
    return expect(where, lambda v: is_number(v) and lo <= v <= hi)


def one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            options = ", ".join(map(repr, choices))
            hint = suggest(value, choices) if isinstance(value, str) else ""
            raise SpecError(f"{where(instance, attribute)}: {value!r} is not one of {options}{hint}")

    return check


boolean = expect("true or false", lambda v: isinstance(v, bool))
string = expect("a string", lambda v: isinstance(v, str))
table = expect("a table", lambda v: isinstance(v, dict))


def to_float(v):
    """TOML ``peak = 1`` is an integer; number fields keep floats."""
    return float(v) if is_int(v) else v


