"""Reading records: every common shape in, one shape out.

Accepted record shapes (one JSON object per JSONL line, per JSON array item, per Parquet or
Arrow row):

* ``messages`` (OpenAI): ``{"messages": [{"role", "content", "tool_calls"?, "name"?,
  "tool_call_id"?, "reasoning_content"?, "weight"?}], "tools"?}`` with roles ``system``,
  ``developer`` (read as ``system``), ``user``, ``assistant``, ``tool``.  ``content`` is a string
  or a list of content parts: text parts are joined, any other part (an image, audio, a file) is
  refused.  Tool-call ``arguments`` are an object or a JSON string.  ``weight`` (0 or 1, as TRL
  and axolotl data carry it) leaves an assistant turn untrained when 0;
* ``sharegpt``: ``{"conversations": [{"from", "value", "weight"?}]}``
  (``human``/``gpt``/``system``/``tool``...);  a ``messages`` or ``conversations`` list is read
  by its items' keys (``role`` or ``from``), whichever name it has;
* ``prompt_completion``: ``{"prompt", "completion"}``, each a string or a list of messages
  (TRL's conversational prompt-completion), with an optional ``system`` string;
* ``text``: ``{"text": str}``, a document trained whole (no chat template).

A source may name its columns otherwise (``messages_field = "conversation"``, ...): the named
column is read as the usual one.  Each record becomes a :class:`Conversation`.  Keys a record
does not need are ignored, so metadata may ride along.  Every problem is a ``DataError`` whose
message is one line: ``origin: problem``, where the origin is ``file:line`` (JSONL),
``file:item N`` (JSON arrays) or ``file:row N`` (Parquet, Arrow, ``datasets`` folders).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import attrs

from pgs.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system prompt
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
    """A validated conversation and where it came from (``origin`` is ``file:line``, ``file:row N``
    or ``file:item N``).  A ``text`` record is a document with no messages: ``text`` holds it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    origin: str
    text: str | None = None

    @property
    def content(self):
        """What the chat encoder takes: the messages, or the text of a document."""
        return self.text if self.text is not None else self.messages


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


def _list_shape(key: str, turns: Any) -> str:
    """A conversation list's shape by its turns' keys (``role``: messages, ``from``: ShareGPT);
    by its own name (``conversations``: ShareGPT) when the first turn has neither."""
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        if "role" in turns[0]:
            return "messages"
        if "from" in turns[0]:
            return "sharegpt"
    return "sharegpt" if key == "conversations" else "messages"


def detect_format(record: dict) -> str:
    """Which shape a parsed record has (``messages``, ``sharegpt``, ``prompt_completion``, ``text``)."""
    for key in ("messages", "conversations"):
        if key in record:
            return _list_shape(key, record[key])
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise RecordProblem(
        "unknown record shape: expected a 'messages', 'conversations', 'prompt'/'completion' or 'text' key"
    )


