"""``pgs supervise``: relaunch with ``--resume auto`` only after a crash that made progress.

The rule (docs/exit-codes.md) is checked case by case on :func:`decide`, the process-group
reaping on real processes, and end to end with real ``python -m pgs run`` children of a tiny
spec whose faults (``PGS_FAULTS``) crash or halt them: a crash after a checkpoint is relaunched
and the run finishes; a crash before any new checkpoint is not; a HALT is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from pgs.runtime.loop.faults import Faults
from pgs.runtime.spec.load import load_spec
from pgs.runtime.tools.supervise import Policy, Progress, decide, group_alive, reap_group, supervise
from helpers import tiny_spec

P0 = Progress(step=None, checkpoint_step=None, checkpoint=None)
P4 = Progress(step=5, checkpoint_step=4, checkpoint="step_4")
P8 = Progress(step=9, checkpoint_step=8, checkpoint="step_8")


@pytest.mark.parametrize("code,halted,before,after,relaunches,stopped,reaped,again,reason", [
    (137, None, P0, P4, 0, 0, True, True, "after progress"),
    (1, None, P4, P8, 1, 0, True, True, "after progress"),
    (143, None, P4, P8, 0, 0, True, True, "after progress"),  # pre-empted by the scheduler
    (137, None, P4, P8, 2, 0, True, False, "retries spent"),
    (137, None, P4, P4, 0, 0, True, False, "no progress"),
    (137, None, P4, Progress(9, 4, "step_4"), 0, 0, True, False, "checkpoint stayed"),  # steps, no new checkpoint
    (1, 81, P4, P8, 0, 0, True, False, "HALT.json"),  # torchrun's 1 with a fresh marker
    (81, None, P4, P8, 0, 0, True, False, "skip cap"),
    (0, None, P4, P8, 0, 0, True, False, "finished"),
    (2, None, P0, P0, 0, 0, True, False, "bad input"),
    (83, None, P0, P0, 0, 0, True, False, "preflight"),
    (84, None, P4, P8, 0, 0, True, False, "disk is full"),
    (143, None, P4, P8, 0, 15, True, False, "received signal 15"),
    (137, None, P4, P8, 0, 0, False, False, "did not empty"),
])
def test_the_relaunch_rule(code, halted, before, after, relaunches, stopped, reaped, again, reason):
    got, why = decide(code, halted=halted, before=before, after=after, relaunches=relaunches,
                      policy=Policy(retries=2), stopped=stopped, reaped=reaped)
    assert got is again and reason in why, why


def test_backoff_doubles_up_to_its_cap():
    policy = Policy(backoff_s=10, backoff_max_s=35)
    assert [policy.backoff(k) for k in range(4)] == [10, 20, 35, 35]


def test_the_attempts_group_is_killed_and_confirmed_empty():
    child = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & exit 0"], start_new_session=True)
    child.wait()
    deadline = time.monotonic() + 5
    while not group_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group_alive(child.pid), "the background sleeps should outlive their shell"
    assert reap_group(child.pid, timeout_s=10)
    assert group_alive(child.pid) == []


# --------------------------------------------------------------------------- real children


def _supervise(tmp_path: Path, monkeypatch, faults: Faults, **spec_fields) -> tuple[int, list[dict], Path]:
    spec_path = tiny_spec(tmp_path, steps=8, every=4, **spec_fields)
    monkeypatch.setenv("PGS_FAULTS", faults.env()["PGS_FAULTS"])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    waits = []
    code = supervise(load_spec(spec_path), str(spec_path), policy=Policy(retries=2, backoff_s=0.5),
                     sleep=waits.append)
    run_dir = tmp_path / "run"
    log = [json.loads(line) for line in (run_dir / "supervise.jsonl").read_text().splitlines()]
    return code, log, run_dir


@pytest.mark.slow
def test_a_crash_after_progress_is_relaunched_and_the_run_finishes(tmp_path, monkeypatch):
    code, log, run_dir = _supervise(tmp_path, monkeypatch, Faults(crash_at=("step", 6), on_attempt=1))
    assert code == 0
    events = [r["event"] for r in log]
    assert events == ["start", "launch", "exit", "relaunch", "launch", "exit", "stop"], events
    first, second = (r for r in log if r["event"] == "exit")
    assert first["exit_code"] == 137 and first["relaunch"] and first["group_emptied"]
    assert first["after"]["checkpoint_step"] == 4 and first["after"]["step"] >= 4
    launches = [r for r in log if r["event"] == "launch"]
    assert "--resume" not in launches[0]["command"] and launches[1]["command"][-2:] == ["--resume", "auto"]
    assert second["exit_code"] == 0 and not second["relaunch"]
    assert (run_dir / "step_8" / "COMPLETE").exists()


@pytest.mark.slow
def test_a_crash_without_progress_is_not_relaunched(tmp_path, monkeypatch):
    code, log, _ = _supervise(tmp_path, monkeypatch, Faults(crash_at=("step", 2)))
    assert code == 137
    assert [r["event"] for r in log].count("launch") == 1
    stop = log[-1]
    assert stop["event"] == "stop" and "no progress" in stop["reason"]
    assert not (tmp_path / "run" / ".pgs-supervise.lock").exists()  # let go at the end


@pytest.mark.parametrize("held, by", [(".pgs-supervise.lock", "a live pgs supervise"), (".pgs.lock", "a live run")])
def test_a_folder_held_by_another_supervisor_or_a_live_run_is_refused_before_anything_is_written(
        tmp_path, held, by):
    """Two supervisors of one folder would write one supervise.jsonl and launch runs that the
    run lock refuses one after the other; a supervisor started beside a live run likewise.  Both
    are refused with the one line of the run lock, and the folder's log is left as it was."""
    from pgs.errors import RunInUse
    from pgs.runtime.store.lock import RunLock

    spec_path = tiny_spec(tmp_path, steps=8, every=4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "supervise.jsonl").write_text('{"event": "start"}\n')
    other = RunLock(str(run_dir), held).acquire()  # the other holder (its own open file: flock excludes it)
    try:
        with pytest.raises(RunInUse, match=f"is in use by {by}: pid "):
            supervise(load_spec(spec_path), str(spec_path), policy=Policy(retries=0))
    finally:
        other.release()
    assert (run_dir / "supervise.jsonl").read_text() == '{"event": "start"}\n'
    assert not (run_dir / ".pgs-supervise.lock").exists()


@pytest.mark.slow
def test_a_halt_is_not_relaunched_even_after_progress(tmp_path, monkeypatch):
    code, log, run_dir = _supervise(tmp_path, monkeypatch, Faults(nan_steps=[6, 7]), max_skips=1)
    assert code == 81
    assert (run_dir / "HALT.json").exists()
    exit_ = next(r for r in log if r["event"] == "exit")
    assert exit_["after"]["checkpoint_step"] == 4  # it had made progress
    assert not exit_["relaunch"] and "HALT.json" in exit_["reason"]
    assert [r["event"] for r in log].count("launch") == 1
