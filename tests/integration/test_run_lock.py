"""One writer per run folder (pgs/runtime/store/lock.py): a second ``pgs run``, a ``--resume
auto`` or an ``--overwrite`` into the folder of a live run is refused with one line naming it,
and leaves every file of that run as it was; the lock of a SIGKILLed run is taken over.

The live run is a child ``pgs run`` held after a chosen step by ``Faults.pause_at`` (it waits
for a file the test writes), so every check here happens at a known point of the first run,
whatever the machine's speed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pgs import cli
from pgs.errors import RunInUse
from pgs.runtime.loop.faults import Faults
from pgs.runtime.store import lock as run_lock
from helpers import ROOT, child_env, cli_error, command, records, step_records, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

HANG_GUARD_S = 600  # only so that a broken run cannot hang the suite; nothing depends on it


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _start_paused(spec: Path, gate: Path, step: int) -> subprocess.Popen:
    """``pgs run SPEC`` as a child, held after ``step`` until ``gate/go`` exists; returns once it
    is held there (it has written ``gate/paused``)."""
    gate.mkdir()
    proc = subprocess.Popen(command(spec), cwd=ROOT, env=child_env(**Faults(pause_at=(step, str(gate))).env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (gate / "paused").exists():
        if proc.poll() is not None:
            pytest.fail(f"the first run ended before its pause: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the first run never reached its pause"
        time.sleep(0.02)
    assert int((gate / "paused").read_text()) == proc.pid
    return proc


def test_a_second_run_resume_or_overwrite_into_a_live_runs_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=4, every=2)
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    first = _start_paused(spec, gate, step=3)  # step_2 written, step 3 trained, its record not yet
    try:
        before = _files(run_dir)
        assert "step_2/COMPLETE" in before and "metrics.jsonl" in before
        for extra in ((), ("--resume", "auto"), ("--overwrite",)):
            code, line = cli_error(["run", str(spec), *extra], capsys)
            assert code == 2, line
            assert f"checkpoint.dir: {run_dir} is in use by a live run: pid {first.pid} on host " in line, line
            assert "pgs run" in line and str(spec) in line  # the holder's command
            assert _files(run_dir) == before, extra  # nothing of the live run touched
        assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]  # --overwrite moved nothing
    finally:
        (gate / "go").write_text("")
        out, err = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]  # one run's records, once each
    assert [r["event"] for r in records(run_dir) if r.get("event") in ("start", "resume")] == ["start"]
    assert not (run_dir / run_lock.LOCK_FILE).exists()  # a clean end removes the lock file


def test_the_lock_of_a_sigkilled_run_is_taken_over_by_its_resume(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=4, every=2)
    run_dir = tmp_path / "run"
    first = subprocess.Popen(command(spec), cwd=ROOT, env=child_env(**Faults(crash_at=("step", 3)).env()),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    left = json.loads((run_dir / run_lock.LOCK_FILE).read_text())  # the dead holder's name is still there
    assert left["pid"] == first.pid
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert f"the run folder's lock was left by pid {left['pid']} on host {left['host']}" in err, err
    assert f"resumed from {run_dir / 'step_2'}" in err
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]
    assert not (run_dir / run_lock.LOCK_FILE).exists()


def test_pgs_run_nproc_refuses_a_live_runs_folder_before_starting_any_worker(tmp_path, monkeypatch, capsys):
    from pgs.runtime.dist import launch

    spec = tiny_spec(tmp_path, "run")
    holder = run_lock.RunLock(str(tmp_path / "run")).acquire()  # a live run (this process) holds the folder

    def no_workers(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(launch.subprocess, "Popen", no_workers)
    try:
        for extra in ((), ("--resume", "auto"), ("--overwrite",)):
            code, line = cli_error(["run", str(spec), "--nproc", "2", *extra], capsys)
            assert code == 2 and f"is in use by a live run: pid {os.getpid()}" in line, line
        assert not [p for p in tmp_path.iterdir() if ".old-" in p.name]
    finally:
        holder.release()


def test_only_rank_0_locks_and_a_held_lock_names_its_holder(tmp_path):
    folder = str(tmp_path / "run")
    with run_lock.hold(folder, main=True) as held:
        with run_lock.hold(folder, main=False) as other:  # another rank of the same run
            assert other.fd is None
        with pytest.raises(RunInUse, match=f"pid {os.getpid()} on host "):
            run_lock.RunLock(folder).acquire()
        assert held.fd is not None
    assert not os.path.exists(folder)  # made for the lock, nothing written: removed again


def test_overwrite_of_a_finished_run_moves_it_aside_and_locks_the_fresh_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    from pgs.runtime.store import checkpoint as ckpt

    with run_lock.hold(str(folder)) as held:
        aside = ckpt.move_aside(str(folder))
        held.relock()
        assert (folder / run_lock.LOCK_FILE).exists() and not (Path(aside) / "metrics.jsonl").read_text() == ""
        with pytest.raises(RunInUse):
            run_lock.RunLock(str(folder)).acquire()
        assert run_lock.RunLock(aside).acquire().release() is None  # the old folder is let go
