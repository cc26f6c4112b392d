"""Faults a test injects into a run: NaN losses at chosen steps, a SIGKILL at a chosen point,
a pause at a chosen step until the test lets the run go on, slow steps.  The loop asks its
``Run.faults``; production runs carry ``NO_FAULTS``.

In-process tests pass a ``Faults`` to ``setup`` / ``run``.  Tests that start ``pgs run`` as a
child process hand one over in a single environment variable (``Faults(...).env()`` gives
``{"PGS_FAULTS": <json>}``), which the CLI reads once at start (``Faults.from_env``); nothing in
the loop reads the environment.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Mapping

import attrs

from pgs.errors import InvalidArgument
from pgs.runtime import process

ENV = "PGS_FAULTS"
#: where ``crash_at`` can strike: halfway through writing a checkpoint (weights written, the
#: rest not), or right after a step's update
CRASH_POINTS = ("checkpoint_write", "step")


def _crash_at(value):
    if value is None:
        return None
    where, step = value
    if where not in CRASH_POINTS:
        raise InvalidArgument(f"Faults.crash_at: {where!r} is not one of {CRASH_POINTS}")
    return str(where), int(step)


@attrs.frozen
class Faults:
    """``nan_steps``: those steps' losses (1-based) become NaN, on every process or only on
    process ``nan_rank``.  ``crash_at``: ``(where, step)``, SIGKILL at that point
    (``CRASH_POINTS``).  ``pause_at``: ``(step, folder)``, after that step's update the process
    writes ``folder/paused`` (its pid) and waits until ``folder/go`` exists, or until it has
    received a stop signal (then it writes ``folder/signalled``): a test holds a live run at a
    known point (an event, not a duration) while it does something beside it.
    ``slow_step_s``: sleep that long after each step.  ``on_attempt``: the
    faults strike only in that attempt of ``pgs supervise`` (``attempt``, which ``from_env``
    reads from ``PGS_ATTEMPT``; 1 outside a supervisor); None: always."""

    nan_steps: frozenset = attrs.field(default=frozenset(), converter=lambda s: frozenset(int(x) for x in s))
    crash_at: tuple | None = attrs.field(default=None, converter=_crash_at)
    slow_step_s: float = attrs.field(default=0.0, converter=float)
    on_attempt: int | None = None
    attempt: int = 1
    nan_rank: int | None = None
    pause_at: tuple | None = attrs.field(default=None,
                                         converter=lambda v: None if v is None else (int(v[0]), str(v[1])))

    def _active(self) -> bool:
        return self.on_attempt is None or self.on_attempt == self.attempt

    def poisons(self, step: int, rank: int = 0) -> bool:
        """Whether step ``step``'s loss is made NaN on process ``rank``."""
        return step in self.nan_steps and self._active() and (self.nan_rank is None or rank == self.nan_rank)

    def crash(self, where: str, step: int) -> None:
        """The loop's fault point ``where`` after step ``step``: SIGKILL this process on the spot
        if ``crash_at`` is ``(where, step)``; at ``"step"``, the pause of ``pause_at``."""
        if self.crash_at == (where, step) and self._active():
            os.kill(os.getpid(), signal.SIGKILL)
            os._exit(137)  # not reached where SIGKILL exists
        if where == "step" and self.pause_at is not None and self.pause_at[0] == step and self._active():
            folder = self.pause_at[1]
            temporary = os.path.join(folder, f"paused.tmp-{os.getpid()}")  # one per process: ranks pause together
            with open(temporary, "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(temporary, os.path.join(folder, "paused"))
            while not os.path.exists(os.path.join(folder, "go")):
                if _stop_received():  # a stop signal ends the pause too, and says so
                    with open(os.path.join(folder, "signalled"), "w") as handle:
                        handle.write(str(os.getpid()))
                    break
                time.sleep(0.01)

    def env(self) -> dict[str, str]:
        """The environment entry that hands these faults to a child ``pgs run``."""
        return {ENV: json.dumps({"nan_steps": sorted(self.nan_steps), "crash_at": self.crash_at,
                                 "slow_step_s": self.slow_step_s, "on_attempt": self.on_attempt,
                                 "nan_rank": self.nan_rank, "pause_at": self.pause_at})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Faults":
        """What ``env()`` handed over (in ``environ``, by default this process's), or ``NO_FAULTS``."""
        environ = process.environment() if environ is None else environ
        raw = environ.get(ENV)
        if not raw:
            return NO_FAULTS
        try:
            fields = json.loads(raw)
            return cls(**fields, attempt=int(environ.get("PGS_ATTEMPT", "1") or 1))
        except (ValueError, TypeError) as err:
            raise InvalidArgument(f"${ENV}: not a fault description written by Faults.env(): {err}") from None


def _stop_received() -> bool:
    """Whether the loop's stop handler (``control.StopSignals``, installed for SIGTERM and SIGINT)
    has recorded a signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        owner = getattr(signal.getsignal(sig), "__self__", None)
        if getattr(owner, "received", 0):
            return True
    return False


NO_FAULTS = Faults()
