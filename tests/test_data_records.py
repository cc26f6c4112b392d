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
    ({"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "x"}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
    ({"messages": []}, "non-empty list"),
    ({"text": "hello"}, "unknown record shape"),
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