def _tool_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise RecordProblem(f"{where}: a tool call must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RecordProblem(f"{where}: a tool call needs function.name (a non-empty string)")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        # Templates render arguments with tojson; a JSON string would be double-encoded.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise RecordProblem(f"{where}: tool call arguments are not valid JSON ({json_reason(err)})") from None
    if not isinstance(arguments, dict):
        got = "null" if arguments is None else type(arguments).__name__
        raise RecordProblem(f"{where}: tool call arguments must be an object or a JSON string of one, got {got}")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise RecordProblem(f"{where}: a tool call's id must be a string, got {type(call['id']).__name__}")
        out["id"] = call["id"]
    return out


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a list of content parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise RecordProblem(f"{where}: content[{j}] must be an object such as "
                                    f"{{\"type\": \"text\", \"text\": ...}}, got {type(part).__name__}")
            kind = part.get("type", "text" if "text" in part else None)
            if kind != "text":
                raise RecordProblem(f"{where}: content[{j}] has type {kind!r}: only text parts can be trained "
                                    "(pgs trains text models)")
            if not isinstance(part.get("text"), str):
                got = "missing" if part.get("text") is None else type(part["text"]).__name__
                raise RecordProblem(f"{where}: content[{j}].text must be a string, got {got}")
            texts.append(part["text"])
        return "".join(texts)
    got = "missing" if content is None else type(content).__name__
    raise RecordProblem(f"{where}: content must be a string or a list of text parts, got {got}")


def _weight(raw: dict, role: str, where: str) -> int | None:
    weight = raw.get("weight")
    if weight is None:
        return None
    if isinstance(weight, bool):
        weight = int(weight)
    if not isinstance(weight, (int, float)) or weight not in (0, 1):
        raise RecordProblem(f"{where}: weight must be 0 or 1, got {weight!r}")
    if weight == 1 and role != "assistant":
        raise RecordProblem(f"{where}: weight 1 asks to train a {role} turn; only assistant turns are trained "
                            "(give it weight 0 or none)")
    return int(weight)


def parse_message(raw: Any, index: int) -> dict:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise RecordProblem(f"{where}: expected an object, got {type(raw).__name__}")
    if raw.get("role") is None:
        raise RecordProblem(f"{where}: missing 'role'")
    role = raw["role"]
    if role not in ROLES:
        raise RecordProblem(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    role = ROLE_ALIASES.get(role, role)
    content = raw.get("content")
    tool_calls = raw.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise RecordProblem(f"{where}: only assistant messages may carry tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise RecordProblem(f"{where}: tool_calls must be a list")
    if content is None and tool_calls:
        content = ""
    message: dict[str, Any] = {"role": role, "content": _content(content, f"{where} ({role})")}
    if tool_calls:
        message["tool_calls"] = [_tool_call(c, f"{where} tool_calls[{i}]") for i, c in enumerate(tool_calls)]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in raw and raw[key] is not None:
            if not isinstance(raw[key], str):
                raise RecordProblem(f"{where}: {key} must be a string, got {type(raw[key]).__name__}")
            message[key] = raw[key]
    weight = _weight(raw, role, f"{where} ({role})")
    if weight is not None:
        message["weight"] = weight
    return message


def _tools(record: dict) -> Any:
    tools = record.get("tools")
    if isinstance(tools, str):  # a column of JSON text (Parquet, Arrow): nested lists of objects rarely fit a schema
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as err:
            raise RecordProblem(f"'tools' must be a list of objects or a JSON string of one; this string is not "
                                f"valid JSON ({json_reason(err)})") from None
    return tools


def _conversation_list(record: dict) -> Any:
    return record["messages"] if "messages" in record else record.get("conversations")


def _messages_record(record: dict) -> tuple[list[Any], Any]:
    return _conversation_list(record), _tools(record)


def _sharegpt_record(record: dict) -> tuple[list[Any], Any]:
    turns = _conversation_list(record)
    if not isinstance(turns, list):
        raise RecordProblem("'conversations' must be a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordProblem(f"turn {i}: expected an object, got {type(turn).__name__}")
        if turn.get("from") is None:
            raise RecordProblem(f"turn {i}: missing 'from'")
        speaker = turn["from"]
        if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
            raise RecordProblem(
                f"turn {i}: unknown speaker {speaker!r} (expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        message = {"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")}
        if turn.get("weight") is not None:
            message["weight"] = turn["weight"]
        messages.append(message)
    return messages, _tools(record)


def _side(record: dict, key: str, role: str) -> list[Any]:
    value = record[key]
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value
    raise RecordProblem(f"'{key}' must be a string or a non-empty list of messages, got {type(value).__name__}")


def _prompt_completion_record(record: dict) -> tuple[list[Any], Any]:
    for key in ("prompt", "completion"):
        if key not in record or record[key] is None:
            raise RecordProblem(f"missing '{key}'")
    messages: list[Any] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RecordProblem(f"'system' must be a string, got {type(system).__name__}")
        messages.append({"role": "system", "content": system})
    completion = _side(record, "completion", "assistant")
    if any(isinstance(m, dict) and m.get("role") != "assistant" for m in completion):
        raise RecordProblem("'completion' must hold assistant messages only")
    return messages + _side(record, "prompt", "user") + completion, _tools(record)


def _text_record(record: dict) -> str:
    text = record.get("text")
    if not isinstance(text, str):
        got = "missing" if text is None else type(text).__name__
        raise RecordProblem(f"'text' must be a string, got {got}")
    if not text.strip():
        raise RecordProblem("'text' is empty (nothing to train on)")
    return text


_SHAPES = {
    "messages": _messages_record,
    "sharegpt": _sharegpt_record,
    "prompt_completion": _prompt_completion_record,
}


def rename_fields(record: Any, fields: dict[str, str] | None) -> Any:
    """The record with a source's named columns read as the usual ones (``{usual: column}``)."""
    if not fields or not isinstance(record, dict):
        return record
    record = dict(record)
    for usual, column in fields.items():
        if column not in record:
            raise RecordProblem(f"missing '{column}' (the source's {usual}_field)")
        record[usual] = record.pop(column)
    return record


def parse_record(record: Any, format: str = "auto", fields: dict[str, str] | None = None
                 ) -> tuple[list[dict], list[dict] | None, str | None]:
    """Validate one decoded record; returns ``(messages, tools, text)`` or raises RecordProblem.

    ``text`` is set (and ``messages`` empty) for a ``text`` document."""
    if not isinstance(record, dict):
        raise RecordProblem(f"expected a JSON object per record, got {type(record).__name__}")
    record = rename_fields(record, fields)
    shape = detect_format(record) if format == "auto" else format
    if shape == "text":
        return [], None, _text_record(record)
    if shape in ("messages", "sharegpt") and "messages" not in record and "conversations" not in record:
        raise RecordProblem(f"missing 'messages' (source format is {shape!r})")
    raw_messages, tools = _SHAPES[shape](record)
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RecordProblem("the conversation must be a non-empty list of messages")
    messages = [parse_message(m, i) for i, m in enumerate(raw_messages)]
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordProblem("the conversation has no assistant turn (nothing to train on)")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RecordProblem("'tools' must be a list of objects")
    return messages, (tools or None), None


def conversation(record: Any, origin: str, format: str = "auto", fields: dict[str, str] | None = None
                 ) -> Conversation:
    """A decoded record as a :class:`Conversation`; ``DataError('origin: problem')`` when it is bad."""
    try:
        messages, tools, text = parse_record(record, format, fields)
    except RecordProblem as err:
        raise DataError(f"{origin}: {err}") from None
    return Conversation(messages=messages, tools=tools, origin=origin, text=text)


def decode_object(raw: str | bytes | LongLine, origin: str) -> dict:
    """One JSONL line's object; ``DataError`` when it is not JSON or not an object, or longer
    than a record may be (:data:`MAX_RECORD_BYTES`)."""
    if isinstance(raw, LongLine):
        raise DataError(f"{origin}: a record of {raw.size / 2**20:.1f} MiB on one line, longer than the "
                        f"{MAX_RECORD_BYTES >> 20} MiB a record may be")
    record = decode_json(raw, origin)
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object per line, got {type(record).__name__}")
    return record


def decode_json(raw: str | bytes, origin: str) -> Any:
    """One JSON value; ``DataError('origin: malformed JSON (...)')`` when it is not one."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{origin}: malformed JSON ({json_reason(err)})") from None
    except RecursionError:  # the decoder recurses once per level: a bound, said in one line
        raise DataError(f"{origin}: malformed JSON (nested too deep for a record)") from None
    if _SURROGATE.search(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")):
        _check_surrogates(value, origin)  # only a record that spells a surrogate is walked
    return value


#: a JSON escape of a UTF-16 surrogate (\ud800-\udfff), the only way a lone one gets into a string
_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _check_surrogates(value: Any, origin: str) -> None:
    """``DataError`` for a string holding a lone UTF-16 surrogate (JSON lets ``"\\ud800"`` decode
    to one; no tokenizer can take it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{origin}: malformed JSON (a lone UTF-16 surrogate in a string: "
                            "an \\ud800-\\udfff escape without its pair)") from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_surrogates(item, origin)
    elif isinstance(value, list):
        for item in value:
            _check_surrogates(item, origin)


def parse_line(line: str | bytes, origin: str, format: str = "auto", fields: dict[str, str] | None = None
               ) -> Conversation:
    """Decode and validate one JSONL line; ``DataError('file:line: problem')`` when it is bad."""
    return conversation(decode_object(line, origin), origin, format, fields)


#: The longest JSON Lines record pgs reads (bytes of one line).  A longer line is a bad record
#: (``data.on_bad_record``) and is never held whole: a 1M-token document is ~4 MB of text,
#: while a runaway line (a file without newlines, a base64 blob) would otherwise be read and
#: tokenised whole, gigabytes of host memory to drop it.
MAX_RECORD_BYTES = 16 * 2**20
#: how much of an over-long line is read at a time while it is skipped
_SKIP_CHUNK = 2**20


class LongLine:
    """A line longer than :data:`MAX_RECORD_BYTES`, skipped without being held: its length."""

    def __init__(self, size: int):
        self.size = size


def read_line(handle) -> bytes | LongLine:
    """The next line of a binary file (``b""`` at its end), or a :class:`LongLine` for one
    longer than :data:`MAX_RECORD_BYTES`, after which the file stands at the next line."""
    raw = handle.readline(MAX_RECORD_BYTES + 1)
    if len(raw) <= MAX_RECORD_BYTES or raw.endswith(b"\n"):
        return raw
    size = len(raw)
    while True:
        piece = handle.readline(_SKIP_CHUNK)
        size += len(piece)
        if not piece or piece.endswith(b"\n"):
            return LongLine(size)


def iter_lines(path: str) -> Iterator[tuple[int, int, bytes | LongLine]]:
    """Yield ``(line_number, byte_offset, raw_line)`` for each non-blank line, streaming (an
    over-long line as a :class:`LongLine`, which :func:`decode_object` refuses)."""
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None
    with handle:
        offset, number = 0, 0
        while True:
            raw = read_line(handle)
            if isinstance(raw, bytes) and not raw:
                return
            number += 1
            long = isinstance(raw, LongLine)
            if long or raw.strip():  # an over-long line is never blank
                yield number, offset, raw
            offset += raw.size if long else len(raw)
