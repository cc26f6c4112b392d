"""``pgs supervise SPEC``: run ``pgs run`` and relaunch it with ``--resume auto`` after a crash,
only when a relaunch can help (docs/cli.md, docs/exit-codes.md "A supervisor's rule").

Each attempt is ``python -m pgs run SPEC ...`` in a process group of its own (a new session),
so that everything it started (torchrun and its workers, data workers, compile workers) can
be found and ended: when the attempt's first process has exited, the group is sent SIGKILL
and the supervisor waits until no live process of it is left; a group that does not empty
within ``Policy.reap_s`` is a verdict of its own (no relaunch: a survivor still holding the
GPU or the run folder would fight the new attempt).

After an attempt, :func:`decide` relaunches only when all of these hold:

- the exit code is not a verdict about the run or its input: not 0, 2, 80-84 (and not a
  stop the supervisor itself passed on);
- no ``HALT.json`` was written in the run folder during the attempt (launchers such as
  torchrun collapse every worker's code to 1; the marker keeps the verdict);
- the attempt made progress: the last step in ``metrics.jsonl`` advanced *and* the newest
  complete checkpoint moved to a later step (a crash before the first new checkpoint would
  only repeat itself);
- fewer than ``Policy.retries`` relaunches were made (``--retries``, default 2).

Relaunches wait ``backoff_s · 2^k`` seconds (k = relaunches so far, capped at
``backoff_max_s``).  Every decision is a line of ``<run dir>/supervise.jsonl`` (``event``:
``launch``, ``exit``, ``relaunch``, ``stop``) with the exit code, the steps and checkpoints
before and after, and the reason.  SIGTERM / SIGINT to the supervisor are passed on to the
attempt's group (the run checkpoints and stops at a step boundary) and end supervision.

Each attempt sees ``PGS_ATTEMPT`` (1, 2, ...) in its environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

import attrs

from pgs.errors import (EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_OK, EXIT_PREFLIGHT, EXIT_SKIP_CAP, EXIT_TRIPWIRE,
                        EXIT_WALL_BUDGET, SpecError)
from pgs.runtime import process
from pgs.runtime.dist.launch import halt_code
from pgs.runtime.store import checkpoint as ckpt
from pgs.runtime.store.lock import SUPERVISOR_LOCK_FILE, RunLock, refuse_if_held

LOG_FILE = "supervise.jsonl"
ATTEMPT_ENV = "PGS_ATTEMPT"

#: exit codes that are verdicts about the run or its input: relaunching would repeat them
FINAL = {
    EXIT_OK: "the run finished",
    EXIT_BAD_INPUT: "bad input (spec, data or command line)",
    EXIT_TRIPWIRE: "a health tripwire halted the run",
    EXIT_SKIP_CAP: "the skip cap halted the run",
    EXIT_WALL_BUDGET: "train.max_wall_seconds spent (the user's budget)",
    EXIT_PREFLIGHT: "preflight refused (fix the host or the spec)",
    EXIT_DISK_FULL: "the disk is full",
}


@attrs.frozen
class Policy:
    """``retries``: relaunches allowed; ``backoff_s`` · 2^k seconds before relaunch k + 1
    (at most ``backoff_max_s``); ``reap_s``: how long the attempt's group may take to empty."""

    retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    backoff_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    backoff_max_s: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))
    reap_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))

    def backoff(self, relaunches: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** relaunches)


@attrs.frozen
class Progress:
    """Where the run folder stands: the last logged training step and the newest complete
    checkpoint's step (None: none yet)."""

    step: int | None
    checkpoint_step: int | None
    checkpoint: str | None

    def as_dict(self) -> dict:
        return {"step": self.step, "checkpoint_step": self.checkpoint_step, "checkpoint": self.checkpoint}


