"""The training loop end to end, as subprocesses: kill anywhere, resume, get the same bits.

A tiny Qwen3 (random init) trains on the quickstart data on the CPU.  Runs are separate
processes launched like the CLI, killed with SIGKILL at chosen points (after a step, in the
middle of writing a checkpoint) or stopped with SIGTERM, and resumed with ``--resume auto``;
their final weights and optimizer state must equal an uninterrupted run's bit for bit (that one,
and the runs no test kills, run in the test's process at one thread: ``helpers.run_here``).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pgs.runtime.loop.faults import Faults
from helpers import (ROOT, assert_same_checkpoint, child_env, command, launch, records, run_here, step_records,
                     tiny_spec, wait_for_file)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 24-step run (checkpoints every 4 steps, all kept)."""
    tmp = tmp_path_factory.mktemp("reference")
    assert run_here(tiny_spec(tmp, "ref")) == 0  # in this process, one thread (as the children)
    return tmp / "ref"


def test_each_save_is_an_event_with_its_folder_and_time(reference):
    saves = [r for r in records(reference) if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saves] == [4, 8, 12, 16, 20, 24]
    for r in saves:
        assert Path(r["path"]).name == f"step_{r['step']}" and Path(r["path"]).is_dir()
        assert r["checkpoint_seconds"] > 0
        # the save's two phases (written and hashed, then fsynced and renamed) and its files' size
        assert 0 < r["write_seconds"] and 0 < r["sync_seconds"]
        assert r["write_seconds"] + r["sync_seconds"] <= r["checkpoint_seconds"] + 0.002  # each rounded to 1 ms
        assert r["bytes"] == sum(f.stat().st_size for f in Path(r["path"]).iterdir() if f.name != "COMPLETE")


def test_sigkill_anywhere_then_resume_auto_is_bit_exact(tmp_path, reference):
    spec = tiny_spec(tmp_path, "run")
    run_dir = tmp_path / "run"

    # 1. SIGKILL halfway through writing step_8: the weights are on disk, the rest is not.
    first = launch(spec, **Faults(crash_at=("checkpoint_write", 8)).env())
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (run_dir / "step_4" / "COMPLETE").exists()
    assert not (run_dir / "step_8").exists()
    assert any(p.name.startswith(".step_8.tmp-") for p in run_dir.iterdir())

    # 2. Resume from step_4; SIGKILL right after step 14's update (step_8, step_12 written).
    second = launch(spec, "auto", **Faults(crash_at=("step", 14)).env())
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "step_4" in second.stderr
    assert not any(p.name.startswith(".step_8.tmp-") for p in run_dir.iterdir()), "stale temporary kept"

    # 3. A half-written newest folder (truncated weights) is reported and skipped.
    (run_dir / "step_16").mkdir()
    (run_dir / "step_16" / "model.safetensors").write_bytes(b"\0" * 10)

    third = launch(spec, "auto")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "skipping checkpoint" in third.stderr and "step_16" in third.stderr
    assert "step_12" in third.stderr

    assert_same_checkpoint(run_dir / "step_24", reference / "step_24")
    for step in (8, 12, 20):
        assert_same_checkpoint(run_dir / f"step_{step}", reference / f"step_{step}")
    # The resumed run's metrics read as one run: each step once, same losses as the reference.
    steps = [r["step"] for r in step_records(run_dir)]
    assert steps == list(range(1, 25))
    ref_loss = [r["loss"] for r in step_records(reference)]
    assert [r["loss"] for r in step_records(run_dir)] == ref_loss


