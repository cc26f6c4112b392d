"""A resume that changes what the learning-rate schedule depends on (``[schedule]``,
``train.steps`` / ``train.epochs``) is refused when the new schedule would give a step already
trained another learning rate, and goes on with one line saying what changed when it would not
(docs/checkpoints.md, "What a resume may change")."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import cli_error, cpu_spec, step_records


def _spec(tmp_path: Path, steps: int, every: int, schedule: str) -> Path:
    spec = cpu_spec(tmp_path)
    text = spec.read_text().replace("steps = 1\n", f"steps = {steps}\n").replace("\nevery = 0\n", f"\nevery = {every}\nkeep = 0\n")
    spec.write_text(text + f"\n[schedule]\n{schedule}\n")
    return spec


def _run(argv, capsys) -> tuple[int, str]:
    from pgs.cli import main

    code = main(argv)
    return code, capsys.readouterr().err


def test_extending_a_cosine_run_is_refused(tmp_path, capsys):
    """The issue's case: 60 cosine steps resumed with train.steps = 90 would climb back up."""
    spec = _spec(tmp_path, steps=6, every=3, schedule='name = "cosine"\npeak = 1e-3\nwarmup = 2')
    assert _run(["run", str(spec)], capsys)[0] == 0
    lrs = [r["lr"] for r in step_records(tmp_path / "run")]
    code, line = cli_error(["run", str(spec), "--resume", "auto", "--set", "train.steps=9"], capsys)
    assert code == 2
    assert line.startswith("pgs: error: --resume: train.steps 6 -> 9 changes the learning rate of steps already "
                           "trained (from step 4: "), line
    assert "after step 6 the run would go on at " in line and f"where it was at {lrs[-1]:.3g}" in line
    assert line.endswith("resume with the checkpoint's values, or start a new run (docs/checkpoints.md)")
    assert len(step_records(tmp_path / "run")) == 6  # nothing trained, nothing cut
    # a change of the schedule itself, from the middle of the run
    code, line = cli_error(["run", str(spec), "--resume", str(tmp_path / "run" / "step_3"),
                            "--set", "schedule.peak=2e-3"], capsys)
    assert code == 2 and line.startswith("pgs: error: --resume: schedule.peak 0.001 -> 0.002 changes the learning "
                                         "rate of steps already trained (from step 2: 0.0005 then, 0.001 now;"), line


def test_extending_a_constant_run_says_so_and_goes_on(tmp_path, capsys):
    spec = _spec(tmp_path, steps=3, every=3, schedule='name = "constant"\npeak = 1e-3')
    assert _run(["run", str(spec)], capsys)[0] == 0
    code, err = _run(["run", str(spec), "--resume", "auto", "--set", "train.steps=5"], capsys)
    assert code == 0, err
    assert ("pgs: resume: train.steps 3 -> 5; the learning rate of the 3 steps trained is unchanged, "
            "step 4 goes on at 0.001") in err.splitlines(), err
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["lr"] == pytest.approx(1e-3) for r in records)


def test_a_longer_wsd_stable_phase_resumed_inside_it(tmp_path, capsys):
    """WSD of 10 steps (warmup 2, decay 2) resumed at step 4 as 20 steps: steps 1-4 had the
    learning rates the 20-step schedule gives them, so the run goes on at the peak."""
    spec = _spec(tmp_path, steps=10, every=4, schedule='name = "wsd"\npeak = 1e-3\nwarmup = 2')
    assert _run(["run", str(spec)], capsys)[0] == 0
    code, err = _run(["run", str(spec), "--resume", str(tmp_path / "run" / "step_4"), "--set", "train.steps=20"],
                     capsys)
    assert code == 0, err
    assert "pgs: resume: train.steps 10 -> 20; the learning rate of the 4 steps trained is unchanged, step 5 goes on at 0.001" in err
    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[4]["lr"] == pytest.approx(1e-3) and records[15]["lr"] == pytest.approx(1e-3)
    assert records[-1]["lr"] < 1e-3  # the decay at the end of the 20 steps


def test_an_unchanged_resume_says_nothing_about_the_schedule(tmp_path, capsys):
    spec = _spec(tmp_path, steps=4, every=2, schedule='name = "cosine"\npeak = 1e-3\nwarmup = 1')
    assert _run(["run", str(spec)], capsys)[0] == 0
    code, err = _run(["run", str(spec), "--resume", str(tmp_path / "run" / "step_2")], capsys)
    assert code == 0, err
    assert "pgs: resumed from" in err and "pgs: resume:" not in err
