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
``exit_code`` of a ``HALT.json`` written in ``run_dir`` during this launch (81, 80, ...); the
code its own workers exited with (each records it in a folder the launcher names,
``$PGS_EXIT_DIR``: on several hosts, a host whose launcher got no signal still returns the 143
its workers stopped with when another host was signalled); 128+signum when it passed a signal
on; torchrun's own code otherwise.  torchrun's stderr is relayed line by line, without the
``SignalException`` traceback its agent prints after a signal that this launcher passed on
(:func:`relay_stderr`).

Several hosts: ``pgs run --nproc N --nnodes M --node-rank R --rdzv-endpoint HOST:PORT ...``
runs one launcher per host; the rendezvous options (:class:`Rendezvous`) are handed to torchrun
unchanged and replace ``--standalone`` (docs/distributed.md has a SLURM ``srun`` example).

Evidence of a hang: the launcher turns on NCCL's flight recorder for its workers
(``pgs.runtime.dist.fsdp.flight_recorder_env``): a ring buffer of the last collectives per rank, dumped on a
process-group timeout into ``<run dir>/nccl_trace/rank_<r>`` (``torch.distributed``'s
``fr_trace`` tool reads those files).  Values the user set in the environment win.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

import attrs

from pgs.errors import InvalidArgument, SpecError
from pgs.runtime import process
from pgs.runtime.dist.fsdp import flight_recorder_env
from pgs.runtime.spec.load import check_world_size
from pgs.runtime.spec.preflight import preflight_spec
from pgs.runtime.store import checkpoint, lock as run_lock

GRACE_ENV = "PGS_SHUTDOWN_GRACE_S"
EXIT_DIR_ENV = "PGS_EXIT_DIR"
DEFAULT_GRACE_S = 900
HALT_FILE = "HALT.json"


def _nodes(value) -> str:
    text = str(value)
    if not re.fullmatch(r"\d+(:\d+)?", text) or any(int(part) < 1 for part in text.split(":")):
        raise InvalidArgument(f"--nnodes: expected N or MIN:MAX (integers >= 1), got {text!r}")
    return text


def _port(value):
    if value is None:
        return None
    if not (isinstance(value, int) and 0 < value < 65536):
        raise InvalidArgument(f"--master-port: expected a port number in [1, 65535], got {value!r}")
    return value


def _node_rank(value):
    if value is not None and not (isinstance(value, int) and value >= 0):
        raise InvalidArgument(f"--node-rank: expected an integer >= 0, got {value!r}")
    return value


@attrs.frozen
class Rendezvous:
    """torchrun's options for a run over several hosts, handed through unchanged (each is
    torchrun's flag of the same name).  ``nnodes``: ``"M"`` or elastic ``"MIN:MAX"``.  The
    default (one node, nothing else set) is ``--standalone``: a private rendezvous on this host."""

    nnodes: str = attrs.field(default="1", converter=_nodes)
    node_rank: int | None = attrs.field(default=None, validator=lambda i, a, v: _node_rank(v))
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = attrs.field(default=None, validator=lambda i, a, v: _port(v))

    @property
    def standalone(self) -> bool:
        return self == Rendezvous()

    @property
    def fixed_nodes(self) -> int | None:
        """The number of hosts when it is fixed (``"M"``), None for an elastic range."""
        return None if ":" in self.nnodes else int(self.nnodes)

    def flags(self) -> list[str]:
        """torchrun's flags: ``--standalone``, or the rendezvous options that were given."""
        if self.standalone:
            return ["--standalone"]
        named = (("nnodes", self.nnodes), ("node-rank", self.node_rank), ("rdzv-endpoint", self.rdzv_endpoint),
                 ("rdzv-id", self.rdzv_id), ("rdzv-backend", self.rdzv_backend),
                 ("master-addr", self.master_addr), ("master-port", self.master_port))
        return [f"--{name}={value}" for name, value in named if value is not None]


def under_launcher() -> bool:
    """True inside a torchrun worker (do not relaunch)."""
    return process.variable("LOCAL_RANK") is not None and process.variable("WORLD_SIZE") is not None


