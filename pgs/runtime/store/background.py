"""Checkpoints written while training goes on: ``[checkpoint] background = true``.

A foreground save (``checkpoint.save``) holds training until the step folder is written,
hashed, fsynced and renamed into place; for the large recipes that is many seconds per save
(docs/performance.md, "Checkpoint saves").  A background save holds it only for a snapshot:

1. every tensor of the step — the weights, the optimizer state, the weight EMA — is copied into
   host memory kept for the run (:class:`Snapshot`): page-locked memory for tensors on a GPU,
   so their copies are asynchronous device-to-host transfers queued on the current stream,
   behind this step's kernels and ahead of the next step's (they read this step's values);
   ordinary memory for tensors already on the host.  The RNG states and the trainer's
   counters are taken as they are (small, and fresh objects);
2. a thread waits for the copies (a CUDA event per device), then writes the folder from the snapshot
   through ``checkpoint.save_tensors`` — the same files, manifest, fsyncs and atomic rename
   as a foreground save — and then purges old folders (``checkpoint.purge``).

Training goes on meanwhile and cannot change what is written: the thread reads only the
snapshot.  One save is in flight at a time (:class:`BackgroundSaver`): the next save waits for
the one before it, and so do a stop (signal, wall budget), a halt, an error and the end of the
run, so that a run never leaves with a save half done unless it is killed (then the folder is
a temporary one, removed at the next start, and ``--resume auto`` takes the save before).  A
failure on the thread — a full disk (``DiskFull``, exit 84) or any other — is raised on the
training thread at the first step boundary where the save has ended on every process.

With several processes (FSDP2) the save is DCP's: ``pgs.runtime.store.dcp.save_async`` stages
each rank's shards in host memory (``torch.distributed.checkpoint.async_save``, its buffers kept
between saves) and writes them on a thread whose collectives run on a gloo group of their own;
rank 0's thread then writes the manifest and renames the folder.  The processes agree at every
step boundary whether the save has ended everywhere and whether it failed anywhere (two slots of
the control plane's flag vector, ``control.agree``), so that all of them collect it, or raise
its failure, at the same step.

Cost: host memory for one checkpoint's tensors, allocated before the first step
(:meth:`Snapshot.reserve`) and reused by every save (``pgs profile`` row "host: checkpoint
snapshot"); device time for the copies (bytes over the PCIe bandwidth).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch

from pgs.runtime import pinned

#: each snapshot tensor starts at a multiple of this many bytes of its buffer (any dtype's alignment)
ALIGN = 64


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _sizes(tensors) -> dict[bool, int]:
    """Snapshot bytes by side (on a GPU or not), each tensor's bytes padded to ``ALIGN``."""
    sizes = {True: 0, False: 0}
    for t in tensors:
        sizes[t.is_cuda] += _padded(_nbytes(t))
    return sizes


