"""The control plane: agreed flags, skips and the skip cap, HALT.json, wall budget, preflight."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from pgs.errors import EXIT_PREFLIGHT, EXIT_SKIP_CAP, EXIT_WALL_BUDGET, HaltError, PreflightRefused
from pgs.runtime.loop import control
from pgs.runtime.loop.faults import Faults

from helpers import assert_same_checkpoint, launch, records, run_here, step_records, tiny_spec


# -- units ------------------------------------------------------------------------------
def test_agree_is_identity_on_one_process():
    assert control.agree([0, 1, 0, 3]) == [0, 1, 0, 3]


def _agree_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        flags = [15 if rank == 1 else 0, 0, int(rank == 0), 0]
        result = control.agree(flags)
        with open(f"{out}.{rank}", "w") as handle:
            json.dump(result, handle)
    finally:
        torch.distributed.destroy_process_group()


def test_agree_is_a_max_all_reduce_under_torch_distributed(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "agreed")
    mp.spawn(_agree_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads(open(f"{out}.{rank}").read()) == [15, 0, 1, 0]


def test_skip_counter_consecutive_cap():
    skips = control.SkipCounter(max_consecutive=3, max_fraction=0.05)
    for _ in range(3):
        skips.record(True)
    assert skips.verdict() is None
    skips.record(True)
    assert "4 consecutive" in skips.verdict()
    skips.record(False)
    assert skips.consecutive == 0 and skips.skipped == 4


def test_skip_counter_fraction_counts_only_after_min_steps():
    skips = control.SkipCounter(max_consecutive=3, max_fraction=0.05, min_steps=100)
    for i in range(99):
        skips.record(i % 10 == 0)  # 10% skipped, never consecutive
    assert skips.verdict() is None
    skips.record(False)
    assert "10 of 100" in skips.verdict()
    state = skips.state_dict()
    again = control.SkipCounter()
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_stop_signals_record_the_first_signal_and_restore_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with control.StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C while stopping: give up at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_wall_clock():
    assert not control.WallClock(None).spent()
    assert control.WallClock(10.0, start=0.0).spent()


def test_halt_writes_the_marker_atomically(tmp_path):
    err = control.halt(str(tmp_path), "too many skips", step=7, details={"skipped": 4})
    assert isinstance(err, HaltError) and err.exit_code == EXIT_SKIP_CAP
    marker = json.loads((tmp_path / "HALT.json").read_text())
    assert marker["reason"] == "too many skips" and marker["step"] == 7 and marker["exit_code"] == 81
    assert os.listdir(tmp_path) == ["HALT.json"]


def test_preflight_refuses_an_unwritable_dir_and_a_full_disk(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(PreflightRefused, match="not writable") as err:
        control.preflight(str(blocker / "run"), 1)
    assert err.value.exit_code == EXIT_PREFLIGHT
    control.preflight(str(tmp_path / "ok"), 1)
    monkeypatch.setattr(control.shutil, "disk_usage", lambda p: type("U", (), {"free": 10 * 2**20})())
    with pytest.raises(PreflightRefused, match="GiB free"):
        control.preflight(str(tmp_path / "ok"), 2**30)


# -- the loop, as subprocesses -----------------------------------------------------------
def test_nan_steps_are_skipped_without_touching_params_or_state(tmp_path):
    spec = tiny_spec(tmp_path, "run", steps=8, every=2)
    done = launch(spec, **Faults(nan_steps={5, 6}).env())
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    rows = step_records(run_dir)
    assert [r["step"] for r in rows if r["skipped"]] == [5, 6]
    assert rows[-1]["skipped_total"] == 2
    assert [r["step"] for r in records(run_dir) if r.get("event") == "skip"] == [5, 6]
    # Steps 5 and 6 changed nothing: the weights and the optimizer state at 6 are those at 4.
    a, b = run_dir / "step_4", run_dir / "step_6"
    for name in ("model.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(a / name), load_file(b / name)
        assert all(torch.equal(ta[k], tb[k]) for k in ta), name
    trainer = json.loads((run_dir / "step_8" / "trainer.json").read_text())
    assert trainer["skips"] == {"steps": 8, "skipped": 2, "consecutive": 0}
    assert not (run_dir / "HALT.json").exists()


def test_skip_cap_writes_halt_and_exits_81(tmp_path):
    spec = tiny_spec(tmp_path, "run", steps=12, every=0, max_skips=2)
    done = launch(spec, **Faults(nan_steps={3, 4, 5, 6}).env())
    assert done.returncode == EXIT_SKIP_CAP, done.stderr[-3000:]
    marker = json.loads((tmp_path / "run" / "HALT.json").read_text())
    assert marker["exit_code"] == 81 and marker["step"] == 5 and "3 consecutive" in marker["reason"]
    assert "halted at step 5" in done.stderr
    assert max(r["step"] for r in step_records(tmp_path / "run")) == 5


def test_wall_budget_checkpoints_exits_82_and_resumes(tmp_path):
    spec = tiny_spec(tmp_path, "run", steps=6, every=0, wall=0.001)
    done = launch(spec)
    assert done.returncode == EXIT_WALL_BUDGET, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert (run_dir / "step_1" / "COMPLETE").exists()
    stop = [r for r in records(run_dir) if r.get("event") == "stop"]
    assert stop[0]["exit_code"] == 82 and "max_wall_seconds" in stop[0]["reason"]
    marker = json.loads((run_dir / "HALT.json").read_text())  # a verdict: supervisors must not relaunch
    assert marker["exit_code"] == 82 and marker["checkpoint"].endswith("step_1")
    # Without a budget the same run resumes and matches an uninterrupted one.
    free = tiny_spec(tmp_path, "run", steps=6, every=0)
    assert run_here(free, "--resume", "auto") == 0
    assert run_here(tiny_spec(tmp_path, "ref", steps=6, every=0)) == 0  # one thread, as the children
    assert_same_checkpoint(run_dir / "step_6", tmp_path / "ref" / "step_6")


def test_preflight_refusal_exits_83(tmp_path, monkeypatch, capsys):
    """Too little free disk for the run's checkpoints: exit 83 and one ``pgs: error:`` line.
    (A run folder under a file is a spec error now, exit 2 from validate and run alike:
    tests/integration/test_faults_validate_run.py.)"""
    import collections

    from pgs.cli import main

    spec = tiny_spec(tmp_path, "run", steps=4)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(control.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1024))
    assert main(["run", str(spec)]) == EXIT_PREFLIGHT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("pgs: error: checkpoint.dir:") and "GiB free" in err[0], err


def test_faults_travel_through_one_variable_and_refuse_nonsense():
    """``Faults.env()`` / ``Faults.from_env``: what a test hands a child ``pgs run`` comes back
    equal; no variable is no fault; a bad crash point or a garbled variable is a clear error."""
    from pgs.errors import InvalidArgument
    from pgs.runtime.loop.faults import NO_FAULTS

    faults = Faults(nan_steps={3, 1}, crash_at=("checkpoint_write", 8), slow_step_s=0.25)
    assert Faults.from_env(faults.env()) == faults
    assert faults.poisons(3) and not faults.poisons(2)
    assert Faults.from_env({}) is NO_FAULTS and not NO_FAULTS.poisons(1)
    with pytest.raises(InvalidArgument, match="crash_at: 'checkpoint' is not one of"):
        Faults(crash_at=("checkpoint", 3))
    with pytest.raises(InvalidArgument, match=r"\$PGS_FAULTS: not a fault description"):
        Faults.from_env({"PGS_FAULTS": "nan_steps=5"})


@pytest.mark.parametrize("keep,export,copies", [(1, "false", 2), (2, "true", 4), (0, "false", 3)])
def test_the_runs_disk_preflight_counts_what_validate_counts(tmp_path, monkeypatch, keep, export, copies):
    """``pgs run``'s own disk check asks for ``resources.disk_copies`` checkpoints (the kept ones,
    the one being written, best/, the export), as ``pgs validate`` does; it asked for 3 whatever
    the spec said, which refused a Qwen3-8B run that keeps one checkpoint on a 64 GiB disk."""
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    asked = []

    def fake(run_dir, checkpoint_bytes, *, factor=3.0):
        asked.append(factor)
        raise PreflightRefused("stop here")

    monkeypatch.setattr(control, "preflight", fake)
    spec = load_spec(tiny_spec(tmp_path, "run", steps=4, every=0, keep=keep, export=export))
    try:
        code = run(spec)
    except PreflightRefused as err:  # raised, or turned into its exit code by the loop
        assert "stop here" in str(err)
        code = err.exit_code
    assert code == EXIT_PREFLIGHT
    assert asked == [copies]