def last_step(run_dir: str, tail_bytes: int = 1 << 16) -> int | None:
    """The step of the last training record of ``metrics.jsonl`` (read from its tail)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn first line of the tail, or a line being written
        if isinstance(record, dict) and "loss" in record and isinstance(record.get("step"), int):
            return record["step"]
    return None


def newest_checkpoint(run_dir: str) -> tuple[int | None, str | None]:
    """``(step, folder)`` of the newest complete checkpoint (manifest and sizes checked; the
    hashes are the resuming run's job), single-process or DCP."""
    from pgs.runtime.store import dcp

    for step, path in ckpt.step_folders(run_dir):
        why = dcp.problem(path, hashes=False) if dcp.is_dcp(path) else ckpt.problem(path, hashes=False)
        if why is None:
            return step, path
    return None, None


def progress(run_dir: str) -> Progress:
    step, folder = newest_checkpoint(run_dir)
    return Progress(last_step(run_dir), step, folder)


def _later(after: int | None, before: int | None) -> bool:
    return after is not None and (before is None or after > before)


def decide(code: int, *, halted: int | None, before: Progress, after: Progress, relaunches: int, policy: Policy,
           stopped: int = 0, reaped: bool = True) -> tuple[bool, str]:
    """Whether to relaunch after an attempt that exited ``code``, and why (see the module docstring)."""
    if stopped:
        return False, f"the supervisor received signal {stopped} and passed it on"
    if not reaped:
        return False, "the attempt's process group did not empty; a relaunch would run beside its survivors"
    if halted is not None:
        return False, f"HALT.json written during the attempt (exit code {halted})"
    if code in FINAL:
        return False, f"exit {code}: {FINAL[code]}"
    if not _later(after.step, before.step):
        return False, f"no progress: the last logged step stayed {before.step}"
    if not _later(after.checkpoint_step, before.checkpoint_step):
        return False, f"no progress: the newest complete checkpoint stayed at step {before.checkpoint_step}"
    if relaunches >= policy.retries:
        return False, f"retries spent ({relaunches} of {policy.retries})"
    return True, (f"exit {code} after progress (step {before.step} -> {after.step}, checkpoint "
                  f"{before.checkpoint_step} -> {after.checkpoint_step})")


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    if os.path.isdir("/proc"):
        alive = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as handle:
                    stat = handle.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive.append(int(name))
        return alive
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    return [pgid]


def reap_group(pgid: int, timeout_s: float) -> bool:
    """SIGKILL every process left in group ``pgid`` and wait until none is alive; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = group_alive(pgid)
        if not alive:
            return True
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class Log:
    """``<run dir>/supervise.jsonl``: one JSON line per decision, flushed and fsynced; each
    also said on stderr in one line."""

    def __init__(self, run_dir: str, echo: Callable[[str], None] | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LOG_FILE)
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))

    def write(self, event: str, say: str | None = None, **fields) -> None:
        record = {"time": round(time.time(), 3), "event": event, **fields}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if say:
            self.echo(f"pgs supervise: {say}")


def run_command(spec_path: str, overrides: Sequence[str], *, resume: str | None, nproc: int,
                python: str | None = None) -> list[str]:
    """``python -m pgs run SPEC`` with the supervisor's ``--set``, ``--resume`` and ``--nproc``."""
    cmd = [python or sys.executable, "-m", "pgs", "run", spec_path]
    for item in overrides:
        cmd += ["--set", item]
    if resume is not None:
        cmd += ["--resume", resume]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    return cmd


def supervise(spec, spec_path: str, *, overrides: Sequence[str] = (), resume: str | None = None,
              overwrite: bool = False, nproc: int = 1, policy: Policy = Policy(),
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Run the spec until it finishes or a relaunch cannot help; returns the last attempt's
    verdict (the ``HALT.json`` code when one was written, else its exit code).  ``resume``
    applies to the first attempt; ``overwrite`` moves an existing run folder aside before it."""
    if overwrite and resume is not None:
        raise SpecError("--overwrite starts over, --resume continues: give one of them")
    run_dir = spec.checkpoint.dir
    supervisor = RunLock(run_dir, SUPERVISOR_LOCK_FILE).acquire()  # one supervisor per run folder
    try:
        refuse_if_held(run_dir)  # a live run in the folder: nothing of this supervisor is written there
        if overwrite:  # here, not in the first attempt: the supervisor's own log lives in the run folder
            aside = ckpt.move_aside(run_dir)
            if aside is not None:
                supervisor.relock()  # the new folder at the old path, locked before the old one is let go
                print(f"pgs supervise: --overwrite: moved the previous run to {aside}", file=sys.stderr, flush=True)
        return _supervise(run_dir, spec_path, overrides, resume, nproc, policy, sleep)
    finally:
        supervisor.release()


def _supervise(run_dir: str, spec_path: str, overrides: Sequence[str], resume: str | None, nproc: int,
               policy: Policy, sleep: Callable[[float], None]) -> int:
    """The supervisor's loop, in the run folder it holds (see :func:`supervise`)."""
    log = Log(run_dir)
    log.write("start", spec=os.path.abspath(spec_path), overrides=list(overrides), retries=policy.retries,
              backoff_s=policy.backoff_s, nproc=nproc)
    state = {"stopped": 0, "pgid": None}

    def forward(signum, frame):
        if not state["stopped"]:
            state["stopped"] = int(signum)
        if state["pgid"] is not None:
            try:
                os.killpg(state["pgid"], signum)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    relaunches, attempt = 0, 0
    try:
        while True:
            attempt += 1
            before = progress(run_dir)
            cmd = run_command(spec_path, overrides, resume=resume, nproc=nproc)
            started = time.time()
            env = {**process.environment(), ATTEMPT_ENV: str(attempt)}
            child = subprocess.Popen(cmd, env=env, start_new_session=True)
            state["pgid"] = child.pid  # a new session: the group's id is the child's pid
            log.write("launch", f"attempt {attempt}: {' '.join(cmd[2:])}", attempt=attempt, command=cmd,
                      pid=child.pid, before=before.as_dict())
            code = child.wait()
            if code < 0:  # killed by a signal: the shell's convention, as the exit-code table has it
                code = 128 - code
            reaped = reap_group(child.pid, policy.reap_s)
            state["pgid"] = None
            halted = halt_code(run_dir, started)
            after = progress(run_dir)
            again, why = decide(code, halted=halted, before=before, after=after, relaunches=relaunches,
                                policy=policy, stopped=state["stopped"], reaped=reaped)
            verdict = halted if halted is not None else code
            log.write("exit", f"attempt {attempt} exited {code}: {why}", attempt=attempt, exit_code=code,
                      halt_exit_code=halted, group_emptied=reaped, before=before.as_dict(), after=after.as_dict(),
                      relaunch=again, reason=why)
            if not again:
                log.write("stop", None, attempt=attempt, exit_code=verdict, reason=why)
                return verdict
            wait = policy.backoff(relaunches)
            log.write("relaunch", f"relaunching with --resume auto in {wait:g} s", attempt=attempt + 1,
                      backoff_s=wait, relaunches=relaunches + 1)
            sleep(wait)
            if state["stopped"]:
                why = f"the supervisor received signal {state['stopped']} while waiting to relaunch"
                log.write("stop", why, attempt=attempt, exit_code=128 + state["stopped"], reason=why)
                return 128 + state["stopped"]
            relaunches += 1
            resume = "auto"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
