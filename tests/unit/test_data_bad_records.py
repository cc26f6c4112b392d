"""Bad records in every format: one line naming where (``file:line``, ``file:item N``,
``file:row N``) and what, exit code 2 under ``on_bad_record = "error"``; left out and counted
under ``"skip"``, the good records around it kept.  None passes silently."""

from __future__ import annotations

import json

import pytest

from pgs.errors import DataError
from pgs.runtime.data import DataConfig, DataSource, DataStats, TrainStream
from pgs.runtime.data.sources import SourceIndex
from test_data_templates import family_tokenizer

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
GOOD_TEXT = {"text": "A document."}
GOOD_PC = {"prompt": "Hi", "completion": "Hello"}
USER_PARTS = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
GOOD_PARTS = {"messages": [USER_PARTS, {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]}


def msgs(*messages):
    return {"messages": [*messages]}


USER = {"role": "user", "content": "Hi"}


def assistant(**kw):
    return {"role": "assistant", "content": "ok", **kw}


def call(**function):
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}, **function}}


# (format, good neighbour, bad record, what the line must say)
CASES = [
    ("jsonl", GOOD, "{not json", "malformed JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("jsonl", GOOD, '["a list"]', "expected a JSON object per line, got list"),
    ("jsonl", GOOD, msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, assistant()),
     "message 0 (user): content[0] has type 'image_url': only text parts can be trained"),
    ("jsonl", GOOD, msgs({"role": "user", "content": [{"type": "text"}]}, assistant()),
     "message 0 (user): content[0].text must be a string, got missing"),
    ("jsonl", GOOD, msgs({"role": "user", "content": ["Hi"]}, assistant()), "message 0 (user): content[0] must be an object"),
    ("jsonl", GOOD, msgs({"role": "developer", "content": "x", "tool_calls": []}, USER, assistant()),
     "message 0: only assistant messages may carry tool_calls"),
    ("jsonl", GOOD, msgs(USER, assistant(weight=0.5)), "message 1 (assistant): weight must be 0 or 1, got 0.5"),
    ("jsonl", GOOD, msgs({**USER, "weight": 1}, assistant()), "message 0 (user): weight 1 asks to train a user turn"),
    ("jsonl", GOOD, msgs(USER, assistant(weight="yes")), "message 1 (assistant): weight must be 0 or 1, got 'yes'"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[{**call(), "id": 7}])),
     "message 1 tool_calls[0]: a tool call's id must be a string, got int"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[call()]), {"role": "tool", "content": "1", "tool_call_id": 3},
                         assistant()), "message 2: tool_call_id must be a string, got int"),
    ("jsonl", GOOD, msgs({**USER, "name": 5}, assistant()), "message 0: name must be a string, got int"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[call(arguments=[1])])),
     "message 1 tool_calls[0]: tool call arguments must be an object or a JSON string of one, got list"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[call(arguments="[1]")])),
     "message 1 tool_calls[0]: tool call arguments must be an object or a JSON string of one, got list"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[call(arguments='{"city": ')])),
     "message 1 tool_calls[0]: tool call arguments are not valid JSON (Expecting value at column 10)"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls=[call(name="")])),
     "message 1 tool_calls[0]: a tool call needs function.name (a non-empty string)"),
    ("jsonl", GOOD, msgs(USER, assistant(tool_calls={"name": "f"})), "message 1: tool_calls must be a list"),
    ("jsonl", GOOD, {"prompt": [], "completion": "x"}, "'prompt' must be a string or a non-empty list of messages"),
    ("jsonl", GOOD, {"prompt": "x", "completion": [USER]}, "'completion' must hold assistant messages only"),
    ("jsonl", GOOD, {**GOOD_PC, "system": 1}, "'system' must be a string, got int"),
    ("jsonl", GOOD, {"text": "  "}, "'text' is empty (nothing to train on)"),
    ("jsonl", GOOD, {"text": 3}, "'text' must be a string, got int"),
    ("jsonl", GOOD, {**GOOD, "tools": "[{"}, "'tools' must be a list of objects or a JSON string of one"),
    ("jsonl", GOOD, {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "x", "weight": 2}]},
     "message 1 (assistant): weight must be 0 or 1, got 2"),
    ("jsonl", GOOD, {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
     "message 0 (user): content must be a string or a list of text parts, got missing"),
    ("jsonl", GOOD, msgs(USER, assistant(reasoning_content=1)), "message 1: reasoning_content must be a string, got int"),
    ("json", GOOD, "just a string", "expected a JSON object per item, got str"),
    ("json", GOOD, msgs({"role": "robot", "content": "x"}, assistant()), "message 0: unknown role 'robot'"),
    ("json", GOOD, msgs(USER), "the conversation has no assistant turn (nothing to train on)"),
    ("parquet", GOOD, msgs({"role": "robot", "content": "x"}, assistant()), "message 0: unknown role 'robot'"),
    ("parquet", GOOD, msgs({"role": "user", "content": None}, assistant()),
     "message 0 (user): content must be a string or a list of text parts, got missing"),
    ("parquet", GOOD, msgs(USER, assistant(content="", tool_calls=[call(arguments="{oops")])),
     "message 1 tool_calls[0]: tool call arguments are not valid JSON"),
    ("parquet", GOOD, msgs(USER, assistant(weight=0.5)), "message 1 (assistant): weight must be 0 or 1, got 0.5"),
    ("parquet", GOOD, msgs(), "the conversation must be a non-empty list of messages"),
    ("parquet", GOOD_PARTS, msgs(USER_PARTS, {"role": "assistant", "content": [{"type": "input_audio", "text": None}]}),
     "message 1 (assistant): content[0] has type 'input_audio'"),
    ("datasets", GOOD_TEXT, {"text": ""}, "'text' is empty"),
    ("datasets", GOOD_PC, {"prompt": "Hi", "completion": None}, "missing 'completion'"),
    ("arrow", GOOD, {**GOOD, "tools": "not json"}, "'tools' must be a list of objects or a JSON string of one"),
    ("arrow", GOOD, msgs(USER, {"role": None, "content": "x"}), "message 1: missing 'role'"),
]


