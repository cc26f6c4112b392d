"""A ``[preference]`` run with ``kind = "kto"`` end to end on the CPU: a tiny Qwen3 (random init)
trained on unpaired records of the quickstart's sums (one labelled answer per prompt), the
reference cache of each record and its KL sample, the step metrics, and that it learns: on
held-out records the desirable answers' mean reward rises above the undesirable ones' and the
held-out loss falls (a run that trains the wrong way, or not at all, fails both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgs.runtime.loop.train import run
from pgs.runtime.spec.load import load_spec
from pgs.runtime.store import reference as cache
from helpers import LOOP, QUICKSTART, loop_fields, model_toml, records, step_records, write_toml

pytestmark = pytest.mark.slow  # ~1 minute on two quiet CPU cores

SPEC = model_toml(max_position_embeddings=256) + """
[data]
sources = ["{train}"]
eval = "{eval}"
max_seq_len = 128
seed = 1

[preference]
kind = "kto"
beta = 0.5
reference = "{reference}"
""" + LOOP

TRAIN, HELD = 160, 48


def sums_only(name: str, n: int, path: Path) -> None:
    """The first ``n`` records of the quickstart's KTO file ``name`` that are sums (short rows)."""
    rows = [line for line in (QUICKSTART / name).read_text().splitlines() if json.loads(line)["task"] == "add"]
    path.write_text("\n".join(rows[:n]) + "\n")


def write_spec(tmp_path: Path, name: str = "run", **fields) -> Path:
    train, held = tmp_path / "kto_train.jsonl", tmp_path / "kto_eval.jsonl"
    if not train.exists():
        sums_only("kto_train.jsonl", TRAIN, train)
        sums_only("kto_eval.jsonl", HELD, held)
    values = loop_fields(reference="cached", steps=24, every=0, eval_every=12, train=train, eval=held,
                         run_dir=tmp_path / name)
    values.update(fields)
    return write_toml(tmp_path / f"{name}.toml", SPEC, **values)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("kto")
    assert run(load_spec(write_spec(tmp, "ref"))) == 0
    return tmp


def test_it_learns_on_held_out_records(trained):
    evals = [r for r in records(trained / "ref") if "eval_reward_margin" in r]
    assert [r["step"] for r in evals] == [0, 12, 24]
    start, end = evals[0], evals[-1]
    # step 0: the policy is the reference, every reward 0 (cached from other rows: float rounding)
    assert abs(start["eval_reward_margin"]) < 1e-3 and start["eval_kl"] < 1e-3
    assert start["eval_preference_loss"] == pytest.approx(0.5, abs=1e-3)  # λ(1 − σ(0)) with λ = 1
    assert start["eval_preference_accuracy"] == pytest.approx(0.5, abs=0.05)  # ties count half
    assert start["eval_records"] == HELD
    # learnt: the desirable answers' log-ratio rises against the undesirable ones' on unseen prompts
    assert end["eval_reward_margin"] > 0.15
    assert end["eval_reward_margin"] > evals[1]["eval_reward_margin"] > start["eval_reward_margin"]
    assert end["eval_preference_loss"] < start["eval_preference_loss"] - 0.02
    assert end["eval_kl"] >= 0


def test_step_metrics_and_the_cache(trained):
    run_dir = trained / "ref"
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 25))
    for r in steps:
        for key in ("loss", "kl", "preference_accuracy", "records", "desirable", "undesirable", "lr", "grad_norm"):
            assert key in r, key
        assert r["desirable"] + r["undesirable"] == r["records"] > 0 and r["kl"] >= 0
        if r["desirable"] and r["undesirable"]:
            assert r["reward_margin"] == pytest.approx(r["reward_desirable"] - r["reward_undesirable"])
    first = steps[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-3) and first["kl"] < 1e-4
    path = cache.cache_path(str(run_dir))
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        print_ = json.loads(f.metadata()["fingerprint"])
    assert print_["kto"] == "KL samples seed 1"
    tensors = cache.load(path, print_)
    assert tensors["train"].shape == (TRAIN, 2) and tensors["eval"].shape == (HELD, 2)
    assert (tensors["train"] < 0).all()  # the record's and its KL sample's log-probs
    from pgs.runtime.tools.report import write_report

    rows = dict(write_report(str(run_dir)))
    assert "best eval_preference_accuracy" in rows
    for png in ("rewards.png", "kl.png", "preference.png"):
        assert (run_dir / "report" / png).exists(), png


def test_live_reference_trains_the_same_first_steps(trained, tmp_path):
    for name in ("kto_train.jsonl", "kto_eval.jsonl"):
        (tmp_path / name).write_bytes((trained / name).read_bytes())
    assert run(load_spec(write_spec(tmp_path, "live", reference="live", steps=2, eval_every=0))) == 0
    live, cached = step_records(tmp_path / "live"), step_records(trained / "ref")[:2]
    for a, b in zip(live, cached):
        assert a["records"] == b["records"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-4)
