"""Will the host hold the run?  The resource half of the preflight (exit 83, docs/exit-codes.md).

``pgs validate`` and ``pgs run`` (before the model is built) ask :func:`check_host`:

- **memory**: the peak ``pgs profile`` predicts for one process (weights, optimizer state,
  gradients, activations, the loss's buffers; ``pgs.runtime.tools.profile.predict_memory``)
  plus the attention's sequence-squared buffers (:func:`attention_matrix_bytes`), against
  what the device has free: ``torch.cuda.mem_get_info`` on CUDA, the kernel's
  ``MemAvailable`` (capped by the cgroup's ``memory.max``) on the CPU.  The prediction leaves
  out backward's own working set and allocator slack, so it is a lower bound: a run it refuses
  cannot fit, and one it passes may still be tight.  Without it an impossible
  ``data.max_seq_len`` on the CPU passed every check and the kernel's OOM killer ended the
  run (exit 137) with no message.
- **host memory of a background save** (``checkpoint.background``): one checkpoint's
  tensors (:func:`check_snapshot`), beside what else the run keeps in host memory
  (``offload_optimizer``'s state, ``offload_checkpoints``' inputs; the peak itself on the CPU).
- **disk**: the run folder (or the nearest folder above it that exists) is writable and has
  room for ``DISK_COPIES`` checkpoints' worth of weights and optimizer state
  (:func:`check_disk`; the loop checks again with the real byte count once the model is built).

With several processes (FSDP2), or when ``pgs validate`` cannot know how many (several CUDA
devices visible), the memory check is skipped: the prediction is for one unsharded process.
"""

from __future__ import annotations

import os
import shutil

import torch

from pgs.errors import PreflightRefused
from pgs.runtime import process
from pgs.runtime.common import auto_device
from pgs.runtime.tools.profile import Prediction, attention_matrix_bytes, predict  # noqa: F401 - re-exported

GiB = 1024**3
#: checkpoints' worth of disk a run that keeps every checkpoint (``checkpoint.keep = 0``) is
#: asked to have free at the start: at least the first two and the export
DISK_COPIES = 3.0


