"""Preference pairs: the three record shapes, every bad pair's one-line error (and
``on_bad_record = "skip"``), the masks, packing isolation of the two arms, the stream's resume."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from pgs.errors import DataError
from pgs.runtime.data import DataConfig, encode_chat
from pgs.runtime.data.preference import (
    PreferenceStream,
    collate_pairs,
    encode_pair,
    pack_rows,
    parse_pair_line,
    read_pairs,
)
from pgs.runtime.data.synthetic import WEATHER_TOOL, preference_pairs
from pgs.runtime.model.loading import load_tokenizer

QUICKSTART_TOKENIZER = "pgs/assets/quickstart/tokenizer"
USER = {"role": "user", "content": "What is 2 + 2?"}


@functools.cache
def tok():
    return load_tokenizer(QUICKSTART_TOKENIZER, False)


def config(path, **kw) -> DataConfig:
    return DataConfig(sources=[str(path)], max_seq_len=kw.pop("max_seq_len", 256), **kw)


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def trained_text(doc) -> str:
    return tok().decode([t for t, m in zip(doc.input_ids, doc.train_mask) if m])


def test_three_shapes_give_the_same_pair(tmp_path):
    explicit = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}]}
    shared = {"chosen": [USER, {"role": "assistant", "content": "4"}],
              "rejected": [USER, {"role": "assistant", "content": "5"}]}
    strings = {"prompt": USER["content"], "chosen": "4", "rejected": "5"}
    path = write(tmp_path / "p.jsonl", [explicit, shared, strings])
    pairs = read_pairs([path], tok(), config(path))
    assert [p.index for p in pairs] == [0, 1, 2]
    for pair in pairs:
        for arm in ("chosen", "rejected"):
            mine, first = getattr(pair, arm), getattr(pairs[0], arm)
            assert (mine.input_ids, mine.train_mask) == (first.input_ids, first.train_mask)
    # the masks are SFT's: the whole assistant turn with its end-of-turn token, nothing of the prompt
    ids, mask = encode_chat(tok(), [USER, {"role": "assistant", "content": "4"}])
    assert list(pairs[0].chosen.input_ids) == ids and list(pairs[0].chosen.train_mask) == mask
    assert trained_text(pairs[0].chosen) == "4<|im_end|>"
    assert trained_text(pairs[0].rejected) == "5<|im_end|>"


def test_multi_turn_prompt_trains_only_the_arm(tmp_path):
    prompt = [USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    record = {"prompt": prompt, "chosen": "6", "rejected": "7"}
    path = write(tmp_path / "p.jsonl", [record])
    (pair,) = read_pairs([path], tok(), config(path))
    assert trained_text(pair.chosen) == "6<|im_end|>"
    assert trained_text(pair.rejected) == "7<|im_end|>"


def test_tool_call_arms(tmp_path):
    samples = [{"task": "weather", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]}]
    path = write(tmp_path / "p.jsonl", preference_pairs(samples, 0))
    (pair,) = read_pairs([path], tok(), config(path))
    assert "Oslo" in trained_text(pair.chosen) and "Oslo" not in trained_text(pair.rejected)


BAD = [
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "q", "chosen": "", "rejected": "a"}, "'chosen' is empty"),
    ({"prompt": "q", "chosen": "a", "rejected": []}, "'rejected' is empty"),
    ({"chosen": [USER, {"role": "assistant", "content": "4"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "5"}]},
     "the prefixes of 'chosen' and 'rejected' differ at message 0 (user vs user)"),
    ({"prompt": "q", "chosen": "a"}, "missing 'rejected'"),
    ({"prompt": "q", "chosen": 3, "rejected": "a"}, "'chosen' must be a string or a list of messages"),
    ({"prompt": "q", "chosen": "a " * 300, "rejected": "b"}, "longer than data.max_seq_len = 256"),
    ("{not json", "malformed JSON"),
]


@pytest.mark.parametrize("record,message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_pair_is_one_line_naming_file_and_line(tmp_path, record, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write(tmp_path / "p.jsonl", [good, record, good])
    with pytest.raises(DataError) as err:
        read_pairs([path], tok(), config(path))
    text = str(err.value)
    assert text.startswith(f"{path}:2: ") and message in text and "\n" not in text
    skipped: list[str] = []
    pairs = read_pairs([path], tok(), config(path, on_bad_record="skip"), skipped=skipped)
    assert [p.index for p in pairs] == [0, 1] and len(skipped) == 1 and skipped[0] == text


def test_pair_length_counts_both_arms(tmp_path):
    record = parse_pair_line(json.dumps({"prompt": "q", "chosen": "a " * 60, "rejected": "b " * 60}), "f:1")
    pair = encode_pair(record, tok(), config(tmp_path / "x", max_seq_len=256), 0)
    assert len(pair.chosen) < 128 < len(pair)  # each arm fits alone, the pair does not fit in 128
    with pytest.raises(DataError, match=r"^f:1: the pair is \d+ tokens \(chosen \d+ \+ rejected \d+\), longer than "
                                        r"data.max_seq_len = 128$"):
        encode_pair(record, tok(), config(tmp_path / "x", max_seq_len=128), 0)


def _pairs(tmp_path, n=40):
    records = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(n)]
    path = write(tmp_path / "p.jsonl", records)
    return path, read_pairs([path], tok(), config(path, max_seq_len=128))


def test_packing_keeps_pairs_whole_and_arms_isolated(tmp_path):
    path, pairs = _pairs(tmp_path)
    rows = pack_rows(pairs, 128)
    assert [p.index for row in rows for p in row] == list(range(len(pairs)))
    assert all(sum(len(p) for p in row) <= 128 for row in rows) and max(len(r) for r in rows) > 1
    batch = collate_pairs(rows[:3], pad_id=0, seq_len=128)
    assert batch.num_pairs == sum(len(r) for r in rows[:3]) and batch.pair_ids.tolist() == list(range(batch.num_pairs))
    k = 0
    for r, row in enumerate(rows[:3]):
        at = 0
        for pair in row:
            for arm, doc in ((0, pair.chosen), (1, pair.rejected)):
                span = slice(at, at + len(doc))
                assert (batch.seq_ids[r, span] == 2 * k + arm).all()
                # positions restart at each arm: the arms never attend to each other (SFT packing)
                assert batch.position_ids[r, span].tolist() == list(range(len(doc)))
                assert batch.input_ids[r, span].tolist() == list(doc.input_ids)
                labels = batch.labels[r, span]
                assert labels[-1] == -100  # no label crosses into the next arm
                trained = (labels != -100).nonzero().flatten()
                assert [doc.input_ids[j + 1] for j in trained.tolist()] == labels[trained].tolist()
                at += len(doc)
            k += 1
        assert (batch.seq_ids[r, at:] == -1).all() and (batch.labels[r, at:] == -100).all()


def test_stream_epochs_and_exact_resume(tmp_path):
    path, pairs = _pairs(tmp_path)
    cfg = config(path, max_seq_len=128)
    stream = PreferenceStream(cfg, tok())
    seen = []
    for _ in range(12):
        seen.append(stream.next_batch(2).pair_ids.tolist())
    flat = [i for ids in seen for i in ids]
    assert sorted(flat[:len(pairs)]) == list(range(len(pairs)))  # an epoch is every pair once
    assert stream.epoch >= 1
    again = PreferenceStream(cfg, tok())
    for _ in range(5):
        again.next_batch(2)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = PreferenceStream(cfg, tok())
    resumed.load_state_dict(state)
    for ids in seen[5:]:
        batch = resumed.next_batch(2)
        assert batch.pair_ids.tolist() == ids
    other = write(tmp_path / "q.jsonl", [{"prompt": "x", "chosen": "1", "rejected": "2"}])
    with pytest.raises(DataError, match="preference data changed"):
        PreferenceStream(config(other, max_seq_len=128), tok()).load_state_dict(state)


def test_loader_process_worker_carries_preference_batches(tmp_path):
    from pgs.runtime.data.loader import StepLoader

    path, _ = _pairs(tmp_path)
    cfg = config(path, max_seq_len=128)
    expected = PreferenceStream(cfg, tok())
    want = [expected.next_batch(2) for _ in range(3)]
    with StepLoader(PreferenceStream(cfg, tok()), 2, 1, torch.device("cpu"), ahead=2, worker="process") as loader:
        for batch in want:
            (got,) = loader.next_step()
            assert type(got) is type(batch) and got.num_pairs == batch.num_pairs
            for name in ("input_ids", "labels", "position_ids", "seq_ids", "pair_ids"):
                assert torch.equal(getattr(got, name), getattr(batch, name))