class Snapshot:
    """Host copies of groups of named tensors, in two buffers kept between snapshots: one
    page-locked (``pgs.runtime.pinned.host_buffer``) for the tensors on an accelerator, one
    ordinary for the tensors on the host.  A buffer is made again only when a snapshot needs
    more bytes than it has."""

    def __init__(self):
        self._buffers: dict[bool, torch.Tensor] = {}  # on an accelerator? -> buffer
        self._registered: dict[bool, bool] = {}

    @property
    def nbytes(self) -> int:
        """Host bytes held (both buffers)."""
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, device_side: bool, need: int) -> torch.Tensor:
        have = self._buffers.get(device_side)
        if have is not None and have.numel() >= need:
            return have
        self.release(device_side)
        buf, registered = pinned.host_buffer(need, pin=device_side)
        self._buffers[device_side], self._registered[device_side] = buf, registered
        return buf

    def take(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[dict[str, dict[str, torch.Tensor]],
                                                                           list[torch.cuda.Event]]:
        """``groups`` (name -> named tensors) copied; returns the copies (same names, shapes,
        dtypes; contiguous) and one CUDA event per device after its last copy (none: no tensor
        was on a GPU, every copy is done).  A device's copies are queued on its current stream."""
        entries = [(g, name, t.detach()) for g, tensors in groups.items() for name, t in tensors.items()]
        buffers = {side: self._buffer(side, n) for side, n in _sizes(t for _, _, t in entries).items() if n}
        offsets = {True: 0, False: 0}
        out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in groups}
        devices = set()
        for g, name, t in entries:
            side = t.is_cuda
            n = _nbytes(t)
            dst = buffers[side][offsets[side]:offsets[side] + n].view(t.dtype).view(t.shape) if n else \
                torch.empty(t.shape, dtype=t.dtype)
            offsets[side] += _padded(n)
            dst.copy_(t, non_blocking=side)
            if side:
                devices.add(t.device)
            out[g][name] = dst
        events = []
        for device in devices:
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()
            events.append(event)
        return out, events

    def reserve(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Make the buffers a snapshot of ``groups`` needs now, so that the first save does not
        wait for them (registering page-locked memory faults in and pins every page: seconds
        for a checkpoint of several GiB; docs/performance.md)."""
        for side, n in _sizes(t for tensors in groups.values() for t in tensors.values()).items():
            if n:
                self._buffer(side, n)

    def release(self, device_side: bool | None = None) -> None:
        """Free the buffers (one side, or both)."""
        for side in ([device_side] if device_side is not None else list(self._buffers)):
            buf = self._buffers.pop(side, None)
            if buf is not None and self._registered.pop(side, False):
                pinned.unregister(buf)


#: ``BackgroundSaver.flags``' failure codes (``SAVE_FAILED``): none, a failure, a full disk
FAILED, DISK_FULL = 1, 2


def failure_code(err: BaseException | None) -> int:
    """0 for no error, ``DISK_FULL`` for a full disk, else ``FAILED``."""
    from pgs.errors import DiskFull

    return 0 if err is None else DISK_FULL if isinstance(err, DiskFull) else FAILED


class BackgroundSaver:
    """At most one checkpoint save on a thread; see the module docstring.

    ``start(write, groups)`` snapshots ``groups`` (the calling thread waits only for that) and
    runs ``write(snapshot)`` on the thread; ``submit(job)`` runs a job that staged its own
    tensors (a multi-process DCP save).  ``flags()`` says whether the save is still running and
    how it failed, for the processes to agree on (``control.agree``) before each collects it
    with ``collect()``; ``wait()`` blocks for the save's result (and raises what it raised),
    ``close()`` waits and frees the snapshot's memory.

    ``label``: ``(folder, bytes)`` of the save in flight, for a message about it."""

    def __init__(self):
        self.snapshot = Snapshot()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgs-checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.snapshot_seconds = 0.0  # the last snapshot's (set before its write starts)
        self.label: tuple[str, int] | None = None
        self.group = None  # the gloo process group of multi-process saves (set by the run)
        self.writer = None  # DCP's storage writer, kept so that its staging buffers are reused

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self, write: Callable[[dict[str, dict[str, torch.Tensor]]], Any],
              groups: Mapping[str, Mapping[str, torch.Tensor]]) -> float:
        """Snapshot ``groups`` and write them on the thread; returns the snapshot's seconds.
        The save before must be collected first (``wait``: its result is the caller's)."""
        if self._pending is not None:
            raise RuntimeError("BackgroundSaver.start: a save is still in flight; wait() for it first")
        began = time.perf_counter()
        copies, events = self.snapshot.take(groups)
        self.snapshot_seconds = time.perf_counter() - began

        def job():
            for event in events:
                event.synchronize()
            return write(copies)

        self.submit(job)
        return self.snapshot_seconds

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job`` on the thread as the save in flight."""
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("BackgroundSaver.submit: a save is still in flight; wait() for it first")
            self._pending = self._pool.submit(job)

    def flags(self) -> tuple[int, int]:
        """``(running, failure)``: 1 while the save in flight runs; once it ended, its
        ``failure_code`` (0 when none is in flight or it succeeded)."""
        with self._lock:
            future = self._pending
        if future is None:
            return 0, 0
        if not future.done():
            return 1, 0
        return 0, failure_code(future.exception())

    def collect(self) -> tuple[Any, BaseException | None]:
        """Wait for the save in flight; ``(its result, None)`` or ``(None, its error)``."""
        try:
            return self.wait(), None
        except Exception as err:
            return None, err

    def wait(self) -> Any:
        """Block until the save in flight ends; its result (None: none), or its error."""
        with self._lock:
            future, self._pending = self._pending, None
        return future.result() if future is not None else None

    def close(self) -> Any:
        """``wait()``, then free the snapshot's buffers and the thread."""
        try:
            return self.wait()
        finally:
            self.snapshot.release()
            self._pool.shutdown(wait=True)
