"""Optimizer steps of batches, prepared ahead of the training step on a worker thread.

``StepLoader(stream, micro_batch, grad_accum, device)`` hands out one optimizer step at a
time: ``next_step()`` is the ``grad_accum`` micro-batches of the next step, already on
``device``.  Behind it:

* a daemon **worker thread** calls ``stream.next_batch(micro_batch)`` ``grad_accum`` times per
  step (reading, templating, tokenizing, packing and collating), captures
  ``stream.state_dict()`` right after each step's batches, pins the tensors (only where CUDA
  is), and puts ``(batches, state)`` into a bounded queue.  The heavy parts (the Rust
  tokenizer, torch's copies) run without the GIL.  The stream's work comes in bursts: a
  whole pack window (512 documents) is tokenized and packed when the previous one is used
  up, seconds of work at once, then its steps are cheap to collate.  So by default
  (``ahead=None``) the queue holds a window's worth of steps plus one: when the worker
  reaches the end of a window, the steps it has queued cover the next window's build, as
  long as the pipeline makes tokens faster than training uses them (bench/data_pipeline.py).
  ``ahead=N`` bounds it to exactly ``N`` steps;
* on CUDA the consumer copies a step to the device **one step ahead**: when step ``k`` is
  handed out, the ``non_blocking`` copy of step ``k+1`` from pinned memory is already issued
  on a side stream (if the worker has it ready; otherwise it is issued when asked for).
  Handing a step out makes the compute stream wait on the copy's event (no host sync) and
  records the tensors on it (``pgs.runtime.prefetch``).  On the CPU the batches are returned
  as they are.

The steps come in exactly the order of the synchronous path (``threaded=False``, which
produces each step when asked, on the caller's thread), and ``state_dict()`` is the stream's
position right after the last step handed out, not the worker's read-ahead position, so a
checkpoint resumes bit-exactly, mid-window included: ``load_state_dict()`` discards what was
read ahead and restarts the worker from the saved position.  Its ``stats`` are those of
that position too.

Failures: an exception in the worker (a ``DataError`` from a bad record under
``data.on_bad_record = "error"``, or anything else) is raised by the ``next_step()`` that
would have returned the failed step, with its original type, message and traceback, so a
``DataError`` still becomes exit code 2.  A worker that ends without a step or an error, or
makes no step for ``stall_timeout`` seconds, is a :class:`DataWorkerFailed` (exit code 1, a
crash: relaunch with ``--resume auto``), never a hang.

The worker tokenizes with its own copy of the tokenizer: the training loop's own calls
(evaluation pads its batches, which reconfigures the Rust tokenizer in place) would
otherwise race it.

Example::

    with StepLoader(stream, micro_batch=8, grad_accum=4, device=torch.device("cuda")) as loader:
        for step in range(total):
            batches = loader.next_step()           # 4 PackedBatch, tensors on the GPU
            ...
            if save:
                checkpoint["data"] = loader.state_dict()
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from pgs.errors import PgsError
from pgs.runtime.data.packing import PackedBatch
from pgs.runtime.data.stats import DataStats
from pgs.runtime.data.stream import TrainStream
from pgs.runtime.prefetch import copy_ahead, hand_over, map_tensors

#: How often a waiting consumer (or a worker blocked on a full queue) looks up, in seconds.
POLL_S = 0.1
#: How long ``close()`` waits for the worker to finish the batch it is building.
CLOSE_WAIT_S = 30.0
#: The queue's size under ``ahead=None`` until the first window tells how many steps it holds.
MIN_AUTO_AHEAD = 2


class DataWorkerFailed(PgsError, RuntimeError):
    """The data worker thread ended without a step or an error, stalled, or would not stop.

    Exit code 1: a crash, not bad input (a relaunch with ``--resume auto`` may succeed)."""

    exit_code = 1


class _Failure:
    """What the worker leaves in the queue, after the steps it made, when it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _pin(x: torch.Tensor) -> torch.Tensor:
    return x.pin_memory()


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _make_step(stream: TrainStream, micro_batch: int, grad_accum: int, stop: threading.Event | None = None):
    """The next step's batches and the stream position right after them (``None``: stopped)."""
    batches = []
    for _ in range(grad_accum):
        if stop is not None and stop.is_set():
            return None
        batches.append(stream.next_batch(micro_batch))
    return batches, stream.state_dict()


