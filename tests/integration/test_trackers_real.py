"""TensorBoard and MLflow for real: a short run logs to both, and each package's own reader
(TensorBoard's ``EventAccumulator``, an ``MlflowClient`` on the run's local file store) gives
back the numbers ``metrics.jsonl`` holds, at the same steps.  Skipped where a package is not
installed (``pip install -e '.[test]'`` installs both)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from helpers import cpu_spec, launch

STEPS = 4
INSTALLED = [name for name in ("tensorboard", "mlflow") if importlib.util.find_spec(name) is not None]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    if not INSTALLED:
        pytest.skip("neither tensorboard nor mlflow is installed (pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("trackers")
    spec = cpu_spec(tmp)
    sets = [f"train.steps={STEPS}", "train.log_every=1", *(f"log.{name}=true" for name in INSTALLED)]
    out = launch(spec, args=tuple(a for s in sets for a in ("--set", s)), MLFLOW_TRACKING_URI="")
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "run"


def _logged(run_dir: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r and isinstance(r.get("step"), int)}


def _same(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, value in want.items():
        assert math.isclose(got[step], value, rel_tol=1e-6), (step, got[step], value)  # float32 in events


def test_tensorboard_event_files_read_back(run_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / "run"))
    events.Reload()
    assert {"loss", "lr", "grad_norm"} <= set(events.Tags()["scalars"])
    for key in ("loss", "lr", "grad_norm"):
        _same({e.step: e.value for e in events.Scalars(key)}, _logged(run_dir, key))


def test_mlflow_file_store_reads_back(run_dir, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only so

    client = MlflowClient(tracking_uri="file:" + str(run_dir / "mlruns"))
    experiment = client.get_experiment_by_name("spec")  # log.project: the spec file's name
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["optimizer.alias"] == "adamw"
    for key in ("loss", "lr", "grad_norm"):
        _same({m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}, _logged(run_dir, key))