def write(folder, kind: str, records: list) -> str:
    if kind == "jsonl":
        path = folder / "data.jsonl"
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
        return str(path)
    if kind == "json":
        path = folder / "data.json"
        path.write_text(json.dumps(records, indent=1))
        return str(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_struct_array(pa.array(records))  # the columns of every row, not of the first only
    if kind == "parquet":
        path = folder / "data.parquet"
        pq.write_table(table, path)
        return str(path)
    import datasets

    datasets.Dataset(table).save_to_disk(str(folder / "saved"))
    if kind == "datasets":
        return str(folder / "saved")
    return str(next((folder / "saved").glob("*.arrow")))


def where(kind: str, path: str, index: int) -> str:
    return {"jsonl": f"{path}:{index + 1}", "json": f"{path}:item {index}"}.get(kind, f"{path}:row {index}")


@pytest.mark.parametrize("kind,good,bad,problem", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_record_is_one_line_exit_2_or_skipped_and_counted(tmp_path, kind, good, bad, problem):
    if kind not in ("jsonl", "json"):
        pytest.importorskip("pyarrow")
        pytest.importorskip("datasets")
    path = write(tmp_path, kind, [good, bad, good])
    with pytest.raises(DataError) as err:
        SourceIndex(DataSource(path))
    message = str(err.value)
    assert message.startswith(where(kind, path, 1) + ": "), message
    assert problem in message, message
    assert "\n" not in message and err.value.exit_code == 2
    stats = DataStats()
    index = SourceIndex(DataSource(path), on_bad_record="skip", stats=stats)
    assert len(index) == 2 and stats.bad_records == 1
    assert index.skipped == [message]
    assert [index.read(i).origin for i in range(2)] == [where(kind, path, 0), where(kind, path, 2)]


def test_there_are_at_least_thirty_across_the_formats():
    assert len(CASES) >= 30 and {c[0] for c in CASES} == {"jsonl", "json", "parquet", "datasets", "arrow"}


@pytest.mark.parametrize("text,problem", [
    ('[{"text": "a"} {"text": "b"}]', "data.json:item 0: malformed JSON (expected ',' or ']' after the item at line 1)"),
    ('[{"text": "a"},\n {"messages": [}]', "data.json:item 1: malformed JSON (Expecting value at line 2 column 16)"),
    ('\n[{"text": "a"}', "data.json:item 0: malformed JSON (expected ',' or ']' after the item at line 2)"),
])
def test_a_json_array_that_is_not_json_fails_the_source_whatever_the_policy(tmp_path, text, problem):
    """Nothing after a syntax error can be read, so it cannot be skipped: the source fails."""
    path = tmp_path / "data.json"
    path.write_text(text)
    for policy in ("error", "skip"):
        with pytest.raises(DataError) as err:
            SourceIndex(DataSource(str(path)), on_bad_record=policy)
        assert problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("family,template,bad,problem", [
    ("gemma3", "gemma3", msgs(USER, USER, assistant()),
     "the chat template refused this conversation: Conversation roles must alternate"),
    ("mistral", "mistral_v3_stock", msgs({"role": "system", "content": "S"}, USER, assistant(), USER, assistant()),
     "mistral_v3_stock.jinja is not prefix-stable"),
])
def test_a_conversation_the_template_refuses(tmp_path, family, template, bad, problem):
    tok = family_tokenizer(family, template)
    path = write(tmp_path, "jsonl", [GOOD] * 3 + [bad])
    with pytest.raises(DataError) as err:
        TrainStream(DataConfig(sources=[path], max_seq_len=256), tok, pack_window=4).next_batch(1)
    assert str(err.value).startswith(f"{path}:4: ") and problem in str(err.value) and "\n" not in str(err.value)
    stream = TrainStream(DataConfig(sources=[path], max_seq_len=256, on_bad_record="skip"), tok, pack_window=4)
    stream.next_batch(1)
    assert stream.stats.bad_records >= 1
