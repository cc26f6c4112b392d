"""Optimizer steps of batches, prepared ahead of the training step by a worker.

``StepLoader(stream, micro_batch, grad_accum, device)`` hands out one optimizer step at a
time: ``next_step()`` is the ``grad_accum`` micro-batches of the next step, already on
``device``.  Behind it:

* a **worker** calls ``stream.next_batch(micro_batch)`` ``grad_accum`` times per step
  (reading, templating, tokenizing, packing and collating), captures ``stream.state_dict()``
  right after each step's batches, and queues ``(batches, state)``.  By default
  (``worker="process"``) it is a daemon process, started from a fork server with a pickled
  copy of the stream: a worker *thread* keeps up with the data, but while it builds a pack
  window it holds the GIL and stalls the training thread's launches for about the time of the
  build (docs/data.md, bench/data_pipeline.py ``--overlap``); a process leaves the training
  thread its interpreter.
  ``worker="thread"`` keeps the daemon thread (no start-up cost, the live stream object).
  The process has a session of its own (signals to the trainer's process group are the
  trainer's to handle) and ends the moment its parent is gone.  It imports the main module,
  as any spawned child does: a script needs the ``if __name__ == "__main__":`` guard (the
  ``pgs`` command and ``python -m pgs`` have it);
* the stream's work comes in bursts: a whole pack window (512 documents) is tokenized and
  packed when the previous one is used up, seconds of work at once, then its steps are cheap
  to collate.  So by default (``ahead=None``) the worker keeps a window's worth of steps
  plus one ready: when it reaches the end of a window, the steps it has made cover the next
  window's build, as long as the pipeline makes tokens faster than training uses them.
  ``ahead=N`` bounds it to exactly ``N`` steps;
* on CUDA the batches are pinned and copied to the device **one step ahead**: when step
  ``k`` is handed out, the ``non_blocking`` copy of step ``k+1`` from pinned memory is already
  issued on a side stream (if the worker has it ready; otherwise it is issued when asked
  for).  Handing a step out makes the compute stream wait on the copy's event (no host sync)
  and records the tensors on it (``pgs.runtime.data.prefetch``).  On the CPU the batches are
  returned as they are.

The steps come in exactly the order of the synchronous path (``threaded=False``, which
produces each step when asked, on the caller's thread), and ``state_dict()`` is the stream's
position right after the last step handed out, not the worker's read-ahead position, so a
checkpoint resumes bit-exactly, mid-window included: ``load_state_dict()`` discards what was
read ahead and restarts the worker from the saved position.  Its ``stats`` are those of
that position too (the ``stream`` object itself does not move with a process worker, and
runs ahead with a thread: read the position and statistics from the loader).

Failures: an exception in the worker (a ``DataError`` from a bad record under
``data.on_bad_record = "error"``, or anything else) is raised by the ``next_step()`` that
would have returned the failed step, with its original type and message (from a process:
the worker's traceback is attached as a note), so a ``DataError`` still becomes exit code
2.  A worker that ends without a step or an error (a process killed, say), or makes no step
for ``stall_timeout`` seconds, is a :class:`DataWorkerFailed` (exit code 1, a crash:
relaunch with ``--resume auto``), never a hang.

A thread worker tokenizes with its own copy of the tokenizer: the training loop's own calls
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
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any

import attrs
import numpy as np
import torch

from pgs.errors import PgsError
from pgs.runtime.data.packing import PackedBatch
from pgs.runtime.data.stats import DataStats
from pgs.runtime.data.stream import TrainStream
from pgs.runtime.data.prefetch import copy_ahead, hand_over, map_tensors

#: How often a waiting consumer (or a worker with enough steps ready) looks up, in seconds.
POLL_S = 0.1
#: How long ``close()`` waits for the worker to finish the batch it is building.
CLOSE_WAIT_S = 30.0
#: The steps kept ready under ``ahead=None`` until the first window tells how many it holds.
MIN_AUTO_AHEAD = 2
WORKERS = ("process", "thread")


class DataWorkerFailed(PgsError, RuntimeError):
    """The data worker ended without a step or an error, stalled, or would not stop.

    Exit code 1: a crash, not bad input (a relaunch with ``--resume auto`` may succeed)."""

    exit_code = 1


class _Failure:
    """What the worker leaves in the queue, after the steps it made, when it raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _make_step(stream: TrainStream, micro_batch: int, grad_accum: int, stop=None):
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


