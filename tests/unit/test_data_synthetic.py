"""The quickstart assets: generator, checker, shipped files and tokenizer, inspect output."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from rich.console import Console
from transformers import AutoTokenizer

from pgs.runtime.data import DataConfig, encode_chat
from pgs.runtime.data.inspect import inspect_dataset
from pgs.runtime.data.synthetic import eval_turns, generate, is_correct, sample_key

ASSETS = "pgs/assets/quickstart"


def test_generator_is_deterministic_and_checkable():
    assert generate(50, seed=3) == generate(50, seed=3)
    assert generate(50, seed=3) != generate(50, seed=4)
    for sample in generate(40, seed=0):
        turns = eval_turns(sample)
        assert turns[0][0][-1]["role"] == "user"
        right = []
        for _, _, expected in turns:
            if expected.get("tool_calls"):
                f = expected["tool_calls"][0]["function"]
                right.append("<tool_call>" + json.dumps({"name": f["name"], "arguments": f["arguments"]})
                             + "</tool_call><|im_end|>")
            else:
                right.append(f" {expected['content']}<|im_end|>")
        assert is_correct(sample, right)
        for k in range(len(right)):  # any one turn wrong makes the whole reply wrong
            wrong = list(right)
            wrong[k] = wrong[k].replace("<|im_end|>", "0<|im_end|>").replace('"}}', 'x"}}')
            assert not is_correct(sample, wrong)


def test_eval_is_held_out_and_the_sums_are_two_digit():
    """No eval conversation is a training one: not the same sum, nor the same city,
    temperature and condition (the relayed answer is then new too)."""
    train = [json.loads(line) for line in open(os.path.join(ASSETS, "train.jsonl"))]
    evaluation = [json.loads(line) for line in open(os.path.join(ASSETS, "eval.jsonl"))]
    seen = {sample_key(s) for s in train}
    assert len(seen) == len(train) and not seen & {sample_key(s) for s in evaluation}
    for sample in train + evaluation:
        if sample["task"] == "add":
            a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", sample["messages"][0]["content"]).groups()
            assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    tasks = [s["task"] for s in evaluation]
    assert tasks.count("add") > 100 and tasks.count("weather") > 40


def test_asking_for_more_distinct_samples_than_remain_is_a_clear_error():
    every_sum = {sample_key({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                          {"role": "assistant", "content": str(a + b)}]})
                 for a in range(10, 100) for b in range(10, 100)}
    with pytest.raises(ValueError, match="cannot draw 1 distinct samples"):
        generate(1, seed=0, weather_share=0.0, exclude=every_sum)


def test_shipped_assets_are_small_and_load_offline():
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ASSETS) for f in fs)
    assert total < 1_600_000  # the SFT quickstart's data, its DPO pairs, its KTO records and the tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.path.exists(os.path.join(ASSETS, "tokenizer", name))
    assert "{% generation %}" in json.load(open(os.path.join(ASSETS, "tokenizer", "tokenizer_config.json")))[
        "chat_template"
    ].replace("{%- generation %}", "{% generation %}")
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "tokenizer"))
    assert 400 <= len(tok) <= 1024 and tok.pad_token and tok.eos_token == "<|im_end|>"
    train = [json.loads(line) for line in open(os.path.join(ASSETS, "train.jsonl"))]
    evaluation = [json.loads(line) for line in open(os.path.join(ASSETS, "eval.jsonl"))]
    assert 2000 <= len(train) <= 4000 and len(evaluation) == 200
    ids, mask = encode_chat(tok, train[0]["messages"])
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == train[0]["messages"][1]["content"] + "<|im_end|>"


def test_regenerating_reproduces_the_shipped_assets(tmp_path):
    from pgs.runtime.data.synthetic import main

    assert main(["--out", str(tmp_path)]) == 0  # the command the module's docstring gives
    for name in ("train.jsonl", "eval.jsonl", "tokenizer/tokenizer.json"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(ASSETS, name), "rb").read()


def test_inspect_prints_samples_and_statistics():
    out = io.StringIO()
    config = DataConfig(sources=[os.path.join(ASSETS, "eval.jsonl")], max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "tokenizer"))
    stats = inspect_dataset(config, tok, 2, Console(file=out, width=120))
    text = out.getvalue()
    assert "eval.jsonl:1" in text and "packing efficiency" in text
    assert stats.samples == 200 and stats.dropped == 0 and 0 < stats.trained_fraction < 1


def test_long_chats_are_long_multi_turn_and_the_shipped_file_regenerates(tmp_path):
    """The packed-throughput specs' data (pgs:bench/chats.jsonl): 256 multi-turn chats whose
    tokenized lengths spread over roughly 300-3000 tokens, every assistant turn supervised."""
    from pgs.runtime.data.synthetic import long_chats, main

    assert long_chats(5, seed=1) == long_chats(5, seed=1) != long_chats(5, seed=2)
    assert main(["--long-chats", "256", "--out", str(tmp_path / "chats.jsonl")]) == 0
    shipped = "pgs/assets/bench/chats.jsonl"
    assert (tmp_path / "chats.jsonl").read_bytes() == open(shipped, "rb").read()
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "tokenizer"))
    lengths = []
    for line in list(open(shipped))[:64]:
        chat = json.loads(line)
        ids, mask = encode_chat(tok, chat["messages"], chat["tools"])
        turns = sum(m["role"] == "assistant" for m in chat["messages"])
        assert turns >= 5 and ids.count(tok.convert_tokens_to_ids("<|im_end|>")) >= turns
        assert 0.1 < sum(mask) / len(ids) < 0.6
        lengths.append(len(ids))
    assert 250 <= min(lengths) and max(lengths) <= 3300 and max(lengths) - min(lengths) > 1500
