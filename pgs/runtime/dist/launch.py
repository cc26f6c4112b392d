"""``pgs run --nproc N``: re-run the same command under ``torch.distributed.run`` (torchrun).

The launcher process starts ``python -m torch.distributed.run --standalone
--nproc-per-node N -m pgs <same arguments>`` and waits.  Each worker finds torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) and runs the distributed path
(``pgs.runtime.dist.fsdp.init``); it does not relaunch because ``LOCAL_RANK`` is set.

Signals: SIGTERM / SIGINT sent to the launcher are passed on to torchrun, which passes them
to every worker; the workers stop together at the next step boundary, checkpoint and exit
128+signum (the control plane).  torchrun waits ``--shutdown-timeout`` seconds for them
before SIGKILL (its default, 30 s, is shorter than a large checkpoint): this launcher asks
for ``grace_s`` (default 900 s, ``$PGS_SHUTDOWN_GRACE_S``).

Exit code: torchrun reports 1 for any failed worker.  The launcher returns, in order: the
``exit_code`` of a ``HALT.json`` written in ``run_dir`` during this launch (81, 80, ...);
128+signum when it passed a signal on; torchrun's own code otherwise.  torchrun's stderr is
relayed line by line, without the ``SignalException`` traceback its agent prints after a
signal that this launcher passed on (:func:`relay_stderr`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

from pgs.runtime.spec.load import check_world_size
from pgs.runtime.spec.preflight import preflight_spec
from pgs.runtime.store import checkpoint

GRACE_ENV = "PGS_SHUTDOWN_GRACE_S"
DEFAULT_GRACE_S = 900
HALT_FILE = "HALT.json"


def under_launcher() -> bool:
    """True inside a torchrun worker (do not relaunch)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, args: Sequence[str], *, grace_s: int | None = None,
                     python: str | None = None) -> list[str]:
    """The command that runs ``pgs <args>`` as ``nproc`` workers on this machine."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    grace = int(grace_s if grace_s is not None else os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--shutdown-timeout={grace}", "-m", "pgs", *args]


def halt_code(run_dir: str | None, since: float) -> int | None:
    """The exit code named by a ``HALT.json`` in ``run_dir`` written at or after ``since``."""
    if not run_dir:
        return None
    marker = os.path.join(run_dir, HALT_FILE)
    try:
        if os.path.getmtime(marker) < since:
            return None
        with open(marker, encoding="utf-8") as handle:
            code = json.load(handle).get("exit_code")
    except (OSError, ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def relay_stderr(source, sink, signalled) -> None:
    """Copy torchrun's stderr (its own and its workers') line by line to ``sink``, except the
    traceback torchrun's agent prints when it is stopped by a signal this launcher passed on
    (``SignalException``): the workers checkpoint and stop by themselves, and ``pgs run`` reports
    the stop in one line, so that traceback says nothing but alarm.  Any other traceback, and
    every line when no signal was passed on (``signalled()`` false), goes through unchanged."""
    held: list[str] = []
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", "replace")
        if held or line.startswith("Traceback (most recent call last):"):
            held.append(line)
            if line.startswith((" ", "\t", "Traceback", "During handling of", "The above exception")) or not line.strip():
                continue  # still inside the traceback: its frames, or the links of a chained one
            if not (signalled() and "SignalException" in line):
                sink.writelines(held)
                sink.flush()
            held = []
            continue
        sink.write(line)
        sink.flush()
    if held:
        sink.writelines(held)
        sink.flush()


def relaunch(nproc: int, args: Sequence[str], *, run_dir: str | None = None, grace_s: int | None = None) -> int:
    """Run ``pgs <args>`` under torchrun with ``nproc`` workers; return the run's verdict.

    ``args``: the command line without ``--nproc`` (e.g. ``["run", "spec.toml", "--resume",
    "auto"]``).  ``run_dir``: where the run writes ``HALT.json`` (the spec's checkpoint dir).
    """
    started = time.time()
    child = subprocess.Popen(torchrun_command(nproc, args, grace_s=grace_s), stderr=subprocess.PIPE)
    forwarded: list[int] = []
    relay = threading.Thread(target=relay_stderr, args=(child.stderr, sys.stderr, lambda: bool(forwarded)),
                             daemon=True)
    relay.start()

    def forward(signum, frame):
        if not forwarded:
            forwarded.append(int(signum))
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.join(timeout=5)
    halted = halt_code(run_dir, started)
    if halted is not None:
        return halted
    if forwarded and code != 0:
        return 128 + forwarded[0]
    return code


def launch_run(spec, spec_path: str, *, nproc: int, overrides: Sequence[str] = (), resume: str | None = None,
               overwrite: bool = False, profile: str | None = None) -> int:
    """``pgs run --nproc N``: relaunch the same run under torchrun; return the run's verdict.

    The checks every worker would make run once here first (a worker's refusal would read as
    exit 1), the world size is checked and the run folder refused or moved aside before N
    processes start.  ``relaunch``: signals to this process are passed on to the workers (which
    checkpoint and stop together); torchrun collapses every worker's exit code to 1, so a
    ``HALT.json`` written during this launch decides the code, else 128+signum after a
    forwarded signal, else torchrun's.
    """

    preflight_spec(spec, processes=nproc)
    check_world_size(spec.train, nproc)
    if resume is None:
        if overwrite:
            aside = checkpoint.move_aside(spec.checkpoint.dir)
            if aside is not None:
                print(f"pgs: --overwrite: moved the previous run to {aside}", file=sys.stderr, flush=True)
        else:
            checkpoint.refuse_existing_run(spec.checkpoint.dir)
    forwarded = ["run", os.path.abspath(spec_path)]
    for assignment in overrides:
        forwarded += ["--set", assignment]
    if resume:
        forwarded += ["--resume", resume]
    if profile:
        forwarded += ["--profile", profile]
    return relaunch(nproc, forwarded, run_dir=spec.run_dir)