# -- the thread worker -----------------------------------------------------------------------
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


class _ThreadWorker:
    """One producer thread over the (live) stream, from the position the stream is at."""

    kind = "thread"

    def __init__(self, stream: TrainStream, micro_batch: int, grad_accum: int, ahead: int | None, pin: bool):
        self.queue: queue.Queue = queue.Queue(maxsize=ahead or MIN_AUTO_AHEAD)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_produce, args=(stream, micro_batch, grad_accum, pin, self.queue, self.stop, ahead is None),
            name="pgs-data-worker", daemon=True,
        )
        self.thread.start()

    def get(self, timeout: float | None):
        """The next item; ``timeout=None``: only if one is there.  ``queue.Empty`` otherwise."""
        return self.queue.get(timeout=timeout) if timeout is not None else self.queue.get_nowait()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def ended(self) -> str:
        return "the thread ended"

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


# -- the process worker ----------------------------------------------------------------------
def _to_arrays(batch) -> tuple:
    """A batch (an attrs class of tensors, lists of tensors and ints: ``PackedBatch``,
    ``PreferenceBatch``) as numpy arrays and ints: pickled as bytes through the pipe (torch
    would send each tensor as a shared-memory segment of its own)."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.numpy()
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return type(batch), {f.name: plain(getattr(batch, f.name)) for f in attrs.fields(type(batch))}


def _from_arrays(parts: tuple):
    kind, fields = parts

    def tensors(value):
        if isinstance(value, np.ndarray):
            return torch.from_numpy(value)
        if isinstance(value, list):
            return [tensors(v) for v in value]
        return value

    return kind(**{name: tensors(value) for name, value in fields.items()})


def _portable(err: BaseException) -> tuple[BaseException, str]:
    """The exception as it can cross to the parent (itself when it pickles), and its traceback."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - an exception that does not pickle is described instead
        return DataWorkerFailed(f"data worker: {type(err).__name__}: {err}"), text
    return err, text


def _die_with(sentinel) -> None:
    mp.connection.wait([sentinel])
    os._exit(0)


def _detach() -> None:
    """Live and die with the parent only.  A session of its own: signals sent to the parent's
    process group (Ctrl-C, a scheduler's SIGTERM) are the parent's to handle (it checkpoints
    and stops), not a reason for the worker to die under it.  A watcher thread ends the
    process the moment the parent is gone, even a SIGKILLed parent (whose pipes would
    otherwise stay open in this process)."""
    try:
        os.setsid()
    except (AttributeError, OSError):
        pass
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_die_with, args=(parent.sentinel,), name="pgs-data-parent", daemon=True).start()


def _serve(sys_path: list[str], template: bytes, state: dict | None, micro_batch: int,
           grad_accum: int, ahead: int | None, out, stop, consumed) -> None:
    """The worker process: the pickled stream, moved to ``state`` (then ``("ready", state)``),
    makes steps into ``out`` while fewer than the depth are unconsumed; an error goes in last."""
    sys.path[:] = sys_path  # as a spawned child would have it (the fork server's is its own)
    _detach()
    try:
        torch.set_num_threads(1)
        stream = pickle.loads(template)
        if state is not None:
            stream.load_state_dict(state)
            out.put(("ready", stream.state_dict()))
        per_step = micro_batch * grad_accum * stream.world_size
        depth = ahead or MIN_AUTO_AHEAD
        made = 0
        while not stop.is_set():
            if made - consumed.value >= depth:
                stop.wait(POLL_S)
                continue
            step = _make_step(stream, micro_batch, grad_accum, stop)
            if step is None:
                break
            batches, now = step
            if ahead is None:
                depth = max(depth, window_steps(now, per_step) + 1)
            out.put(("step", [_to_arrays(b) for b in batches], now))
            made += 1
    except BaseException as err:  # noqa: BLE001 - handed to the parent, raised there
        error, text = _portable(err)
        out.put(("error", error, text))
        return  # the queue's feeder thread flushes the error before the process exits
    out.cancel_join_thread()  # stopped: leave what the parent will not read


