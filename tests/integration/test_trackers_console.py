"""Trackers and logs: TensorBoard and MLflow beside wandb/trackio with the spec's names, a
clear refusal when a tracker's extra is missing, plain lines on a non-interactive console,
and no Triton (and so no nanobind leak report) in a CPU run's process."""

from __future__ import annotations

import importlib.machinery
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pgs.cli import main
from pgs.runtime.loop.metrics import MetricsLog
from helpers import cli_error, cpu_spec

ROOT = Path(__file__).resolve().parents[2]


def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb", "trackio"])
def test_a_tracker_without_its_extra_is_refused_before_the_run(tmp_path, capsys, monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # as on an install without it
    spec = cpu_spec(tmp_path)
    for command in ("validate", "run"):
        code, line = cli_error([command, str(spec), "--set", f"log.{tracker}=true"], capsys)
        assert code == 2
        assert f"log.{tracker} = true needs the {tracker} package: pip install 'pgs[{tracker}]'" in line
    assert not (tmp_path / "run").exists()


def _run(tmp_path: Path, *sets: str) -> Path:
    spec = cpu_spec(tmp_path)
    assert main(["run", str(spec), "--set", "train.steps=2", *[a for s in sets for a in ("--set", s)]]) == 0
    return tmp_path / "run"


def test_mlflow_gets_the_spec_names_metrics_and_fields(tmp_path, monkeypatch):
    calls = []
    _fake_module(monkeypatch, "mlflow",
                 set_tracking_uri=lambda uri: calls.append(("uri", uri)),
                 set_experiment=lambda name: calls.append(("experiment", name)),
                 start_run=lambda run_name: calls.append(("run", run_name)),
                 log_params=lambda params: calls.append(("params", params)),
                 log_metrics=lambda numbers, step: calls.append(("metrics", step, numbers)),
                 end_run=lambda: calls.append(("end",)))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = _run(tmp_path, "log.mlflow=true", 'log.project="proj"')
    assert ("experiment", "proj") in calls and ("run", "run") in calls  # run name: the run folder's
    assert ("uri", "file:" + str(run_dir / "mlruns")) in calls
    params = next(c[1] for c in calls if c[0] == "params")
    assert params["train.steps"] == "2" and params["model.config.hidden_size"] == "32"
    steps = [c[1] for c in calls if c[0] == "metrics" and "loss" in c[2]]
    assert steps == [1, 2]
    assert calls[-1] == ("end",)


def test_tensorboard_writes_scalars_under_the_run_folder(tmp_path, monkeypatch):
    written = []

    class SummaryWriter:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, key, value, global_step=None):
            written.append((key, global_step, value))

        def flush(self):
            pass

        def close(self):
            written.append(("closed",))

    _fake_module(monkeypatch, "tensorboard")
    _fake_module(monkeypatch, "torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    run_dir = _run(tmp_path, "log.tensorboard=true", 'log.run_name="first"')
    assert written[0] == ("dir", str(run_dir / "tensorboard" / "first"))
    assert [w[1] for w in written if w[0] == "loss"] == [1, 2]
    assert written[-1] == ("closed",)


def test_wandb_project_defaults_to_the_spec_file_name(tmp_path, monkeypatch):
    seen = {}

    class Run:
        def log(self, numbers, step=None):
            seen.setdefault("steps", []).append(step)

        def finish(self):
            seen["finished"] = True

    def init(project, name, config):
        seen.update(project=project, name=name)
        return Run()

    _fake_module(monkeypatch, "wandb", init=init)
    _run(tmp_path, "log.wandb=true")
    assert seen["project"] == "spec" and seen["name"] == "run" and seen["finished"]  # spec.toml, run/


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("stream_tty,stdout_tty", [(False, False), (True, False), (False, True)])
def test_a_non_interactive_console_gets_one_plain_line_per_log_every(tmp_path, monkeypatch, stream_tty, stdout_tty):
    monkeypatch.setattr(sys, "stdout", _Stream(stdout_tty))
    stream = _Stream(stream_tty)
    log = MetricsLog(str(tmp_path), total_steps=10, print_every=4, stream=stream)
    log.start(0)
    assert not log.interactive() and log._progress is None
    for step in range(1, 11):
        log.step({"step": step, "loss": 1.0 / step})
    log.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["4/10", "8/10", "10/10"]
    assert all("\x1b" not in line for line in lines)  # no control sequences in a log file


def test_a_terminal_gets_the_live_display_on_its_own_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Stream(True))
    monkeypatch.delenv("TERM", raising=False)
    stream = _Stream(True)
    log = MetricsLog(str(tmp_path), total_steps=3, stream=stream)
    log.start(0)
    assert log._progress is not None and log._progress.console.file is stream
    log.close()


def test_importing_pgs_does_not_import_triton():
    code = ("import sys, pgs.cli, pgs.func, pgs.runtime.loop.train, pgs.runtime.tools.supervise; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gate applies where no CUDA device is")
def test_a_cpu_run_ends_without_nanobind_noise(tmp_path):
    from helpers import child_env, tiny_spec

    spec = tiny_spec(tmp_path, steps=4, every=0)
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pgs", "run", str(spec)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nanobind" not in done.stderr + done.stdout
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line] == [1, 2, 3, 4]


def test_a_record_logged_late_goes_on_the_trackers_axis_where_it_was_logged(tmp_path, monkeypatch):
    """A background checkpoint's event names the step it saved but is logged steps later
    (``logged_at_step``); wandb drops a step lower than the last one it was given."""
    seen = []

    class Run:
        def log(self, numbers, step=None):
            seen.append((step, sorted(numbers)))

        def finish(self):
            pass

    _fake_module(monkeypatch, "wandb", init=lambda project, name, config: Run())
    log = MetricsLog(str(tmp_path), total_steps=10, print_every=100, trackers=["wandb"], project="p",
                     run_name="r", config={}, stream=io.StringIO())
    log.write({"step": 6, "loss": 1.0})
    log.write({"step": 4, "event": "checkpoint", "checkpoint_seconds": 0.07, "logged_at_step": 6})
    log.close()
    assert seen == [(6, ["loss"]), (6, ["checkpoint_seconds", "logged_at_step"])]
