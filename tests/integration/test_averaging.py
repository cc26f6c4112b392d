"""Weight averaging in the loop (issue 24, item 5): the CPU EMA of the weights equals a hand
computation, is evaluated beside the model, exported as an HF folder that loads, and resumes
exactly from a checkpoint; merge-back pulls the weights toward the run's starting ones (linear
SFA and SLERP as ``pgs.func.merge_back``); an ``ema`` chain entry is refused with a pointer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import pgs.func as pf
from pgs.cli import main
from pgs.runtime.loop import train
from pgs.runtime.loop.averaging import CHECKPOINT_FILE, EXPORT_DIR, WeightAverager
from pgs.runtime.spec.load import load_spec
from helpers import assert_same_tensors, tiny_spec


def _run(tmp_path, name, *sets, resume=None, **fields):
    spec = load_spec(tiny_spec(tmp_path, name, **fields), list(sets))
    assert train.run(spec, resume=resume) == 0
    return tmp_path / name


@pytest.mark.slow
def test_ema_equals_the_hand_computation_is_evaluated_and_exported(tmp_path):
    from transformers import AutoModelForCausalLM

    from pgs.runtime.spec.sections import ASSETS_DIR

    evals = tmp_path / "eval.jsonl"  # a few records without a task checker: eval loss only (no generation)
    lines = (ASSETS_DIR / "quickstart" / "eval.jsonl").read_text().splitlines()[:8]
    evals.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "task"}) + "\n"
                             for x in lines))
    run_dir = _run(tmp_path, "ema", "averaging.ema=0.75", "averaging.ema_every=2", "checkpoint.every=2",
                   f'data.eval="{evals}"', steps=6, export="true", eval_every=6)
    theta = {s: load_file(run_dir / f"step_{s}" / "model.safetensors") for s in (2, 4, 6)}
    averaged = load_file(run_dir / "step_6" / CHECKPOINT_FILE)
    assert int(averaged["count"]) == 3
    names = [k[len("ema."):] for k in averaged if k.startswith("ema.")]
    assert names and all(n in theta[6] for n in names)
    for name in names:  # copy at step 2, then δ·e + (1 − δ)·θ at steps 4 and 6, in fp32
        hand = theta[2][name].float()
        for s in (4, 6):
            hand = 0.75 * hand + 0.25 * theta[s][name].float()
        torch.testing.assert_close(averaged[f"ema.{name}"], hand, rtol=1e-6, atol=1e-7)
        assert not torch.equal(hand, theta[6][name].float())  # the average is not the last weights
    exported = AutoModelForCausalLM.from_pretrained(run_dir / EXPORT_DIR)  # loads with transformers
    state = exported.state_dict()
    for name in names:
        assert torch.equal(state[name], averaged[f"ema.{name}"].to(state[name].dtype)), name
    final = load_file(run_dir / "final" / "model.safetensors")  # the model's own export is untouched
    assert all(torch.equal(final[n], theta[6][n]) for n in names)
    info = json.loads((run_dir / EXPORT_DIR / "pgs_export.json").read_text())
    assert info == {"step": 6, "ema": 0.75}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 6] and "ema_eval_loss" in evals[1]
    assert "ema_eval_loss" not in evals[0]  # nothing averaged yet before the first step
    assert evals[1]["ema_eval_loss"] != evals[1]["eval_loss"]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_average(tmp_path):
    sets = ("averaging.ema=0.9", "checkpoint.every=2", "schedule.total=6")
    whole = _run(tmp_path, "whole", *sets, steps=6)
    _run(tmp_path, "part", *sets, steps=3)  # stops at 3 (a checkpoint at 2 and at 3)
    (tmp_path / "part" / "step_3").rename(tmp_path / "part" / "unused_step_3")  # resume from step 2
    part = _run(tmp_path, "part", *sets, resume="auto", steps=6)
    for name in ("model.safetensors", CHECKPOINT_FILE):
        assert_same_tensors(load_file(whole / "step_6" / name), load_file(part / "step_6" / name), name)


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2, bias=False)


@pytest.mark.parametrize("method", ["linear", "slerp"])
def test_merge_back_every_p_t_steps_and_at_the_end(method):
    torch.manual_seed(0)
    model = _Two()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    avg = WeightAverager(model, total_steps=10, merge=method, merge_weight=0.3, merge_period=0.4)
    assert avg.merge_every == 4
    merged_at = []
    for step in range(1, 11):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        avg.after_step(step)
        after = dict(model.named_parameters())
        if any(not torch.equal(before[n], after[n]) for n in before):
            merged_at.append(step)
            expected = pf.merge_back(before, base, 0.3, method=method)
            for n in before:
                torch.testing.assert_close(after[n].detach(), expected[n])
            if method == "linear":  # SFA by hand
                for n in before:
                    torch.testing.assert_close(after[n].detach(), 0.7 * before[n] + 0.3 * base[n])
    assert merged_at == [4, 8, 10]


def test_a_full_merge_at_the_end_returns_the_starting_weights(tmp_path):
    spec = load_spec(tiny_spec(tmp_path, "m", steps=3), ["averaging.merge=\"linear\"", "averaging.merge_weight=1.0"])
    start = train.setup(spec)
    try:
        initial = {n: p.detach().clone() for n, p in start.model.named_parameters()}
    finally:
        start.loader.close()
    run_dir = _run(tmp_path, "m", "averaging.merge=\"linear\"", "averaging.merge_weight=1.0", steps=3, every=3)
    final = load_file(run_dir / "step_3" / "model.safetensors")
    assert all(torch.equal(final[n], initial[n]) for n in initial if n in final)


@pytest.mark.parametrize("sets, field", [
    (["optimizer.args={}", 'optimizer.chain=[{ name = "scale_by_adam" }, { name = "ema", decay = 0.99 }, '
      '{ name = "scale_by_learning_rate" }]'], "optimizer.chain[1].name"),
    (["averaging.ema=1.0"], "averaging.ema"),
    (['averaging.merge="soup"'], "averaging.merge"),
    (["averaging.merge_period=0"], "averaging.merge_period"),
    (['averaging.merge="linear"', "memory.gradient_release=true", 'memory.master_weights="fp32"',
      "optimizer.clip=0", "train.grad_accum=1"], "averaging.merge"),
])
def test_refused_by_validate_with_one_line(tmp_path, capsys, sets, field):
    argv = ["validate", str(tiny_spec(tmp_path))]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    if "chain" in field:
        assert "[averaging] ema" in err[0]
