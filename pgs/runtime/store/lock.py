"""One writer per run folder: the lock ``pgs run`` holds on ``<run dir>/.pgs.lock``.

Two runs writing one folder interleave ``metrics.jsonl`` and overwrite each other's
checkpoints; a ``--resume auto`` while the run still goes rewrites ``metrics.jsonl`` under it.
So a run takes an exclusive lock on the folder before it reads or writes anything there, and
holds it for the life of its process; a second run or resume is refused (``RunInUse``, exit 2)
with one line naming the holder.

What it relies on: the operating system's advisory file lock, ``flock(LOCK_EX | LOCK_NB)``
on an open file, not a process id.  The kernel releases it when the holding process ends,
however it ends (SIGKILL, OOM killer, a crash): nothing has to clean up, and a lock left by a
dead process is simply free.  Its file keeps what the holder wrote into it (host, pid, start
time, command line) so that a refusal can say who holds the folder; a holder that ends
normally removes the file before it lets go, so a free lock whose file still names a holder
is a process that died holding it, and the next run says that it takes it over.

On a shared filesystem the lock is the filesystem's: on Linux's NFS client ``flock`` is
carried out as a whole-file byte-range lock on the server (NLM with NFSv3, the protocol's own
locks with NFSv4), so runs on different hosts exclude each other.  A host that dies holding
it releases it when the server's lease on that client expires (NFSv4: 90 s by default), or,
with NFSv3, when that host reboots; a folder mounted with ``nolock`` or ``local_lock=flock|all``
(Lustre's ``localflock``) has locks that only the host itself sees, and then runs on two hosts
are not excluded.  A filesystem that refuses locks altogether (``ENOLCK``, ``EOPNOTSUPP``)
gets one warning and the run goes on unlocked.  Deleting ``.pgs.lock`` while a run holds it
defeats the lock (the next run locks a new file): do it only to clear the lock of a host that
will not come back.

``pgs supervise`` holds a lock of its own on ``<run dir>/.pgs-supervise.lock`` while it
supervises (one supervisor per folder: a second one's log lines would go into the first's
``supervise.jsonl``, and its runs would be refused one after the other), and probes the run's
lock before it starts: the runs it launches take the run's lock as any run does.

Several processes of one run (torchrun, ``pgs run --nproc N``) lock once: the process of
global rank 0 (``RANK``), which is also the one that moves an old run aside; ``pgs run --nproc
N``'s launcher probes the lock before it starts any worker (:func:`refuse_if_held`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from pgs.errors import RunInUse

LOCK_FILE = ".pgs.lock"
#: the lock of ``pgs supervise`` (one supervisor per run folder; its runs take LOCK_FILE)
SUPERVISOR_LOCK_FILE = ".pgs-supervise.lock"
#: errors of a filesystem that has no working file locks (the run goes on, warned)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _holder_line() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                       "command": " ".join([_program(), *sys.argv[1:]])})


def _program() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return "pgs" if name in ("pgs", "__main__.py") else name


def _describe(raw: str) -> str:
    """The holder the lock file names, in words ("pid 12 on host h, started ..., pgs run x.toml")."""
    try:
        who = json.loads(raw)
        return (f"pid {who['pid']} on host {who['host']}, started {who['started']}"
                + (f" ({who['command']})" if who.get("command") else ""))
    except (ValueError, TypeError, KeyError):
        return "a process that has not written its name yet"


def _missing(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist, innermost first."""
    out, path = [], os.path.abspath(path)
    while path and not os.path.exists(path) and path != os.path.dirname(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16).decode("utf-8", "replace").strip()


class RunLock:
    """The lock of one run folder, held from :meth:`acquire` until :meth:`release` (or the
    process's end).  ``fd`` is None where nothing is held (not rank 0, or no locks on the
    filesystem)."""

    def __init__(self, run_dir: str, name: str = LOCK_FILE):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, name)
        self.holder = "a live run" if name == LOCK_FILE else "a live pgs supervise"
        self.fd: int | None = None
        self.took_over: str | None = None  # the dead holder this lock was taken from, in words
        self.made: list[str] = []  # the folders made for the lock, innermost first: removed if still empty

    def acquire(self) -> "RunLock":
        """Take the folder (created if missing), or raise ``RunInUse`` naming the live holder."""
        for _ in range(8):  # the file can be removed or moved away between open and lock: retry
            try:
                if not os.path.isdir(self.run_dir):
                    self.made = _missing(self.run_dir)
                    os.makedirs(self.run_dir, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # the folder was removed meanwhile (an empty one, by a run that let go)
            except OSError:
                return self  # a folder that cannot be made or written: the run's own checks refuse it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read(fd) if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
                os.close(fd)
                if err.errno in NO_LOCKS:
                    print(f"pgs: warning: the filesystem of {self.run_dir} has no file locks ({err.strerror}); "
                          "nothing keeps a second run out of this folder", file=sys.stderr, flush=True)
                    return self
                if holder is None:
                    raise
                raise RunInUse(f"checkpoint.dir: {self.run_dir} is in use by {self.holder}: {_describe(holder)}; "
                               "a run folder has one writer: wait for that run to end (or stop it), "
                               "or give this run another checkpoint.dir") from None
            if not self._still_there(fd):  # locked a file that was removed or moved away meanwhile
                os.close(fd)
                continue
            previous = _read(fd)
            self.took_over = _describe(previous) if previous else None
            os.ftruncate(fd, 0)
            os.pwrite(fd, (_holder_line() + "\n").encode(), 0)
            self.fd = fd
            return self
        raise RunInUse(f"checkpoint.dir: {self.run_dir} keeps being moved while this run tries to lock it")

    def _still_there(self, fd: int) -> bool:
        """Whether the lock file's path still names the file ``fd`` has open."""
        try:
            here, held = os.stat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        """A clean end: remove the lock file while still holding it (a process that opened it
        meanwhile finds, once it locks, that the path no longer names it, and starts over), let
        go, and remove the folder when this lock made it and nothing else was written there."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            if self._still_there(fd):
                os.unlink(self.path)
        os.close(fd)  # closing the only descriptor of the lock releases it
        with contextlib.suppress(OSError):
            for folder in self.made:
                os.rmdir(folder)  # only an empty folder

    def relock(self) -> None:
        """After the folder was renamed (``--overwrite``): lock the new folder at the old path,
        then let go of the old one (emptied, left in the renamed folder), so that no moment
        leaves the path unlocked by this run."""
        if self.fd is None:
            return
        old, self.fd = self.fd, None
        self.made = []
        try:
            self.acquire()
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(old, 0)
            os.close(old)


@contextlib.contextmanager
def hold(run_dir: str, *, main: bool = True):
    """The folder's lock for the ``with`` block (``main`` false: a rank that locks nothing)."""
    lock = RunLock(run_dir)
    if main:
        lock.acquire()
        if lock.took_over:
            print(f"pgs: the run folder's lock was left by {lock.took_over}, which is no longer running; "
                  "this run takes it over", file=sys.stderr, flush=True)
    try:
        yield lock
    finally:
        lock.release()


def refuse_if_held(run_dir: str) -> None:
    """``RunInUse`` when a live run holds ``run_dir`` (a probe: the lock is let go at once);
    nothing when the folder does not exist."""
    if os.path.isdir(run_dir):
        RunLock(run_dir).acquire().release()