def test_sigterm_checkpoints_exits_143_and_resume_continues_exactly(tmp_path, reference):
    spec = tiny_spec(tmp_path, "run")
    run_dir = tmp_path / "run"
    gate = tmp_path / "gate"  # the run holds after step 5 until the signal has reached it: no race with its speed
    gate.mkdir()
    proc = subprocess.Popen(command(spec), cwd=ROOT, env=child_env(**Faults(pause_at=(5, str(gate))).env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_file(gate / "paused", [proc], 180)
    proc.send_signal(signal.SIGTERM)
    wait_for_file(gate / "signalled", [proc], 180)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    stop = [r for r in records(run_dir) if r.get("event") == "stop"]
    assert stop and stop[0]["exit_code"] == 143
    stopped_at = stop[0]["step"]
    assert 5 <= stopped_at < 24
    assert (run_dir / f"step_{stopped_at}" / "COMPLETE").exists()
    if (reference / f"step_{stopped_at}").exists():
        assert_same_checkpoint(run_dir / f"step_{stopped_at}", reference / f"step_{stopped_at}")

    resumed = launch(spec, "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_checkpoint(run_dir / "step_24", reference / "step_24")


def test_final_export_loads_with_transformers_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert run_here(tiny_spec(tmp_path, "run", steps=3, every=0, export="true", eval_every=3)) == 0
    run_dir = tmp_path / "run"
    final = run_dir / "final"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (final / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    trained = load_file(run_dir / "step_3" / "model.safetensors")
    for name, p in model.state_dict().items():
        if name in trained:
            assert torch.equal(p, trained[name]), name
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    evals = [r for r in records(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert all("eval_accuracy" in r for r in evals)
    assert (run_dir / "spec.resolved.toml").exists()


def test_micro_batches_divide_by_the_steps_valid_tokens(tmp_path):
    """grad_accum = 2 x batch 2 gives the gradient of one token-mean over all 4 sequences."""
    from pgs.runtime.data import TrainStream
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step
    from pgs.runtime.loop import control

    spec_path = tiny_spec(tmp_path, "ga", steps=4)
    spec = load_spec(spec_path)
    run = setup(spec)
    stream = TrainStream(spec.data, run.tokenizer)  # the same two micro-batches as the step's
    batches = [stream.next_batch(2) for _ in range(2)]

    # Expected: one backward of (Σ all losses) / (Σ all valid tokens) on a copy of the model.
    from pgs.func.losses import token_loss
    from pgs.runtime.model.build import final_hidden, output_head
    import copy

    twin = copy.deepcopy(run.model)
    total = sum(b.num_trained_tokens for b in batches)
    losses = []
    for b in batches:
        h = final_hidden(twin, b.input_ids, b.position_ids)
        w, bias, cap = output_head(twin)
        losses.append(token_loss(h, w, b.labels).loss_sum)
    (sum(losses) / total).backward()
    expected = {n: p.grad.clone() for n, p in twin.named_parameters()}

    captured = {}
    original = run.bound.step

    def spy(**extra):
        captured.update({n: p.grad.clone() for n, p in run.model.named_parameters()})
        return original(**extra)

    run.bound.step = spy
    with control.StopSignals() as signals:
        record, _ = train_step(run, signals, control.WallClock(None))
    assert record["valid_tokens"] == total
    for n, g in expected.items():
        torch.testing.assert_close(captured[n], g, rtol=1e-5, atol=1e-7)


def test_an_all_masked_micro_batch_adds_nothing_and_no_nan(tmp_path):
    """A micro-batch with no trained token contributes 0 (not 0/0) and leaves the gradient alone."""
    import attrs

    from pgs.runtime.loop import control
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    spec = load_spec(tiny_spec(tmp_path, "masked", steps=4))
    grads = []
    for with_masked in (False, True):
        run = setup(spec)
        run.loader.close()
        batch = run.loader.stream.next_batch(2)
        masked = attrs.evolve(batch, labels=torch.full_like(batch.labels, -100), num_trained_tokens=0)
        # [batch, batch] has the same token-mean gradient as [batch, all-masked].
        queue = [batch, masked] if with_masked else [batch, batch]
        run.loader.next_step = lambda q=queue: list(q)
        captured = {}
        original = run.bound.step

        def spy(**extra):
            captured.update({n: p.grad.clone() for n, p in run.model.named_parameters()})
            return original(**extra)

        run.bound.step = spy
        with control.StopSignals() as signals:
            record, _ = train_step(run, signals, control.WallClock(None))
        assert record["skipped"] == 0 and torch.isfinite(torch.tensor(record["loss"]))
        grads.append(captured)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)


def test_the_loop_freezes_the_heap_once_after_its_first_step(tmp_path, monkeypatch):
    """``freeze_gc`` runs once, after step 1 (the compiled code and caches exist by then),
    and leaves the live objects in the collector's permanent generation."""
    import gc

    from pgs.runtime.loop import train as T
    from pgs.runtime.spec.load import load_spec

    at = []
    real = T.freeze_gc
    monkeypatch.setattr(T, "freeze_gc", lambda: at.append(T_run_step[0]) or real())
    T_run_step = [0]
    original_step = T.train_step

    def counting_step(run, *a, **k):
        out = original_step(run, *a, **k)
        T_run_step[0] = run.step
        return out

    monkeypatch.setattr(T, "train_step", counting_step)
    try:
        assert T.run(load_spec(tiny_spec(tmp_path, "gc", steps=3, every=0))) == 0
        assert at == [1] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
