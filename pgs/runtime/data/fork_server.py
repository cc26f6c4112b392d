"""What the fork server of the data worker process preloads (``loader._context``).

The server imports this module once, then forks every worker from itself, so the loader (and
torch under it) is imported already in each worker.

It also quiets one error of a worker's start that nobody can act on.  A forked child reads its
process object from a pipe its parent writes (``multiprocessing.spawn._main``); the parent's
``Process.start()`` blocks in that write until the child has read all but a pipe's buffer of
it, and the child reads it only after importing the parent's main module (seconds under
``pgs run``), so a trainer SIGKILLed in that window leaves the object cut short.  The child's
read then fails (``EOFError``, or ``UnpicklingError: pickle data was truncated``) and the fork
server's child code prints the traceback through ``sys.excepthook``, on the trainer's stderr,
after the trainer is gone.  The hook installed here says nothing for exactly that error: raised
by that read, with the parent's end of the pipe closed (the parent's sentinel, which
multiprocessing opens for the child, is at end of file).  Any other error, and that same error
while the parent lives, goes to the hook that was there.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import sys

from pgs.runtime.data import loader  # noqa: F401 - preloaded: each worker forks with it imported


def parent_gone_while_sending(error: BaseException, tb) -> bool:
    """Whether ``error`` is a forked child's read of its process object cut short by a parent
    that is gone (the child's parent sentinel at end of file)."""
    if not isinstance(error, (EOFError, pickle.UnpicklingError)) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    if frame.f_code is not multiprocessing.spawn._main.__code__:
        return False  # raised in the main module's import or an object's own unpickling
    sentinel = frame.f_locals.get("parent_sentinel")
    if not isinstance(sentinel, int):
        return False
    try:
        if not multiprocessing.connection.wait([sentinel], timeout=0):
            return False  # the parent still holds its end: it lives
        return os.read(sentinel, 1) == b""  # end of file: every writer (the parent) is gone
    except (OSError, ValueError):
        return False


def _excepthook(kind, error, tb) -> None:
    if parent_gone_while_sending(error, tb):
        return
    _previous(kind, error, tb)


if getattr(sys.excepthook, "__module__", None) != __name__:
    _previous = sys.excepthook
    sys.excepthook = _excepthook
