"""ECHO (``data.train_roles``) masks, per-source eval loss, and mSFT rounds in a tiny run (CPU)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from pgs.errors import SpecError
from pgs.runtime.data import DataConfig
from pgs.runtime.data.chat import encode_chat
from pgs.runtime.loop.faults import Faults
from pgs.runtime.loop.msft import pick_excluded, source_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import QUICKSTART, ROOT, launch, model_toml, records as _records, run_here  # noqa: E402
from test_data_chat import QWEN3_STYLE, WEATHER_TOOL, call, tokenizer_with, trained_runs  # noqa: E402

ECHO_TURNS = [
    {"role": "user", "content": "Is it 12C cloudy in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("Oslo")]},
    {"role": "tool", "content": "12C cloudy"},
    {"role": "assistant", "content": "Yes: 12C, cloudy."},
]


def test_train_roles_tool_adds_the_tool_results_and_nothing_else():
    tok = tokenizer_with(QWEN3_STYLE)
    ids, plain = encode_chat(tok, ECHO_TURNS, [WEATHER_TOOL])
    ids2, echo = encode_chat(tok, ECHO_TURNS, [WEATHER_TOOL], train_roles=("assistant", "tool"))
    assert ids == ids2
    runs = trained_runs(tok, ids, echo)
    assert runs == trained_runs(tok, ids, plain)[:1] + ["12C cloudy"] + trained_runs(tok, ids, plain)[1:]
    # the user's identical text before the call stays untrained: the search starts after the call
    assert all(e or not p for p, e in zip(plain, echo)) and sum(echo) > sum(plain)


def test_train_roles_tool_with_generation_markers_quickstart():
    from pgs.runtime.model.loading import load_tokenizer

    tok = load_tokenizer(str(QUICKSTART / "tokenizer"))
    record = next(json.loads(line) for line in (QUICKSTART / "train.jsonl").read_text().splitlines()
                  if '"weather"' in line)
    ids, mask = encode_chat(tok, record["messages"], record["tools"], train_roles=["assistant", "tool"])
    tool = record["messages"][2]["content"]
    assert tool in trained_runs(tok, ids, mask)


def test_train_roles_is_validated():
    for roles, match in [(["user"], "not one of"), (["tool"], "must include"), ([1], "array of role names")]:
        with pytest.raises(SpecError, match=match):
            DataConfig(sources="x.jsonl", train_roles=roles)
    assert DataConfig(sources="x.jsonl", train_roles=["tool", "assistant"]).train_roles == ("assistant", "tool")


def test_pick_excluded_is_the_earliest_best_and_source_names():
    assert pick_excluded({0: (40, 1.0), 1: (20, 3.0), 2: (60, 0.1)}) == 1
    assert pick_excluded({0: (20, 1.0), 1: (20, 0.5)}) == 0  # a tie: the first source

    class S:
        def __init__(self, path):
            self.path = path

    assert source_names([S("a/add.jsonl"), S("b/weather-2.jsonl")]) == ["add", "weather_2"]
    assert source_names([S("a/x.jsonl"), S("b/x.jsonl")]) == ["source0", "source1"]


SPEC = model_toml(num_hidden_layers=1) + """
[data]
sources = [{ path = "DIR/add.jsonl", eval = "DIR/add_eval.jsonl" },
           { path = "DIR/weather.jsonl", eval = "DIR/weather_eval.jsonl", weight = 0.5 }]
max_seq_len = 120
seed = 1
msft_round = 4

[optimizer]
alias = "adamw"

[schedule]
name = "constant"
peak = 3e-3

[train]
steps = 40
batch_size = 4
seed = 7
eval_every = 2
log_every = 1000

[checkpoint]
dir = "DIR/run"
every = 4
keep = 0
best_metric = ""
export = true
"""


def _msft_spec(tmp_path: Path) -> Path:
    train = [json.loads(x) for x in (QUICKSTART / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (QUICKSTART / "eval.jsonl").read_text().splitlines()]
    for task in ("add", "weather"):
        (tmp_path / f"{task}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in [r for r in train if r["task"] == task][:60]))
        (tmp_path / f"{task}_eval.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in [r for r in evals if r["task"] == task][:8]))
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.replace("DIR", str(tmp_path)))
    return path


def _launch(spec: Path, *extra, **env):
    return launch(spec, timeout=300, args=extra, PYTHONPATH=ROOT, **env)


@pytest.mark.slow
def test_msft_excludes_one_source_per_round_reverts_and_resumes(tmp_path):
    spec = _msft_spec(tmp_path)
    run_dir = tmp_path / "run"
    assert run_here(spec) == 0  # in this process, one thread
    records = _records(run_dir)
    evals = [r for r in records if "eval_loss_add" in r]
    assert evals and all("eval_loss_weather" in r for r in evals)  # per-source eval loss, every eval
    events = [r for r in records if r.get("event") == "msft_exclude"]
    assert [e["source"] for e in events] and len(events) == 2  # one source per round, then none left
    assert [len(e["active"]) for e in events] == [1, 0]
    starts = [0] + [e["step"] for e in events[:-1]]
    for start, e in zip(starts, events):
        assert start <= e["best_step"] <= e["step"]  # the revert point is never later than now
        assert e["step"] - start >= 4
        losses = {r["step"]: r[f"eval_loss_{e['source']}"] for r in evals if start <= r["step"] <= e["step"]}
        if e["best_step"] != start:  # the round's lowest loss of that source is its best step
            assert losses[e["best_step"]] == pytest.approx(min(losses.values())) == pytest.approx(e["best_loss"])
    last = events[-1]
    assert records[-1]["event"] == "done" and records[-1]["step"] == last["step"] < 40
    # the run ends with the last source's best weights: its eval loss is that best loss again
    from pgs.runtime.data import DataConfig, EvalStream
    from pgs.runtime.loop.evaluate import eval_loss
    from pgs.runtime.model.build import build_model
    from pgs.runtime.model.loading import load_tokenizer

    model = build_model(path=str(run_dir / "final"), dtype="float32", attn_implementation="sdpa")
    tok = load_tokenizer(str(run_dir / "final"))
    config = DataConfig(sources=str(tmp_path / "add.jsonl"), max_seq_len=120)
    got = eval_loss(model, EvalStream(config, tok, 4, path=str(tmp_path / f"{last['source']}_eval.jsonl")))
    assert got["eval_loss"] == pytest.approx(last["best_loss"], rel=1e-4)

    # killed after the first exclusion, resumed: the same events
    again = tmp_path / "again"
    again.mkdir()
    spec2 = _msft_spec(again)
    first_step = events[0]["step"]
    crash = _launch(spec2, **Faults(crash_at=("step", first_step + 1)).env())
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-3000:]
    assert run_here(spec2, "--resume", "auto") == 0
    events2 = [r for r in _records(again / "run") if r.get("event") == "msft_exclude"]
    strip = lambda e: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items() if k != "time"}  # noqa: E731
    assert [strip(e) for e in events2] == [strip(e) for e in events]


def test_msft_round_is_checked_with_the_spec(tmp_path):
    from pgs.runtime.spec.load import load_spec

    spec = _msft_spec(tmp_path)
    assert load_spec(spec).data.msft_round == 4
    with pytest.raises(SpecError, match="train.eval_every must be in 1..4"):
        load_spec(spec, ["train.eval_every=5"])
    text = spec.read_text().replace(', eval = "' + str(tmp_path) + '/weather_eval.jsonl"', "")
    spec.write_text(text)
    with pytest.raises(SpecError, match=r"data.sources\[1\].eval is not set"):
        load_spec(spec)
