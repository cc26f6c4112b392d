"""Readers: three record shapes, and every kind of bad record named by file:line."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pgs.errors import DataError, SpecError
from pgs.runtime.data import DataConfig, DataSource, TrainStream, read_conversations

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_three_shapes_read_to_the_same_messages(tmp_path):
    path = write(
        tmp_path,
        [
            GOOD,
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {"prompt": "Hi", "completion": "Hello"},
        ],
    )
    conversations = list(read_conversations(path))
    assert [c.messages for c in conversations] == [GOOD["messages"]] * 3
    assert [c.origin for c in conversations] == [f"{path}:1", f"{path}:2", f"{path}:3"]


def test_tool_calls_arguments_string_is_decoded(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ]},
            {"role": "tool", "content": "12C", "name": "get_weather", "tool_call_id": "c1"},
            {"role": "assistant", "content": "12C"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "meta": {"ignored": True},
    }
    (conversation,) = read_conversations(write(tmp_path, [record]))
    assert conversation.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert conversation.messages[1]["content"] == ""
    assert conversation.messages[2]["name"] == "get_weather"
    assert conversation.tools == record["tools"]


BAD = [
    ("{not json", "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
    ({"messages": [{"content": "Hi"}, {"role": "assistant", "content": "x"}]}, "missing 'role'"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "x"}]}, "content[0] must be an object"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
    ({"messages": []}, "non-empty list"),
    ({"title": "hello"}, "unknown record shape"),
    ({"conversations": [{"from": "alien", "value": "Hi"}]}, "unknown speaker 'alien'"),
    ({"conversations": [{"value": "Hi"}]}, "missing 'from'"),
    ({"prompt": "Hi"}, "missing 'completion'"),
    ({"prompt": "Hi", "completion": 4}, "'completion' must be a string"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"arguments": {}}}]}]}, "function.name"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": []}, {"role": "assistant", "content": "x"}]}, "only assistant"),
    ({"messages": GOOD["messages"], "tools": "nope"}, "'tools' must be a list"),
]


@pytest.mark.parametrize("bad,problem", BAD)
def test_bad_record_is_a_one_line_data_error_with_file_and_line(tmp_path, bad, problem):
    path = write(tmp_path, [GOOD, "", bad, GOOD])
    with pytest.raises(DataError) as caught:
        list(read_conversations(path))
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ")  # blank line 2 still counts as a line
    assert problem in message
    assert "\n" not in message


def test_skip_policy_counts_every_skipped_record(tmp_path):
    path = write(tmp_path, [GOOD, "{bad", GOOD, {"messages": [{"role": "user", "content": "x"}]}])
    skipped: list[str] = []
    kept = list(read_conversations(path, on_bad_record="skip", skipped=skipped))
    assert len(kept) == 2
    assert [s.split(": ")[0] for s in skipped] == [f"{path}:2", f"{path}:4"]


def test_train_stream_validates_up_front_and_counts_skips(tmp_path):
    path = write(tmp_path, [GOOD, "{bad", GOOD])
    tok = AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")
    with pytest.raises(DataError, match=f"{path}:2: malformed JSON"):
        TrainStream(DataConfig(sources=[path]), tok)
    stream = TrainStream(DataConfig(sources=[path], on_bad_record="skip"), tok, pack_window=4)
    assert stream.stats.bad_records == 1
    assert stream.next_batch(1).num_docs >= 1


def test_forced_format_mismatch_and_missing_file(tmp_path):
    path = write(tmp_path, [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=":1: missing 'messages'"):
        list(read_conversations(path, format="messages"))
    with pytest.raises(DataError, match="cannot read"):
        list(read_conversations(str(tmp_path / "absent.jsonl")))


def test_config_validators_name_the_field():
    with pytest.raises(SpecError, match="data.truncation"):
        DataConfig(sources=["a.jsonl"], truncation="cut")
    with pytest.raises(SpecError, match="data.on_bad_record"):
        DataConfig(sources=["a.jsonl"], on_bad_record="ignore")
    with pytest.raises(SpecError, match="weight"):
        DataSource("a.jsonl", weight=0)
    with pytest.raises(SpecError, match="data.format"):
        DataSource("a.jsonl", format="csv")
    with pytest.raises(SpecError, match="data.max_seq_len"):
        DataConfig(sources=["a.jsonl"], max_seq_len=0)
    config = DataConfig(sources=[{"path": "a.jsonl", "weight": 2}, "b.jsonl"])
    assert config.sources[0].weight == 2 and config.sources[1].path == "b.jsonl"


# -- the record shapes users already have (issue 23, item 2) ---------------------------------

QUICKSTART = "pgs/assets/quickstart/tokenizer"


def trained_text(tok, conversation) -> list[str]:
    from pgs.runtime.data import encode_chat
    from test_data_chat import trained_runs

    return trained_runs(tok, *encode_chat(tok, conversation.content, conversation.tools))


def test_openai_content_parts_developer_name_and_tool_call_ids(tmp_path):
    record = {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12C"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
        {"role": "assistant", "content": [{"type": "text", "text": "12C and 20C."}]},
    ]}
    (c,) = read_conversations(write(tmp_path, [record]))
    assert c.messages[0] == {"role": "system", "content": "Be brief."}
    assert c.messages[1] == {"role": "user", "content": "Weather?", "name": "ann"}
    calls = c.messages[2]["tool_calls"]
    assert [call["function"]["arguments"] for call in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert [call["id"] for call in calls] == ["c1", "c2"]
    assert c.messages[3] == {"role": "tool", "content": "12C", "tool_call_id": "c1"}
    assert c.messages[5]["content"] == "12C and 20C."


def test_per_message_weight_is_honoured_and_counted(tmp_path):
    from pgs.runtime.data import DataStats, encode_document

    record = {"messages": [
        {"role": "user", "content": "Hi", "weight": 0},
        {"role": "assistant", "content": "bad answer", "weight": 0},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "good answer", "weight": 1},
    ]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "bad answer", "weight": 0},
                                  {"from": "human", "value": "Again"}, {"from": "gpt", "value": "good answer"}]}
    tok = AutoTokenizer.from_pretrained(QUICKSTART)
    for c in read_conversations(write(tmp_path, [record, sharegpt])):
        assert trained_text(tok, c) == ["good answer<|im_end|>"]
        stats = DataStats()
        encode_document(c, tok, DataConfig(sources=["x.jsonl"]), stats)
        assert stats.weight_zero_turns == 1 and stats.samples == 1


def test_prompt_completion_as_messages_and_text_documents(tmp_path):
    records = [
        {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]},
        {"prompt": "Hi", "completion": "Hello", "system": "Be kind."},
        {"text": "A whole document."},
    ]
    a, b, d = read_conversations(write(tmp_path, records))
    assert a.messages == GOOD["messages"]
    assert b.messages == [{"role": "system", "content": "Be kind."}] + GOOD["messages"]
    assert d.messages == [] and d.text == "A whole document."
    tok = AutoTokenizer.from_pretrained(QUICKSTART)
    assert trained_text(tok, d) == ["A whole document.<|im_end|>"]  # every token and the eos


def test_columns_named_otherwise(tmp_path):
    record = {"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
              "functions": json.dumps([{"type": "function", "function": {"name": "f"}}])}
    source = DataSource(write(tmp_path, [record]), messages_field="conversation", tools_field="functions")
    (c,) = read_conversations(source)
    assert c.messages == GOOD["messages"] and c.tools == [{"type": "function", "function": {"name": "f"}}]
    # ShareGPT data whose list is called "conversations" but whose turns use role/content
    (c,) = read_conversations(write(tmp_path, [{"conversations": GOOD["messages"]}], "roles.jsonl"))
    assert c.messages == GOOD["messages"]
    with pytest.raises(DataError, match=r":1: missing 'dialog' \(the source's messages_field\)"):
        list(read_conversations(DataSource(source.path, messages_field="dialog")))


def test_a_line_longer_than_a_record_may_be_is_a_bad_record_never_held_whole(tmp_path, monkeypatch):
    """A runaway line (a file without newlines, a base64 blob) is refused with its file:line, or
    skipped and counted, and read in pieces: the line itself is never held (nor tokenised)."""
    from pgs.runtime.data import records
    from pgs.runtime.data.readers import JsonLinesReader

    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 64)
    monkeypatch.setattr(records, "_SKIP_CHUNK", 16)  # the skip reads it 16 bytes at a time
    good = json.dumps({"text": "short"}) + "\n"
    long = json.dumps({"text": "x" * 300}) + "\n"
    path = tmp_path / "d.jsonl"
    path.write_text(good + long + good + json.dumps({"text": "y" * 100}))  # the last without a newline
    lines = list(records.iter_lines(str(path)))
    assert [n for n, _, _ in lines] == [1, 2, 3, 4]
    assert isinstance(lines[1][2], records.LongLine) and lines[1][2].size == len(long)
    assert lines[2][1] == len(good) + len(long) and lines[2][2] == good.encode()
    assert isinstance(lines[3][2], records.LongLine)
    reader = JsonLinesReader(str(path))
    assert reader.read(lines[2][1]) == good.encode() and isinstance(reader.read(lines[1][1]), records.LongLine)
    reader.close()
    with pytest.raises(DataError, match=r"d\.jsonl:2: a record of 0\.0 MiB on one line, longer than the 0 MiB"):
        list(read_conversations(str(path)))
    skipped: list[str] = []
    assert len(list(read_conversations(str(path), on_bad_record="skip", skipped=skipped))) == 2
    assert [s.split(": ")[0].rsplit(":", 1)[1] for s in skipped] == ["2", "4"]
