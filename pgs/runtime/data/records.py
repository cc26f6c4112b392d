"""Reading JSONL conversations: three shapes in, one shape out.

Accepted record shapes (one JSON object per line):

* ``messages`` (OpenAI): ``{"messages": [{"role", "content", "tool_calls"?, "name"?}], "tools"?}``
  with roles ``system``, ``user``, ``assistant``, ``tool``;
* ``sharegpt``: ``{"conversations": [{"from", "value"}]}`` (``human``/``gpt``/``system``/``tool``...);
* ``prompt_completion``: ``{"prompt": str, "completion": str}``.

Each becomes a :class:`Conversation` (messages in the OpenAI shape plus optional tools).
Keys a record does not need are ignored, so metadata may ride along.  Every problem is a
``DataError`` whose message is one line: ``file:line: problem``.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import attrs

from pgs.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}


@attrs.frozen
class Conversation:
    """A validated conversation and where it came from (``origin`` is ``file:line``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    origin: str


class RecordProblem(ValueError):
    """A problem with one record; the reader adds file:line and turns it into DataError."""


def json_reason(err: ValueError) -> str:
    """The whole reason of a decoding error, with where it happened: ``json``'s ``msg`` alone is
    cut (``"Invalid control character at"``), its ``str`` counts lines of a one-line record."""
    if isinstance(err, json.JSONDecodeError):
        where = f"line {err.lineno} column {err.colno}" if err.lineno > 1 else f"column {err.colno}"
        reason = err.msg[:-3] if err.msg.endswith(" at") else err.msg
        found = err.doc[err.pos:err.pos + 1] if 0 <= err.pos < len(err.doc) else ""
        if found and (not found.isprintable() or found.isspace()):
            reason += f" {found!r}"  # a raw tab or newline inside a string: name it
        return f"{reason} at {where}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def detect_format(record: dict) -> str:
    """Which shape a parsed record has (``messages``, ``sharegpt`` or ``prompt_completion``)."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    raise RecordProblem(
        "unknown record shape: expected a 'messages', 'conversations' or 'prompt'/'completion' key"
    )


def _tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise RecordProblem(f"{where}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordProblem(f"{where}: a tool call needs function.name (a string)")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        # Templates render arguments with tojson; a JSON string would be double-encoded.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise RecordProblem(f"{where}: tool call arguments are not valid JSON ({json_reason(err)})") from None
    if not isinstance(arguments, dict):
        raise RecordProblem(f"{where}: tool call arguments must be an object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message(raw: Any, index: int) -> dict:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise RecordProblem(f"{where}: expected an object, got {type(raw).__name__}")
    if "role" not in raw:
        raise RecordProblem(f"{where}: missing 'role'")
    role = raw["role"]
    if role not in ROLES:
        raise RecordProblem(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    content = raw.get("content")
    tool_calls = raw.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise RecordProblem(f"{where}: only assistant messages may carry tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise RecordProblem(f"{where}: tool_calls must be a list")
    if content is None and tool_calls:
        content = ""
    if not isinstance(content, str):
        got = "missing" if content is None else type(content).__name__
        raise RecordProblem(f"{where} ({role}): content must be a string, got {got}")
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = [_tool_call(c, f"{where} tool_calls[{i}]") for i, c in enumerate(tool_calls)]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in raw and raw[key] is not None:
            if not isinstance(raw[key], str):
                raise RecordProblem(f"{where}: {key} must be a string")
            message[key] = raw[key]
    return message


def _messages_record(record: dict) -> tuple[list[Any], Any]:
    return record["messages"], record.get("tools")


def _sharegpt_record(record: dict) -> tuple[list[Any], Any]:
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise RecordProblem("'conversations' must be a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordProblem(f"turn {i}: expected an object, got {type(turn).__name__}")
        if "from" not in turn:
            raise RecordProblem(f"turn {i}: missing 'from'")
        speaker = turn["from"]
        if speaker not in SHAREGPT_ROLES:
            raise RecordProblem(
                f"turn {i}: unknown speaker {speaker!r} (expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return messages, record.get("tools")


def _prompt_completion_record(record: dict) -> tuple[list[Any], Any]:
    for key in ("prompt", "completion"):
        if key not in record:
            raise RecordProblem(f"missing '{key}'")
        if not isinstance(record[key], str):
            raise RecordProblem(f"'{key}' must be a string, got {type(record[key]).__name__}")
    messages = []
    if isinstance(record.get("system"), str):
        messages.append({"role": "system", "content": record["system"]})
    messages += [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]
    return messages, None


_SHAPES = {
    "messages": _messages_record,
    "sharegpt": _sharegpt_record,
    "prompt_completion": _prompt_completion_record,
}


def parse_record(record: Any, format: str = "auto") -> tuple[list[dict], list[dict] | None]:
    """Validate one decoded JSON record; returns ``(messages, tools)`` or raises RecordProblem."""
    if not isinstance(record, dict):
        raise RecordProblem(f"expected a JSON object per line, got {type(record).__name__}")
    shape = detect_format(record) if format == "auto" else format
    if shape == "messages" and "messages" not in record:
        raise RecordProblem("missing 'messages' (source format is 'messages')")
    if shape == "sharegpt" and "conversations" not in record:
        raise RecordProblem("missing 'conversations' (source format is 'sharegpt')")
    raw_messages, tools = _SHAPES[shape](record)
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RecordProblem("the conversation must be a non-empty list of messages")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordProblem("the conversation has no assistant turn (nothing to train on)")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RecordProblem("'tools' must be a list of objects")
    return messages, (tools or None)


def parse_line(line: str | bytes, origin: str, format: str = "auto") -> Conversation:
    """Decode and validate one JSONL line; ``DataError('file:line: problem')`` when it is bad."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{origin}: malformed JSON ({json_reason(err)})") from None
    try:
        messages, tools = parse_record(record, format)
    except RecordProblem as err:
        raise DataError(f"{origin}: {err}") from None
    return Conversation(messages=messages, tools=tools, origin=origin)


def iter_lines(path: str) -> Iterator[tuple[int, int, bytes]]:
    """Yield ``(line_number, byte_offset, raw_line)`` for each non-blank line, streaming."""
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None
    with handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield number, offset, raw
            offset += len(raw)


def read_conversations(
    path: str, format: str = "auto", on_bad_record: str = "error", skipped: list | None = None
) -> Iterator[Conversation]:
    """Stream the valid conversations of one JSONL file.

    With ``on_bad_record="skip"`` a bad record is left out and its ``DataError`` message is
    appended to ``skipped`` (when given), so nothing is lost silently.
    """
    for number, _, raw in iter_lines(path):
        try:
            yield parse_line(raw, f"{path}:{number}", format)
        except DataError as err:
            if on_bad_record != "skip":
                raise
            if skipped is not None:
                skipped.append(str(err))