def torchrun_command(nproc: int, args: Sequence[str], *, grace_s: int | None = None,
                     python: str | None = None, rendezvous: Rendezvous | None = None,
                     log_dir: str | None = None) -> list[str]:
    """The command that runs ``pgs <args>`` as ``nproc`` workers on this machine (one of
    several hosts when ``rendezvous`` says so).  ``log_dir``: torchrun's own folder for its
    workers' logs (it makes a ``torchelastic_*`` folder in the temp folder and leaves it there
    when none is given)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    grace = int(grace_s if grace_s is not None else process.variable(GRACE_ENV, DEFAULT_GRACE_S))
    logs = [f"--log-dir={log_dir}"] if log_dir else []
    return [python or sys.executable, "-m", "torch.distributed.run", *(rendezvous or Rendezvous()).flags(),
            f"--nproc-per-node={nproc}", f"--shutdown-timeout={grace}", *logs, "-m", "pgs", *args]


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


def record_exit(code: int) -> None:
    """In a worker started by :func:`relaunch`: write this process's exit code where the launcher
    reads it (``$PGS_EXIT_DIR/<LOCAL_RANK>``); nothing outside such a launch."""
    folder, local_rank = process.variable(EXIT_DIR_ENV), process.variable("LOCAL_RANK", "")
    if not folder or not local_rank.isdigit() or not os.path.isdir(folder):
        return
    path = os.path.join(folder, str(int(local_rank)))
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(str(int(code)))
        os.replace(path + ".tmp", path)
    except (OSError, ValueError, TypeError):
        pass  # the launcher falls back to torchrun's code


def workers_code(folder: str) -> int | None:
    """The code this host's workers exited with, from :func:`record_exit`'s files: the first
    (by local rank) that is neither 0 nor 1 (a stop, a halt, a refusal: what the run decided),
    else 1 if one exited 1, else 0 if all that wrote exited 0; None if none wrote."""
    codes = []
    try:
        names = sorted((n for n in os.listdir(folder) if n.isdigit()), key=int)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                codes.append(int(handle.read().strip()))
        except (OSError, ValueError):
            continue
    if not codes:
        return None
    decided = [c for c in codes if c not in (0, 1)]
    return decided[0] if decided else max(codes)


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


def relaunch(nproc: int, args: Sequence[str], *, run_dir: str | None = None, grace_s: int | None = None,
             rendezvous: Rendezvous | None = None) -> int:
    """Run ``pgs <args>`` under torchrun with ``nproc`` workers; return the run's verdict.

    ``args``: the command line without ``--nproc`` (e.g. ``["run", "spec.toml", "--resume",
    "auto"]``).  ``run_dir``: where the run writes ``HALT.json`` (the spec's checkpoint dir) and
    where the workers' flight-recorder dumps go (:func:`flight_recorder_env`).
    """
    started = time.time()
    exits = tempfile.mkdtemp(prefix="pgs-exit-")
    env = {**process.environment(), **flight_recorder_env(run_dir, create=True), EXIT_DIR_ENV: exits}
    try:
        # torchrun's log folder inside the one removed below: nothing left in the temp folder
        child = subprocess.Popen(torchrun_command(nproc, args, grace_s=grace_s, rendezvous=rendezvous,
                                                  log_dir=os.path.join(exits, "torchrun")),
                                 stderr=subprocess.PIPE, env=env)
    except BaseException:
        shutil.rmtree(exits, ignore_errors=True)
        raise
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
        workers = workers_code(exits)
        shutil.rmtree(exits, ignore_errors=True)
    halted = halt_code(run_dir, started)
    if halted is not None:
        return halted
    if code != 0 and workers not in (None, 0, 1):
        return workers
    if forwarded and code != 0:
        return 128 + forwarded[0]
    return code


def launch_run(spec, spec_path: str, *, nproc: int, overrides: Sequence[str] = (), resume: str | None = None,
               overwrite: bool = False, profile: str | None = None, rendezvous: Rendezvous | None = None) -> int:
    """``pgs run --nproc N``: relaunch the same run under torchrun; return the run's verdict.

    The checks every worker would make run once here first (a worker's refusal would read as
    exit 1), the world size is checked and the run folder refused or moved aside before N
    processes start.  ``relaunch``: signals to this process are passed on to the workers (which
    checkpoint and stop together); torchrun collapses every worker's exit code to 1, so a
    ``HALT.json`` written during this launch decides the code, else 128+signum after a
    forwarded signal, else torchrun's.

    ``rendezvous``: torchrun's options for several hosts (one launcher per host).  The world
    size checked is ``nproc`` times a fixed ``nnodes``; only the first host (``node_rank`` 0 or
    unset) refuses or moves aside an existing run folder, so that a shared folder that host 0
    already started in is not refused by the others.
    """

    rendezvous = rendezvous or Rendezvous()
    preflight_spec(spec, processes=nproc * (rendezvous.fixed_nodes or 1))
    check_world_size(spec.train, nproc * (rendezvous.fixed_nodes or 1), spec.parallel.context)
    if nproc * (rendezvous.fixed_nodes or 1) > 1:  # before any process starts, not after each built the model
        from pgs.runtime.optim.memory import single_process_refusal

        why = single_process_refusal(spec.memory)
        if why:
            raise SpecError(why)
    # a folder a live run holds is refused here, before any worker starts (the worker of rank 0
    # then locks it for the run); a host that may not hold rank 0 does not probe
    probe = run_lock.RunLock(spec.checkpoint.dir)
    if rendezvous.standalone or rendezvous.node_rank == 0:
        probe.acquire()
    try:
        if resume is None and not rendezvous.node_rank:
            if overwrite:
                aside = checkpoint.move_aside(spec.checkpoint.dir)
                if aside is not None:
                    print(f"pgs: --overwrite: moved the previous run to {aside}", file=sys.stderr, flush=True)
            else:
                checkpoint.refuse_existing_run(spec.checkpoint.dir)
    finally:
        probe.release()
    forwarded = ["run", os.path.abspath(spec_path)]
    for assignment in overrides:
        forwarded += ["--set", assignment]
    if resume:
        forwarded += ["--resume", resume]
    if profile:
        forwarded += ["--profile", profile]
    return relaunch(nproc, forwarded, run_dir=spec.run_dir, rendezvous=rendezvous)
