"""The control plane: every stop, skip and halt is decided at an optimizer-step boundary.

A process-local fact (a signal arrived, the wall budget is spent, the loss is not finite,
the optimizer saw a spike) becomes an action only after :func:`agree`, which every process
calls at the same point of every step.  On one process it is the identity; under
``torch.distributed`` it is a MAX all-reduce, so that either all ranks act or none does
(one rank checkpointing alone while its peers sit in a collective is a hang, not a crash).

Verdicts and their exit codes (``pgs.errors``): a signal -> checkpoint, exit 128+signum;
wall budget -> checkpoint, exit 82; too many skipped steps -> ``HALT.json``, exit 81; a
refused preflight -> exit 83.  HALT verdicts are about the run, not the host: a supervisor
must not relaunch them, which is why the marker file exists (launchers collapse exit codes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import attrs
import torch

from pgs.errors import EXIT_SKIP_CAP, HaltError, PreflightRefused
from pgs.runtime.common import fsync_dir
from pgs.runtime.process import collective_device

#: Slots of the flag vector that :func:`agree` reduces.  Each is an int >= 0; MAX is the rule.
#: ``SAVE_RUNNING``/``SAVE_FAILED``: a background checkpoint still being written on some process,
#: and how one that ended failed (``pgs.runtime.store.background.BackgroundSaver.flags``).
SIGNAL, WALL, NONFINITE, SPIKE, SAVE_RUNNING, SAVE_FAILED = range(6)
NUM_FLAGS = 6

HALT_FILE = "HALT.json"


def agree(flags: list[int]) -> list[int]:
    """The flags every process acts on: the element-wise MAX over processes.

    Identity on one process.  Under an initialized ``torch.distributed`` group, one
    all-reduce (MAX) of an int64 tensor; every rank must call it at the same program point.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=collective_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [int(x) for x in t.tolist()]
    return [int(f) for f in flags]


class StopSignals:
    """Catch SIGTERM/SIGINT and remember the first one, so the loop can stop at a boundary.

    Use as a context manager; the previous handlers come back on exit.  Further SIGTERMs
    are ignored (the checkpoint is on its way); a second SIGINT (Ctrl-C pressed twice) raises
    ``KeyboardInterrupt`` at once, leaving the last complete checkpoint as it is.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if not self.received:
            self.received = int(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with their owner
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class WallClock:
    """``max_wall_seconds`` of this process's life (None: no budget), measured from start."""

    def __init__(self, max_seconds: float | None, start: float | None = None):
        self.max_seconds = max_seconds
        self.start = time.monotonic() if start is None else start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def spent(self) -> bool:
        return self.max_seconds is not None and self.elapsed() >= self.max_seconds


@attrs.define
class SkipCounter:
    """Skipped optimizer steps and the cap that turns them into a HALT.

    A step is skipped when its loss is not finite or the optimizer flagged a spike: nothing
    is applied and the gradients are dropped.  The run halts when more than
    ``max_consecutive`` steps in a row are skipped, or (once ``min_steps`` steps were seen)
    more than ``max_fraction`` of all steps were.
    """

    max_consecutive: int = 3
    max_fraction: float = 0.05
    min_steps: int = 100
    steps: int = 0
    skipped: int = 0
    consecutive: int = 0

    def record(self, skipped: bool) -> None:
        self.steps += 1
        if skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0

    def verdict(self) -> str | None:
        """Why the run must halt, or None."""
        if self.consecutive > self.max_consecutive:
            return (
                f"{self.consecutive} consecutive optimizer steps skipped (non-finite loss or spike); "
                f"train.max_consecutive_skips = {self.max_consecutive}"
            )
        if self.steps >= self.min_steps and self.skipped > self.max_fraction * self.steps:
            return (
                f"{self.skipped} of {self.steps} optimizer steps skipped "
                f"({self.skipped / self.steps:.1%}); train.max_skip_fraction = {self.max_fraction}"
            )
        return None

    def state_dict(self) -> dict:
        return {"steps": self.steps, "skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped = int(state["skipped"])
        self.consecutive = int(state["consecutive"])


def write_json_atomic(path: str, payload: dict) -> None:
    """Write JSON through a temporary file: data fsynced, renamed, the folder fsynced."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def halt(run_dir: str, reason: str, *, step: int, exit_code: int = EXIT_SKIP_CAP,
         details: dict | None = None) -> HaltError:
    """Write ``<run_dir>/HALT.json`` (atomically) and return the ``HaltError`` to raise."""
    payload = {
        "reason": reason,
        "exit_code": exit_code,
        "step": step,
        "time": time.time(),
        "pid": os.getpid(),
        **(details or {}),
    }
    if _is_rank0():
        write_json_atomic(os.path.join(run_dir, HALT_FILE), payload)
    return HaltError(f"halted at step {step}: {reason} (see {os.path.join(run_dir, HALT_FILE)})", exit_code)


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def preflight(run_dir: str, checkpoint_bytes: int, *, factor: float = 3.0) -> None:
    """Refuse (exit 83) when ``run_dir`` is not writable or has too little free disk.

    ``checkpoint_bytes``: model + optimizer state bytes of one checkpoint; ``factor`` copies
    must fit (``pgs.runtime.tools.resources.disk_copies`` of the run's ``[checkpoint]``: the
    kept ones, the one being written, the best one, the export).
    """
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".pgs-write-probe-{os.getpid()}")
        with open(probe, "w") as handle:
            handle.write("ok")
        os.remove(probe)
    except OSError as err:
        raise PreflightRefused(f"checkpoint.dir: {run_dir!r} is not writable ({err.strerror or err})") from None
    free = shutil.disk_usage(run_dir).free
    need = int(factor * checkpoint_bytes)
    if free < need:
        raise PreflightRefused(
            f"checkpoint.dir: {run_dir!r} has {free / 2**30:.2f} GiB free; a checkpoint needs about "
            f"{need / 2**30:.2f} GiB ({factor:g} x {checkpoint_bytes / 2**30:.2f} GiB of weights + optimizer state)"
        )


def exit_code_for_signal(signum: int) -> int:
    return 128 + int(signum)
