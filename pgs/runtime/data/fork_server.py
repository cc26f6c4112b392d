"""What the fork server of the data worker process preloads (``loader._context``).

The server imports this module once, then forks every worker from itself, so the loader (and
torch under it) is imported already in each worker.

It also quiets the two errors of a worker's start that a trainer killed mid-start (SIGKILL, the
OOM killer) leaves behind, after it is gone, on the stderr it shared with the server and the
worker, where nobody can act on them:

* a forked child reads its process object from a pipe its parent writes
  (``multiprocessing.spawn._main``).  The parent's ``Process.start()`` blocks in that write
  until the child has read all but a pipe's buffer of it, and the child reads it only after
  importing the parent's main module (seconds under ``pgs run``): a parent killed then leaves
  the object cut short, the read fails (``EOFError``, or ``UnpicklingError: pickle data was
  truncated``) and the server's child code prints it through ``sys.excepthook``.  Quiet when
  that read raised it and the parent's end of the pipe is closed (the parent's sentinel, which
  multiprocessing opens for the child, is at end of file);
* the server receives each request's file descriptors on a connection the parent opened
  (``multiprocessing.reduction.recvfds``): a parent killed between the two leaves an
  ``EOFError`` that ends the server's loop, printed at its exit.  Quiet when the server's
  alive pipe reaches end of file within ``GONE_WAIT_S`` (every holder closed it: the parent
  and the workers, which die with it).

Any other error, and these same errors while the parent lives, go to the hook that was there.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import multiprocessing.spawn
import os
import pickle
import sys

from pgs.runtime.data import loader  # noqa: F401 - preloaded: each worker forks with it imported

#: How long the server waits for its parent's end of the alive pipe to close, on an error that
#: a gone parent explains (the workers end the moment the parent is gone).
GONE_WAIT_S = 10.0


def _at_end_of_file(fd, timeout: float) -> bool:
    """Whether ``fd`` (a pipe's reading end) reads end of file within ``timeout`` seconds."""
    if not isinstance(fd, int):
        return False
    try:
        if not multiprocessing.connection.wait([fd], timeout=timeout):
            return False  # a writer still holds its end
        return os.read(fd, 1) == b""
    except (OSError, ValueError):
        return False


def parent_gone(error: BaseException, tb) -> bool:
    """Whether ``error`` is a worker's start cut short by a parent that is gone: the forked
    child's read of its process object, or the server's receipt of a request."""
    if not isinstance(error, (EOFError, pickle.UnpicklingError)) or tb is None:
        return False
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    innermost = frames[-1].f_code
    if innermost is multiprocessing.spawn._main.__code__:
        return _at_end_of_file(frames[-1].f_locals.get("parent_sentinel"), 0.0)
    receive = getattr(multiprocessing.reduction, "recvfds", None)
    if isinstance(error, EOFError) and receive is not None and innermost is receive.__code__:
        server = [f for f in frames if f.f_code is multiprocessing.forkserver.main.__code__]
        return bool(server) and _at_end_of_file(server[0].f_locals.get("alive_r"), GONE_WAIT_S)
    return False  # raised in the main module's import, an object's own unpickling, elsewhere


def _excepthook(kind, error, tb) -> None:
    if parent_gone(error, tb):
        return
    _previous(kind, error, tb)


if getattr(sys.excepthook, "__module__", None) != __name__:
    _previous = sys.excepthook
    sys.excepthook = _excepthook
