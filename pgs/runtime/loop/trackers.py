"""Experiment trackers beside ``metrics.jsonl``: wandb, trackio, TensorBoard, MLflow.

Each is an optional extra (``pip install 'pgs[tensorboard]'``, ...), imported only when the
spec turns it on (``[log] wandb / trackio / tensorboard / mlflow = true``).  A tracker that is
on but not installed is refused before the run builds anything (:func:`check_trackers`, from
the preflight ``pgs validate`` and ``pgs run`` share): one line naming the field and the extra,
exit 2.  Names come from the spec: the project is ``log.project`` (default: the spec file's
name without ``.toml``), the run ``log.run_name`` (default: the run folder's name).

Every tracker is one object with ``log(numbers, step)`` and ``finish()``; the metrics log
sends it the numbers of every record it writes (``pgs.runtime.loop.metrics``).

- wandb, trackio: ``<module>.init(project=, name=, config=)``.
- TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` writing event files to
  ``<run dir>/tensorboard/<run name>`` (``tensorboard --logdir <run dir>/tensorboard``).
- MLflow: the experiment ``project`` and a run named ``run name`` on the tracking server
  ``$MLFLOW_TRACKING_URI`` names, else a local file store in ``<run dir>/mlruns`` (MLflow 3
  serves that store only with ``MLFLOW_ALLOW_FILE_STORE=true``, which pgs sets for it; read it
  with the same variable set); the spec's fields are logged as parameters (``section.field``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, ClassVar, Sequence

import attrs

from pgs.errors import MissingExtra
from pgs.runtime import process
from pgs.runtime.spec.fields import boolean, string

#: tracker -> (module that must be importable, the pgs extra that installs it)
TRACKERS = {
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
}


@attrs.frozen
class LogSpec:
    """``[log]``: where metrics go besides the console (``metrics.jsonl`` in the run folder).

    ``wandb``, ``trackio``, ``tensorboard``, ``mlflow`` turn on a tracker (an optional extra,
    ``pgs.runtime.loop.trackers``); ``project`` and ``run_name`` name the run there (``""``:
    the spec file's name, the run folder's name)."""

    section: ClassVar[str] = "log"

    jsonl: bool = attrs.field(default=True, validator=boolean)
    wandb: bool = attrs.field(default=False, validator=boolean)
    trackio: bool = attrs.field(default=False, validator=boolean)
    tensorboard: bool = attrs.field(default=False, validator=boolean)
    mlflow: bool = attrs.field(default=False, validator=boolean)
    project: str = attrs.field(default="", validator=string)
    run_name: str = attrs.field(default="", validator=string)



def enabled(log_spec) -> list[str]:
    """The trackers ``[log]`` turns on, in ``TRACKERS`` order."""
    return [name for name in TRACKERS if getattr(log_spec, name, False)]


def check_trackers(log_spec) -> None:
    """Refuse a tracker that is on but whose package is not installed (one line, exit 2)."""
    for name in enabled(log_spec):
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(f"log.{name} = true needs the {module} package: pip install 'pgs[{extra}]' "
                               f"(or set log.{name} = false)")


def names(spec) -> tuple[str, str]:
    """``(project, run name)`` of a run: ``log.project`` / ``log.run_name``, else the spec
    file's stem and the run folder's name."""
    log = spec.log
    project = getattr(log, "project", "") or _stem(getattr(spec, "source", "")) or "pgs"
    run_name = getattr(log, "run_name", "") or os.path.basename(os.path.normpath(spec.checkpoint.dir)) or "run"
    return project, run_name


def _stem(source) -> str:
    base = os.path.basename(str(source or ""))
    return base[:-5] if base.endswith(".toml") else base


class _InitTracker:
    """wandb / trackio: the module's own run object (``log(numbers, step=)``, ``finish()``)."""

    def __init__(self, module_name: str, project: str, run_name: str, config: dict):
        module = importlib.import_module(module_name)
        self.name = module_name
        self._run = module.init(project=project, name=run_name, config=config)

    def log(self, numbers: dict, step: int | None) -> None:
        self._run.log(numbers, step=step)

    def finish(self) -> None:
        self._run.finish()


class TensorBoardTracker:
    """Scalars to TensorBoard event files under ``<run dir>/tensorboard/<run name>``."""

    name = "tensorboard"

    def __init__(self, run_dir: str, run_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise MissingExtra(f"log.tensorboard = true needs the tensorboard package: pip install "
                               f"'pgs[tensorboard]' ({err})") from None
        self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard", run_name))

    def log(self, numbers: dict, step: int | None) -> None:
        for key, value in numbers.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()


class MLflowTracker:
    """Metrics and the spec's fields to an MLflow run (see the module docstring)."""

    name = "mlflow"

    def __init__(self, run_dir: str, project: str, run_name: str, config: dict):
        import mlflow

        self._mlflow = mlflow
        if not process.variable("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses its file store unless asked (it is in maintenance mode, a database
            # is what it recommends); a folder in the run needs no server and no database driver.
            process.set_default("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(run_dir, "mlruns")))
        mlflow.set_experiment(project)
        self._run = mlflow.start_run(run_name=run_name)
        params = _flatten(config)
        if params:
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log(self, numbers: dict, step: int | None) -> None:
        self._mlflow.log_metrics(numbers, step=step)

    def finish(self) -> None:
        self._mlflow.end_run()


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def open_trackers(trackers: Sequence[str], *, run_dir: str, project: str, run_name: str,
                  config: dict | None = None) -> list:
    """The tracker objects for ``trackers`` (names from ``TRACKERS``)."""
    opened = []
    for name in trackers:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; expected one of {sorted(TRACKERS)}")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(f"log.{name} = true needs the {module} package: pip install 'pgs[{extra}]'")
        if name == "tensorboard":
            opened.append(TensorBoardTracker(run_dir, run_name))
        elif name == "mlflow":
            opened.append(MLflowTracker(run_dir, project, run_name, config or {}))
        else:
            opened.append(_InitTracker(module, project, run_name, config or {}))
    return opened