def _context():
    """A fork server (clean, no CUDA, no threads; this module preloaded, and a start cut short
    by a killed parent kept quiet: ``pgs.runtime.data.fork_server``), else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["pgs.runtime.data.fork_server"])
        return context
    return mp.get_context("spawn")


class _ProcessWorker:
    """One producer process, started from the pickled stream (moved to ``state`` if given)."""

    kind = "process"

    def __init__(self, template: bytes, state: dict | None, micro_batch: int, grad_accum: int, ahead: int | None):
        context = _context()
        self.queue = context.Queue()
        self.stop = context.Event()
        self.consumed = context.Value("q", 0, lock=False)  # steps taken; written here only
        self.process = context.Process(
            target=_serve,
            args=(list(sys.path), template, state, micro_batch, grad_accum, ahead,
                  self.queue, self.stop, self.consumed),
            name="pgs-data-worker", daemon=True,
        )
        self.process.start()

    def get(self, timeout: float | None):
        """The next item; ``timeout=None``: only if one is there.  ``queue.Empty`` otherwise."""
        item = self.queue.get(timeout=timeout) if timeout is not None else self.queue.get_nowait()
        if item[0] == "step":
            self.consumed.value += 1
            return [_from_arrays(b) for b in item[1]], item[2]
        if item[0] == "error":
            error, text = item[1], item[2]
            if hasattr(error, "add_note"):
                error.add_note("in the data worker process:\n" + text.rstrip())
            return _Failure(error)
        return item  # ("ready", state)

    def alive(self) -> bool:
        return self.process.is_alive()

    def ended(self) -> str:
        return f"the process ended (exit code {self.process.exitcode})"

    def halt(self, wait: float | None) -> bool:
        """Stop the process: asked first (a second at most: what it makes next is dropped
        anyway), then terminated, then killed; True once it ended."""
        self.stop.set()
        self.process.join(timeout=min(1.0, 1.0 if wait is None else wait))
        for end in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            end()
            self.process.join(timeout=5.0)
        self.queue.close()
        self.queue.cancel_join_thread()
        return not self.process.is_alive()


# -- the loader ------------------------------------------------------------------------------
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


def _template(stream: TrainStream) -> bytes | None:
    """The stream pickled for a worker process (``None``, with a warning, when it cannot be)."""
    for source in getattr(stream, "_sources", []):
        source.close()  # an open file does not pickle; reading reopens it
    try:
        return pickle.dumps(stream, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # noqa: BLE001 - then the worker is a thread
        warnings.warn(
            f"StepLoader: the stream cannot be pickled for a worker process ({type(err).__name__}: {err}); "
            "a worker thread is used instead",
            RuntimeWarning, stacklevel=3,
        )
        return None


class StepLoader:
    """The batches of each optimizer step, prepared ahead by a worker (module docstring).

    Args:
        stream: the training stream; the loader owns it from now on.
        micro_batch: sequences per micro-batch (``stream.next_batch(micro_batch)``).
        grad_accum: micro-batches per optimizer step.
        device: where the batches go; CUDA: pinned memory, ``non_blocking`` copies on a side
            stream, one step ahead; CPU: the batches as they are.
        ahead: steps the worker may have ready: ``None`` (default) a pack window's worth plus
            one, so the next window's build hides behind them; an int (>= 1) exactly that many.
        threaded: False gives the synchronous path (each step made when asked, same API).
        worker: ``"process"`` (default) or ``"thread"``, what runs ahead when ``threaded``.
        stall_timeout: seconds ``next_step`` waits for a step from a live worker before it
            gives up with :class:`DataWorkerFailed` (``None``: wait as long as it lives).
    """

    def __init__(self, stream: TrainStream, micro_batch: int, grad_accum: int, device: torch.device | str, *,
                 ahead: int | None = None, threaded: bool = True, worker: str = "process",
                 stall_timeout: float | None = 600.0):
        checked = ([("micro_batch", micro_batch), ("grad_accum", grad_accum)]
                   + ([] if ahead is None else [("ahead", ahead)]))
        for name, value in checked:
            if int(value) < 1:
                raise ValueError(f"StepLoader: {name} must be >= 1, got {value}")
        if worker not in WORKERS:
            raise ValueError(f"StepLoader: worker must be one of {', '.join(WORKERS)}, got {worker!r}")
        self.stream = stream
        self.micro_batch = int(micro_batch)
        self.grad_accum = int(grad_accum)
        self.device = torch.device(device)
        self.ahead = None if ahead is None else int(ahead)
        self.threaded = bool(threaded)
        self.stall_timeout = stall_timeout
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._template = _template(stream) if self.threaded and worker == "process" else None
        self.worker = worker if self._template is not None or not self.threaded else "thread"
        if self.threaded and self.worker == "thread":
            stream.tokenizer = _own_tokenizer(stream.tokenizer)
        self._state = stream.state_dict()
        self._pending: tuple[list[PackedBatch], Any, dict] | None = None  # copied ahead, not handed out
        self._error: BaseException | None = None
        self._error_tb = None
        self._worker: _ThreadWorker | _ProcessWorker | None = None
        self._stalled = False
        self._closed = False
        if self.threaded:
            self._start(None)

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
        """Return to a saved position: steps made ahead are dropped, the worker restarts there.

        A state the stream refuses (other data) raises its ``DataError`` here."""
        if self._closed:
            raise RuntimeError("StepLoader.load_state_dict: the loader is closed")
        self._stop_worker(wait=self.stall_timeout, strict=True)
        self._pending = None
        self._error = self._error_tb = None
        self._stalled = False
        if self.threaded and self.worker == "process":
            self._start(state)
            ready = self._take(block=True, want="ready")
            self._state = ready[1]
            return
        try:
            self.stream.load_state_dict(state)
        except BaseException as err:
            self._error, self._error_tb = err, err.__traceback__
            raise
        self._state = self.stream.state_dict()
        if self.threaded:
            self._start(None)

    def close(self) -> None:
        """Stop the worker (idempotent); steps made ahead are dropped."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        # a stalled worker is not waited for (a thread stops when it can, a process is ended)
        self._stop_worker(wait=0.0 if self._stalled else CLOSE_WAIT_S, strict=False)

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- worker ------------------------------------------------------------------------
    def _start(self, state: dict | None) -> None:
        if self.worker == "process":
            self._worker = _ProcessWorker(self._template, state, self.micro_batch, self.grad_accum, self.ahead)
        else:
            self._worker = _ThreadWorker(self.stream, self.micro_batch, self.grad_accum, self.ahead, pin=self._cuda)
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

    def _take(self, block: bool, want: str = "step"):
        """The next ``(batches, state)`` (or ``("ready", state)``): from the worker, or made here."""
        if not self.threaded:
            try:
                return _make_step(self.stream, self.micro_batch, self.grad_accum)
            except BaseException as err:
                self._fail(err)
        worker = self._worker
        if worker is None:
            raise RuntimeError("StepLoader: no data worker (a restore failed)")
        started = time.monotonic()
        while True:
            try:
                item = worker.get(POLL_S if block else None)
                break
            except queue.Empty:
                if not block:
                    return None
            if not worker.alive():
                try:  # it may have sent its last item just before it ended
                    item = worker.get(POLL_S)
                    break
                except queue.Empty:
                    self._fail(DataWorkerFailed(f"data worker: {worker.ended()} without a {want} or an error"))
            if self.stall_timeout is not None and time.monotonic() - started > self.stall_timeout:
                worker.stop.set()
                self._stalled = True
                self._fail(DataWorkerFailed(
                    f"data worker: no {want} in {self.stall_timeout:.0f} s (stalled); "
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