def disk_copies(checkpoint, run_dir: str | None = None) -> float:
    """How many checkpoints' worth of free disk ``[checkpoint]`` still needs at its fullest: the
    ``keep`` newest plus the one being written beside them, the best one when ``best_metric`` is
    set, and the export (weights only, counted as a whole checkpoint) when ``export``.

    ``run_dir``: the run folder of a resumed run; the step folders already in it are on the
    disk (not free space to find) and count towards ``keep``, up to ``keep`` of them.  (The best
    and final folders are not: a new one is written beside the old before the old is removed.)
    A run with neither periodic saves nor a save after its last step (``every = 0``, ``last =
    false``) needs only its exports' room."""
    if not checkpoint.every and not checkpoint.last:
        return float(bool(checkpoint.best_metric) + bool(checkpoint.export))
    if checkpoint.keep <= 0:
        return DISK_COPIES
    have = 0
    if run_dir is not None and os.path.isdir(run_dir):
        from pgs.runtime.store.checkpoint import step_folders

        have = min(len(step_folders(run_dir)), checkpoint.keep)
    return checkpoint.keep - have + 1 + bool(checkpoint.best_metric) + bool(checkpoint.export)


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """Bytes free for a run on ``device`` and how the number was found (None: unknown)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # validating a GPU spec elsewhere: its device is not here
            return None, ""
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"{torch.cuda.get_device_name(device)} has"
    if device.type != "cpu":
        return None, ""
    found = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = _cgroup_room()
    if limit is not None and (found is None or limit < found):
        return limit, "this container's memory limit leaves"
    return found, "the host has"


def _cgroup_room() -> int | None:
    """``memory.max − memory.current`` of this process's cgroup (v2), or None."""
    try:
        with open("/proc/self/cgroup") as handle:
            path = next((line.strip().split("::", 1)[1] for line in handle if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as handle:
            raw = handle.read().strip()
        if raw == "max":
            return None
        with open(os.path.join(base, "memory.current")) as handle:
            return int(raw) - int(handle.read().strip())
    except (OSError, ValueError, IndexError):
        return None


def check_memory(spec, prediction: Prediction, device: torch.device, available: int | None = None,
                 where: str = "") -> None:
    """Refuse (exit 83) when the predicted peak is more than ``device`` has free, or than
    ``memory.device_limit_gib`` lets the allocator reserve (that cap is checked even where the
    device itself is not here)."""
    if available is None:
        available, where = available_memory(device)
    limit_gib = spec.memory.device_limit_gib if device.type == "cuda" else 0
    if limit_gib and (available is None or limit_gib * GiB < available):
        available, where = int(limit_gib * GiB), f"memory.device_limit_gib = {limit_gib:g} allows"
    if available is None or prediction.peak <= available:
        return
    biggest = max(prediction.parts, key=prediction.parts.get)
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in prediction.parts.items() if v)
    raise PreflightRefused(
        f"data.max_seq_len = {spec.data.max_seq_len}: {prediction.tokens} need at least "
        f"{prediction.peak / GiB:.2f} GiB at the peak ({parts} GiB; the largest: {biggest}; pgs profile), but "
        f"{where} {available / GiB:.2f} GiB free on {device.type} ({(prediction.peak - available) / GiB:.2f} GiB "
        f"short); lower data.max_seq_len or the micro-batch "
        f"(train.batch_size / train.grad_accum), or set memory.activation_checkpointing"
        + (f"; the {', '.join(eight)} run{'s' if len(eight) == 1 else ''} 8 rows of data.max_seq_len a forward"
           if (eight := [k for k in ("scoring pass", "evaluation") if prediction.parts.get(k)]) else ""))


def check_pinned(prediction: Prediction, device: torch.device, available: int | None = None,
                 where: str = "") -> None:
    """Refuse (exit 83) a GPU run whose page-locked host memory (the optimizer state of
    ``memory.offload_optimizer``, the inputs of ``memory.offload_checkpoints``) is more than the
    host has free: page-locked memory cannot be swapped, so such a run would be killed by the
    kernel part-way rather than slow down.  (On the CPU the state is part of the peak; a GPU spec
    validated on a host without its GPU is not checked against this host's memory.)"""
    if device.type != "cuda" or not prediction.host:
        return
    if available is None:
        if not torch.cuda.is_available():
            return
        available, where = available_memory(torch.device("cpu"))
    if available is None or prediction.host <= available:
        return
    memory = prediction.memory
    parts = ", ".join(f"{what} {memory.get(key, 0) / GiB:.2f}" for what, key in
                      (("optimizer state", "host_state"), ("checkpointed inputs", "host_inputs"))
                      if memory.get(key))
    raise PreflightRefused(
        f"memory.offload_optimizer: the run keeps {prediction.host / GiB:.2f} GiB in page-locked host memory "
        f"({parts or 'state and inputs'} GiB; pgs profile), but {where} {available / GiB:.2f} GiB free, "
        f"{(prediction.host - available) / GiB:.2f} GiB short; free host memory, or keep less there "
        f"(memory.offload_checkpoints = false, or the state on the device)")


def check_snapshot(prediction: Prediction, device: torch.device, available: int | None = None,
                   where: str = "") -> None:
    """Refuse (exit 83) ``checkpoint.background`` when the host cannot hold one checkpoint's
    snapshot beside the run's other host memory (on the CPU: beside the run's peak)."""
    if available is None:
        available, where = available_memory(torch.device("cpu"))
    need = prediction.checkpoint + prediction.host + (prediction.peak if device.type == "cpu" else 0)
    if available is None or need <= available:
        return
    raise PreflightRefused(
        f"checkpoint.background: a save's host snapshot takes {prediction.checkpoint / GiB:.2f} GiB (one "
        f"checkpoint's weights + optimizer state), {need / GiB:.2f} GiB with the rest the run keeps on the host, "
        f"but {where} {available / GiB:.2f} GiB free; set checkpoint.background = false")


def check_disk(run_dir: str, checkpoint_bytes: int, copies: float = DISK_COPIES) -> None:
    """Refuse (exit 83) when ``run_dir`` could not be written or has too little free disk for
    ``copies`` checkpoints of ``checkpoint_bytes``.  Creates nothing: a folder that does not
    exist yet is judged by the nearest existing folder above it."""
    path = os.path.abspath(run_dir)
    while not os.path.exists(path):
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    if not os.access(path, os.W_OK | os.X_OK):
        what = "is not writable" if path == os.path.abspath(run_dir) else f"cannot be created ({path} is not writable)"
        raise PreflightRefused(f"checkpoint.dir: {run_dir!r} {what}")
    free = shutil.disk_usage(path).free
    need = int(copies * checkpoint_bytes)
    if free < need:
        raise PreflightRefused(
            f"checkpoint.dir: {run_dir!r} has {free / GiB:.2f} GiB free; checkpoints need about "
            f"{need / GiB:.2f} GiB ({copies:g} × {checkpoint_bytes / GiB:.2f} GiB of weights + optimizer state), "
            f"{(need - free) / GiB:.2f} GiB short")


def check_host(spec, processes: int | None = None) -> Prediction | None:
    """Memory and disk for ``spec`` on this host (see the module docstring); refuses with exit 83.

    ``processes``: how many processes will train (``pgs run``: 1, or ``--nproc``/``WORLD_SIZE``);
    None (``pgs validate``): unknown, taken as 1 unless several CUDA devices are visible (the
    spec may be meant for ``--nproc``).  Memory is checked for one process only (with several,
    the prediction shards the optimizer state only: ``predict_memory``'s ``ranks``).  Returns the
    prediction, one process's share where several are known (None where the architecture cannot
    be sized on the meta device)."""
    device = auto_device(spec.train.device)
    if processes is None:
        processes = process.launch_world_size()
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 1:
            processes = 0  # validate on a multi-GPU host: the run's process count is not known here
    try:  # one process's share where several are known (its shards' optimizer state: profile.predict)
        prediction = predict(spec, device, ranks=max(1, processes))
    except Exception:  # an architecture the meta device cannot build: the run will say more
        return None
    if processes == 1:
        check_memory(spec, prediction, device)
        check_pinned(prediction, device)
        if spec.checkpoint.background:
            check_snapshot(prediction, device)
    check_disk(spec.checkpoint.dir, prediction.checkpoint, disk_copies(spec.checkpoint, spec.checkpoint.dir))
    return prediction
