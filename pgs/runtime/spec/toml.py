"""TOML in and out for specs: reading with file:line errors, ``--set`` values, and a writer.

The writer covers what ``Spec.to_toml`` needs (tables of scalars, arrays and inline tables)
so that ``spec.resolved.toml`` round-trips through ``tomllib`` without a new dependency.
"""

from __future__ import annotations

import math
import os
import re
import tomllib

from pgs.errors import SpecError
from pgs.runtime import userpath


def read_toml(path: str | os.PathLike) -> dict:
    """Parse a TOML file; a syntax error becomes ``SpecError('file:line: ...')``, and a path
    that is not a readable regular file (``pgs.runtime.userpath``) one line naming it."""
    why = userpath.problem(path)
    if why not in (None, userpath.MISSING, userpath.FOLDER):  # those two have their lines below
        raise SpecError(f"{path}: {why}; expected a spec file (.toml)")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a folder, expected a spec file (.toml)") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not UTF-8 text ({err.reason})") from None
    except tomllib.TOMLDecodeError as err:
        text = str(err)
        m = re.search(r"\(at line (\d+), column (\d+)\)", text)
        msg = text[: m.start()].strip() if m else text
        where = f"{path}:{m.group(1)}:{m.group(2)}" if m else f"{path}"
        if not m and "end of document" in text:
            where = f"{path}:end"
        raise SpecError(f"{where}: invalid TOML: {msg}") from None


def parse_value(text: str):
    """A ``--set`` value as TOML (``20``, ``"lion"``, ``[1, 2]``, ``{a = 1}``); a bare word is a string."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        if text and not any(c in text for c in "[]{}\"'=\n"):
            return text
        raise SpecError(f"--set: cannot read {text!r} as a TOML value (quote strings: 'key=\"text\"')") from None
    if list(parsed) != ["v"]:  # "1500\nseed = 3": one value, then more TOML that would be dropped
        raise SpecError(f"--set: {text!r} is more than one TOML value (a line break?); give each field its "
                        "own --set KEY=VALUE")
    return parsed["v"]


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise SpecError(f"cannot write {type(v).__name__} {v!r} as TOML")


def dumps(tables: dict[str, dict]) -> str:
    """TOML text for ``{section: {key: value}}``: one ``[section]`` each, inline nested values."""
    lines: list[str] = []
    for name, table in tables.items():
        lines.append(f"[{_key(name)}]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)
