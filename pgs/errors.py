"""Errors that speak to the user, and the exit codes the CLI maps them to.

Every error a user can cause carries one clear line (the field, the file:line, what was
expected) and an exit code from ``EXIT_CODES``.  The CLI prints ``str(err)`` and exits with
``err.exit_code``; it never shows a traceback for these.
"""

from __future__ import annotations

#: Documented exit codes (docs/exit-codes.md).  HALT codes are verdicts about the run, not
#: the host: a supervisor must not relaunch them.
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # bad spec, bad data, bad command line
EXIT_TRIPWIRE = 80  # a health tripwire halted the run
EXIT_SKIP_CAP = 81  # non-finite losses / spikes exceeded the skip cap
EXIT_WALL_BUDGET = 82  # max_wall_seconds spent (a checkpoint was written first)
EXIT_PREFLIGHT = 83  # preflight refused (output not writable, not enough disk, ...)
EXIT_DISK_FULL = 84  # the disk filled while writing a checkpoint or an export (the previous one is kept)


class PgsError(Exception):
    """Base class of every error pgs raises on purpose.  ``exit_code`` is what the CLI returns."""

    exit_code: int = EXIT_BAD_INPUT


class InvalidArgument(PgsError, ValueError):
    """A bad hyperparameter or argument of a ``pgs.func`` function (names the argument)."""


class TreeMismatch(PgsError, ValueError):
    """Two pytrees that must match (grads vs state, params vs updates) do not; names the leaf path."""


class SpecError(PgsError):
    """A spec that cannot be run: names the dotted field and, where possible, a suggestion."""


class DataError(PgsError):
    """Bad training data: names file:line and the problem."""


class CheckpointError(PgsError):
    """A checkpoint that cannot be resumed from (names the folder and what is wrong)."""


class MissingExtra(PgsError, ImportError):
    """An optional backend was asked for but its package is not installed (names the extra)."""


class HaltError(PgsError):
    """The run halted on a verdict (skip cap, tripwire); HALT.json has been written."""

    def __init__(self, message: str, exit_code: int = EXIT_SKIP_CAP):
        super().__init__(message)
        self.exit_code = exit_code


class PreflightRefused(PgsError):
    """A preflight check refused to start (exit 83)."""

    exit_code = EXIT_PREFLIGHT


class DiskFull(PgsError):
    """The disk filled while a checkpoint (or an export) was being written (exit 84).

    The partial temporary folder has been removed; earlier checkpoints are untouched."""

    exit_code = EXIT_DISK_FULL


class RunExists(PgsError):
    """``pgs run`` without ``--resume`` into a run folder that already holds a run (exit 2)."""


class RunInUse(PgsError):
    """``pgs run`` into a run folder that a live run holds (its lock, pgs/runtime/store/lock.py):
    a run folder has one writer (exit 2)."""
