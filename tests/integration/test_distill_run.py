"""A ``[distill]`` run end to end on the CPU: a tiny Qwen3 student (random init) distilled from a
random-init teacher on the quickstart's records, half the steps on-policy; the metrics, the eval
record, a teacher equal to the student (zero loss: the teacher scores the very tokens the
student is trained on), and SIGKILL + resume bit for bit (the coin and the sampler continue)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pgs.runtime.loop.faults import Faults
from pgs.runtime.loop.train import run
from pgs.runtime.spec.load import load_spec
from helpers import (LOOP, assert_same_checkpoint, inline_table, launch, loop_fields, quickstart_head, records,
                     run_here, run_plain_and_released, step_records, write_toml)
from tiny import tiny_table

pytestmark = pytest.mark.slow

STUDENT = inline_table(tiny_table(max_position_embeddings=256))
TEACHER = inline_table(tiny_table(max_position_embeddings=256, hidden_size=48, num_hidden_layers=1))

SPEC = """
[model]
tokenizer = "pgs:quickstart/tokenizer"
init_seed = 3
config = {student}

[data]
sources = ["{train}"]
eval = "{eval}"
max_seq_len = 192
seed = 1

[distill]
teacher_config = {teacher}
teacher_init_seed = {teacher_seed}
teacher_dtype = "float32"
on_policy = 0.5
kind = "{kind}"
eval_prompts = 8

[distill.generation]
max_new_tokens = 6
temperature = 1.0
top_p = 0.95
""" + LOOP


def write_spec(tmp_path: Path, name: str = "run", **fields) -> Path:
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    if not train.exists() and "train" not in fields:
        quickstart_head("train.jsonl", 64, train)
        quickstart_head("eval.jsonl", 12, held)
    values = loop_fields(student=STUDENT, teacher=TEACHER, teacher_seed=0, kind="jsd", steps=6, eval_every=3, every=2,
                         train=train, eval=held, run_dir=tmp_path / name)
    values.update(fields)
    return write_toml(tmp_path / f"{name}.toml", SPEC, **values)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("distill")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child processes it is compared with bit for bit (helpers.child_env)
    try:
        assert run(load_spec(write_spec(tmp, "ref"))) == 0
    finally:
        torch.set_num_threads(threads)
    return tmp


def test_metrics_and_eval(uninterrupted):
    run_dir = uninterrupted / "ref"
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 7))
    coins = [r["on_policy"] for r in steps]
    assert set(coins) == {0.0, 1.0}, coins  # λ = 0.5 over six steps: both kinds happen
    for r in steps:
        assert r["loss"] > 0 and r["valid_tokens"] > 0 and r["tokens_per_s"] > 0
        if r["on_policy"]:
            assert r["generated_tokens"] > 0 and r["gen_tokens_per_s"] > 0
            assert r["valid_tokens"] <= r["generated_tokens"]  # the loss covers the sampled tokens only
        else:
            assert r["generated_tokens"] == 0
    evals = [r for r in records(run_dir) if "eval_distill_kl" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    for r in evals:
        assert r["eval_distill_kl"] > 0 and r["eval_distill_loss"] > 0 and r["eval_distill_tokens"] > 0
        assert "eval_accuracy" in r and "eval_teacher_accuracy" in r and "eval_loss" in r
    assert evals[-1]["on_policy_share"] == pytest.approx(sum(coins) / 6)
    assert evals[-1]["eval_distill_loss"] < evals[0]["eval_distill_loss"]  # the student moves toward the teacher


def test_a_teacher_equal_to_the_student_gives_zero_loss(tmp_path):
    spec = load_spec(write_spec(tmp_path, "same", teacher=STUDENT, teacher_seed=3, steps=1, eval_every=0))
    assert run(spec) == 0
    (first,) = step_records(tmp_path / "same")
    assert abs(first["loss"]) < 1e-6


def test_sigkill_then_resume_is_bit_exact(uninterrupted, tmp_path):
    # the same data files (their paths are part of the stream's position)
    spec = write_spec(tmp_path, "cut", train=uninterrupted / "train.jsonl", eval=uninterrupted / "eval.jsonl")
    first = launch(spec, **Faults(crash_at=("step", 5)).env())
    assert first.returncode != 0
    assert run_here(spec, "--resume", "auto") == 0  # in this process, one thread
    assert_same_checkpoint(uninterrupted / "ref" / "step_6", tmp_path / "cut" / "step_6")
    a = [(r["loss"], r["on_policy"], r["generated_tokens"]) for r in step_records(uninterrupted / "ref")]
    b = [(r["loss"], r["on_policy"], r["generated_tokens"]) for r in step_records(tmp_path / "cut")]
    assert a == b[-len(a):] and b[-1] == a[-1]


def test_gradient_release_trains_the_same_objective(tmp_path):
    """With the chain inside backward (``memory.gradient_release``) a distillation step agrees on
    the loss before backward and steps as the plain binder does (to float rounding); both
    on-policy and off-policy steps (the same coins: the same seed)."""
    a, b = run_plain_and_released(tmp_path, write_spec(tmp_path, "plain", steps=3, eval_every=0).read_text())
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["on_policy"] == y["on_policy"] and x["valid_tokens"] == y["valid_tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)