def window_steps(state: dict, sequences_per_step: int) -> int:
    """Optimizer steps in one pack window, on average so far (from a stream ``state_dict``)."""
    windows = state["window"] + 1 if state["built"] else state["window"]
    if windows <= 0:
        return 0
    return math.ceil(state["stats"]["sequences"] / windows / sequences_per_step)


def _deepen(out: queue.Queue, depth: int) -> None:
    with out.mutex:
        if depth > out.maxsize:
            out.maxsize = depth
            out.not_full.notify_all()


def _produce(stream: TrainStream, micro_batch: int, grad_accum: int, pin: bool,
             out: queue.Queue, stop: threading.Event, auto_depth: bool) -> None:
    """The worker thread: steps into ``out`` until ``stop``; an exception goes in last.

    With ``auto_depth`` the queue grows to a window's worth of steps plus one (module
    docstring), measured from the windows built so far."""
    per_step = micro_batch * grad_accum * stream.world_size
    try:
        while not stop.is_set():
            step = _make_step(stream, micro_batch, grad_accum, stop)
            if step is None:
                return
            batches, state = step
            if auto_depth:
                _deepen(out, window_steps(state, per_step) + 1)
            if pin:
                batches = [map_tensors(_pin, b) for b in batches]
            if not _put(out, (batches, state), stop):
                return
    except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
        _put(out, _Failure(err), stop)


class _Worker:
    """One producer thread over the stream, from the position the stream is at."""

    def __init__(self, stream: TrainStream, micro_batch: int, grad_accum: int, ahead: int | None, pin: bool):
        self.queue: queue.Queue = queue.Queue(maxsize=ahead or MIN_AUTO_AHEAD)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_produce, args=(stream, micro_batch, grad_accum, pin, self.queue, self.stop, ahead is None),
            name="pgs-data-worker", daemon=True,
        )
        self.thread.start()

    def halt(self, wait: float | None) -> bool:
        """Ask the thread to stop, drop what it made, wait up to ``wait`` s; True once it ended."""
        self.stop.set()
        deadline = None if wait is None else time.monotonic() + wait
        while self.thread.is_alive():
            self._drain()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self.thread.join(timeout=POLL_S if left is None else min(POLL_S, left))
        self._drain()
        return not self.thread.is_alive()

    def _drain(self) -> None:
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass


def _own_tokenizer(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception as err:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
        warnings.warn(
            f"StepLoader: the tokenizer cannot be copied for the data worker ({type(err).__name__}: {err}); "
            "it is shared, so do not call it from the training thread while the worker runs",
            RuntimeWarning, stacklevel=3,
        )
        return tokenizer


class StepLoader:
    """The batches of each optimizer step, prepared ahead on a worker thread (module docstring).

    Args:
        stream: the training stream; the loader owns it from now on (its worker advances it).
        micro_batch: sequences per micro-batch (``stream.next_batch(micro_batch)``).
        grad_accum: micro-batches per optimizer step.
        device: where the batches go; CUDA: pinned memory, ``non_blocking`` copies on a side
            stream, one step ahead; CPU: the batches as they are.
        ahead: steps the worker may have ready in its queue: ``None`` (default) a pack window's
            worth plus one, so the next window's build hides behind them; an int (>= 1) exactly
            that many.
        threaded: False gives the synchronous path (each step made when asked, same API).
        stall_timeout: seconds ``next_step`` waits for a step from a live worker before it
            gives up with :class:`DataWorkerFailed` (``None``: wait as long as it lives).
    """

    def __init__(self, stream: TrainStream, micro_batch: int, grad_accum: int, device: torch.device | str, *,
                 ahead: int | None = None, threaded: bool = True, stall_timeout: float | None = 600.0):
        checked = [("micro_batch", micro_batch), ("grad_accum", grad_accum)] + ([] if ahead is None else [("ahead", ahead)])
        for name, value in checked:
            if int(value) < 1:
                raise ValueError(f"StepLoader: {name} must be >= 1, got {value}")
        self.stream = stream
        self.micro_batch = int(micro_batch)
        self.grad_accum = int(grad_accum)
        self.device = torch.device(device)
        self.ahead = None if ahead is None else int(ahead)
        self.threaded = bool(threaded)
        self.stall_timeout = stall_timeout
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        if self.threaded:
            stream.tokenizer = _own_tokenizer(stream.tokenizer)
        self._state = stream.state_dict()
        self._pending: tuple[list[PackedBatch], Any, dict] | None = None  # copied ahead, not handed out
        self._error: BaseException | None = None
        self._error_tb = None
        self._worker: _Worker | None = None
        self._stalled = False
        self._closed = False
        if self.threaded:
            self._start()

    # -- public ------------------------------------------------------------------------
    def next_step(self) -> list[PackedBatch]:
        """The ``grad_accum`` micro-batches of the next optimizer step, on ``device``."""
        if self._closed:
            raise RuntimeError("StepLoader.next_step: the loader is closed")
        self._raise_pending_error()
        if self._pending is not None:
            step, self._pending = self._pending, None
        else:
            step = self._launch(self._take(block=True))
        if self._cuda and self.threaded:
            # The next step's copy goes out before this one is handed over, when it is ready.
            nxt = self._take(block=False)
            if nxt is not None:
                self._pending = self._launch(nxt)
        batches, ready, state = step
        self._state = state
        if ready is not None:
            batches = hand_over(batches, ready, self.device)
        return batches

    def state_dict(self) -> dict:
        """The stream position right after the last step handed out (JSON-serialisable, the
        format of ``TrainStream.state_dict()``), whatever the worker has read ahead."""
        return copy.deepcopy(self._state)

    @property
    def stats(self) -> DataStats:
        """The data statistics at the position of :meth:`state_dict`."""
        stats = DataStats()
        stats.load(self._state["stats"])
        return stats

    def load_state_dict(self, state: dict) -> None:
        """Return to a saved position: steps made ahead are dropped, the worker restarts there."""
        self._stop_worker(wait=self.stall_timeout, strict=True)
        self._pending = None
        self._error = self._error_tb = None
        self._stalled = False
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()
        if self.threaded and not self._closed:
            self._start()

    def close(self) -> None:
        """Stop the worker thread (idempotent); steps made ahead are dropped."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        # a stalled worker is not waited for (it is a daemon thread and stops when it can)
        self._stop_worker(wait=0.0 if self._stalled else CLOSE_WAIT_S, strict=False)

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker ------------------------------------------------------------------------
    def _start(self) -> None:
        self._worker = _Worker(self.stream, self.micro_batch, self.grad_accum, self.ahead, pin=self._cuda)
        weakref.finalize(self, self._worker.stop.set)  # a loader dropped without close() stops its worker

    def _stop_worker(self, wait: float | None, strict: bool) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if not worker.halt(wait) and strict:
            raise DataWorkerFailed(
                f"data worker: did not stop within {wait:.0f} s; the stream cannot be moved while it runs"
            )

    def _fail(self, error: BaseException) -> None:
        self._error, self._error_tb = error, error.__traceback__
        raise error

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise self._error.with_traceback(self._error_tb)

    def _take(self, block: bool):
        """The next ``(batches, state)``: from the worker's queue, or made here (synchronous)."""
        if not self.threaded:
            try:
                return _make_step(self.stream, self.micro_batch, self.grad_accum)
            except BaseException as err:
                self._fail(err)
        worker = self._worker
        started = time.monotonic()
        while True:
            try:
                item = worker.queue.get(timeout=POLL_S) if block else worker.queue.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return None
            if not worker.thread.is_alive():
                try:  # it may have put its last item just before it ended
                    item = worker.queue.get_nowait()
                    break
                except queue.Empty:
                    self._fail(DataWorkerFailed("data worker: the thread ended without a step or an error"))
            if self.stall_timeout is not None and time.monotonic() - started > self.stall_timeout:
                worker.stop.set()
                self._stalled = True
                self._fail(DataWorkerFailed(
                    f"data worker: no step in {self.stall_timeout:.0f} s (stalled); "
                    "raise StepLoader(stall_timeout=) if one step's data can take longer"
                ))
        if isinstance(item, _Failure):
            if block:
                self._fail(item.error)
            # met while copying ahead: raised by the next call, after this step is handed out
            self._error, self._error_tb = item.error, item.error.__traceback__
            return None
        return item

    def _launch(self, item) -> tuple[list[PackedBatch], Any, dict]:
        """Start the step's copy to the device; ``(batches, ready event or None, state)``."""
        batches, state = item
        if self._cuda:
            moved, ready = copy_ahead(batches, self.device, self._copy_stream, pin_memory=True)
            return moved, ready, state
        if self.device.type not in ("cpu", "cuda"):  # another accelerator: a plain copy
            batches = [map_tensors(lambda x: x.to(self.device), b) for b in batches]
        return batches, None, state
