"""Per-step metrics: ``metrics.jsonl`` always, a console view, trackers when asked.

Every record is one JSON object on one line of ``<run_dir>/metrics.jsonl``: training steps
(``{"step": 12, "loss": ..., "lr": ...}``), evals (``{"step": 20, "eval_loss": ...}``) and
events (``{"step": 7, "event": "skip", ...}``).  When both stdout and the console stream are
terminals (and ``TERM`` is not ``dumb``) the console shows a rich progress bar; otherwise (a
batch job's log, CI, a pipe) one plain line every ``print_every`` steps and no live display.
Trackers (wandb, trackio, TensorBoard, MLflow) get every record's numbers
(``pgs.runtime.loop.trackers``).  A resumed run first drops the records of steps after its
checkpoint, so that the file reads as one run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Sequence

from pgs.errors import DiskFull
from pgs.runtime import process
from pgs.runtime.store.checkpoint import write_failure

METRICS_FILE = "metrics.jsonl"

#: Keys of every step record shown on the console, before and after the objective's own.
LEADING_KEYS = ("loss", "lr", "grad_norm")
TRAILING_KEYS = ("tokens_per_s", "mem_gib", "reserved_gib")


def console_keys(objective_keys: Sequence[str] = ()) -> tuple[str, ...]:
    """The progress line's keys, in order: loss, lr, ‖g‖, the objective's
    (``Objective.console_keys``), throughput and memory."""
    return LEADING_KEYS + tuple(objective_keys) + TRAILING_KEYS


#: The SFT objective's progress line (a log made without naming an objective's keys).
CONSOLE_KEYS = console_keys(("entropy",))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


class MetricsLog:
    """Append-only metrics of one run; see the module docstring."""

    def __init__(
        self,
        run_dir: str,
        *,
        total_steps: int,
        print_every: int = 10,
        trackers: Sequence[str] = (),
        project: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        stream=None,
        console: Sequence[str] = CONSOLE_KEYS,
    ):
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.total_steps = total_steps
        self.print_every = max(1, int(print_every))
        self.stream = stream or sys.stderr
        self.console = tuple(console)
        self._file = open(self.path, "a", encoding="utf-8")
        self._full = False  # a write found the disk full (DiskFull raised once)
        self._progress = None
        self._task = None
        self._trackers = self._open_trackers(trackers, project, run_name, config)

    # -- files --------------------------------------------------------------------------
    @staticmethod
    def truncate_after(run_dir: str, step: int) -> None:
        """Drop records of steps > ``step`` (a resumed run redoes them)."""
        path = os.path.join(run_dir, METRICS_FILE)
        if not os.path.exists(path):
            return
        kept = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if int(record.get("step", 0)) <= step:
                    kept.append(json.dumps(record, separators=(",", ":")) + "\n")
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.writelines(kept)
        os.replace(tmp, path)

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl (and the trackers), flushed."""
        record = {"time": round(time.time(), 3), **{k: _clean(v) for k, v in record.items()}}
        if self._full:
            return  # the disk filled: the run is ending with DiskFull, what comes after is dropped
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as err:
            failure = write_failure(err)
            if failure is None:
                raise
            self._full = True
            what = ("disk full" if failure == "full"
                    else "the run folder can no longer be written (read-only or permission denied)")
            cure = "free space" if failure == "full" else "make the folder writable"
            raise DiskFull(f"{what} while writing the metrics {self.path}: the records from step "
                           f"{record.get('step')} on are lost; checkpoints written before are intact; {cure}, "
                           "then continue with pgs run SPEC --resume auto") from None
        for tracker in self._trackers:
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
            try:
                # on the trackers' axis a record goes where it was logged (a background checkpoint's
                # event names the earlier step it saved; wandb drops a step lower than the last)
                tracker.log(numbers, step=record.get("logged_at_step", record.get("step")))
            except Exception as err:  # a tracker must never stop training
                self.say(f"pgs: {type(tracker).__name__} logging failed: {err}")

    # -- console ------------------------------------------------------------------------
    def say(self, line: str) -> None:
        """A message for the person watching (above the progress bar on a terminal)."""
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def interactive(self) -> bool:
        """Whether a person watches a terminal: stdout and the console stream are both ttys."""
        return (_isatty(self.stream) and _isatty(sys.stdout)) and process.variable("TERM") != "dumb"

    def start(self, step: int) -> None:
        if not self.interactive():
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), transient=False, console=Console(file=self.stream),
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total_steps, completed=step, info="")

    def step(self, record: dict) -> None:
        """Log a training step: the file always, the console as its mode says."""
        self.write(record)
        info = "  ".join(_fmt(k, record[k]) for k in self.console if k in record)
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], info=info)
        elif record["step"] % self.print_every == 0 or record["step"] == self.total_steps:
            print(f"step {record['step']}/{self.total_steps}  {info}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for tracker in self._trackers:
            try:
                tracker.finish()
            except Exception:
                pass
        self._trackers = []
        try:
            self._file.close()
        except OSError:
            if not self._full:  # the buffered tail of a full disk is already reported
                raise

    # -- optional trackers ---------------------------------------------------------------
    def _open_trackers(self, names, project, run_name, config) -> list:
        if not names:
            return []
        from pgs.runtime.loop.trackers import open_trackers

        run_dir = os.path.dirname(self.path)
        return open_trackers(names, run_dir=run_dir, project=project or "pgs",
                             run_name=run_name or os.path.basename(os.path.abspath(run_dir)), config=config)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.2e}"
        if key == "tokens_per_s":
            return f"tok/s {value:,.0f}"
        if key == "mem_gib":
            return f"peak {value:.2f} GiB"
        if key == "reserved_gib":
            return f"reserved {value:.2f} GiB"
        return f"{key} {value:.4g}"
    return f"{key} {value}"
