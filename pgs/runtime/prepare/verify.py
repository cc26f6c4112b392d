"""Verifiers: does a generated answer deserve to be trained on?

A verifier is ``verify(answer, reference, record) -> bool``: ``answer`` is the generated
assistant message (``{"role": "assistant", "content", "tool_calls"?}``, parsed from the text
by :func:`parse_answer`), ``reference`` the record's own assistant message for that turn, and
``record`` the whole JSON record (metadata rides along).  Built in, by name:

* ``exact``: the same content once surrounding whitespace is stripped, and the same tool calls
  (names and arguments; JSON spacing does not matter);
* ``number``: the last number of the answer equals the last number of the reference
  (``1,234`` reads as 1234; equal within 1e-9 relative);
* ``regex:PATTERN``: ``re.search(PATTERN, content)`` finds a match (the reference is not used);
* ``json``: the content is one JSON value (a ```json fence around it is allowed);
* ``tool_call``: at least one tool call, each naming a function and giving an object of
  arguments; when the record lists ``tools``, the function is one of them and its required
  parameters are all given;
* ``module:function``: a function of the user's, imported from a module on ``sys.path`` and
  called as above. **This runs the user's code** in the ``pgs prepare`` process, with its
  permissions; name only modules you trust.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any, Callable

from pgs.errors import SpecError

Verifier = Callable[[dict, dict, dict], bool]

BUILTIN = ("exact", "number", "regex:PATTERN", "json", "tool_call")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def parse_answer(text: str, end_of_turn: str | None = None) -> dict:
    """A generated turn's text as an assistant message: everything up to ``end_of_turn``;
    ``<tool_call>{json}</tool_call>`` blocks (the Hermes/Qwen/ChatML convention) become
    ``tool_calls`` (a block that is not JSON stays in the content, so that validity checks
    see it fail), the rest is the content."""
    if end_of_turn:
        text = text.split(end_of_turn)[0]
    calls, bad = [], []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            bad.append(body)
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict):
            calls.append({"type": "function",
                          "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
        else:
            bad.append(body)
    content = _TOOL_CALL.sub(lambda m: m.group(0) if m.group(1) in bad else "", text).strip()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def _calls(message: dict) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], c["function"].get("arguments", {})) for c in message.get("tool_calls") or []]


def exact(answer: dict, reference: dict, record: dict) -> bool:
    return (answer.get("content") or "").strip() == (reference.get("content") or "").strip() and \
        _calls(answer) == _calls(reference)


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def number(answer: dict, reference: dict, record: dict) -> bool:
    got, want = last_number(answer.get("content", "")), last_number(reference.get("content", ""))
    if got is None or want is None:
        return False
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def json_valid(answer: dict, reference: dict, record: dict) -> bool:
    text = (answer.get("content") or "").strip()
    fenced = _FENCE.match(text)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except (json.JSONDecodeError, ValueError):
        return False
    return bool(text)


def tool_call(answer: dict, reference: dict, record: dict) -> bool:
    calls = answer.get("tool_calls") or []
    if not calls or _TOOL_CALL.search(answer.get("content") or ""):  # a block left unparsed
        return False
    tools = {}
    for tool in record.get("tools") or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            tools[fn["name"]] = fn.get("parameters") or {}
    for name, arguments in _calls(answer):
        if not isinstance(arguments, dict):
            return False
        if tools:
            if name not in tools:
                return False
            required = tools[name].get("required") or []
            if any(key not in arguments for key in required):
                return False
    return True


def regex(pattern: str) -> Verifier:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise SpecError(f"--verify regex:{pattern}: not a regular expression ({err})") from None
    return lambda answer, reference, record: compiled.search(answer.get("content") or "") is not None


def user_function(name: str) -> Verifier:
    """``module:function`` imported (this runs the module's code); one line when it cannot be."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any failure is theirs to read in one line
        raise SpecError(f"--verify {name}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError(f"--verify {name}: {module_name} has no function {attr!r}")
    return fn


def make_verifier(name: str) -> Verifier:
    """The verifier ``name`` names (module docstring)."""
    simple = {"exact": exact, "number": number, "json": json_valid, "tool_call": tool_call}
    if name in simple:
        return simple[name]
    if name.startswith("regex:"):
        return regex(name[len("regex:"):])
    module, colon, attr = name.partition(":")
    if colon and module and attr and re.fullmatch(r"[\w.]+", module) and attr.isidentifier():
        return user_function(name)
    raise SpecError(f"--verify: {name!r} is not one of {', '.join(BUILTIN)} or module:function")
