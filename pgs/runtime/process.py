"""This process: its place among the ranks of a launch, and the environment it was started with.

The one module of ``pgs.runtime`` that reads ``os.environ`` (docs/architecture.md, *Layers*):
the launcher's process layout (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and the few named
variables other modules ask for through :func:`variable`.  It also holds the two process-group
helpers that layers below ``pgs.runtime.dist`` need (a sum over the ranks for the MoE router's
statistics and the loss sums): it imports nothing of pgs, so any runtime module may use it.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class Layout:
    """Where a launcher (torchrun) put this process: ``rank`` of ``world_size``, on the node's
    device ``local_rank``.  One process without a launcher: ``Layout(0, 1, 0)``."""

    rank: int
    world_size: int
    local_rank: int


def layout() -> Layout:
    """The launcher's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (default: the rank)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Layout(rank, world, int(os.environ.get("LOCAL_RANK", str(rank))))


def launched() -> bool:
    """True when a launcher (torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_world_size() -> int:
    """The number of processes a launcher started (``$WORLD_SIZE``), else 1; an unreadable
    value counts as 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


def variable(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, or ``default``."""
    return os.environ.get(name, default)


def environment() -> Mapping[str, str]:
    """The whole environment (read-only use: what a child process inherits)."""
    return os.environ


def set_variables(entries: Mapping[str, str]) -> None:
    """Set environment variables of this process (read by libraries started after)."""
    os.environ.update(entries)


def set_default(name: str, value: str) -> None:
    """Set ``name`` unless the environment already has it."""
    os.environ.setdefault(name, value)


def available_cpus() -> int:
    """The CPUs this process may use: those of its affinity mask (``taskset``, a scheduler's
    cpuset), fewer where its control group caps its CPU time (``docker --cpus``, Kubernetes
    limits: cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period this process's control group may use; None: no cap."""
    v2 = _read("/sys/fs/cgroup/cpu.max")  # "<quota> <period>", or "max <period>"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        return int(quota) / int(period) if int(quota) > 0 else None
    except (TypeError, ValueError):  # "max", a missing file, something unreadable: no cap known
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def fit_cpu_threads() -> int:
    """Use no more intra-op threads than :func:`available_cpus` (torch counts the host's cores,
    also where a container may use only a part of them); returns the number in use.  Never
    raises a number set lower (``OMP_NUM_THREADS``, ``torch.set_num_threads``, torchrun's one
    thread per worker)."""
    threads = min(torch.get_num_threads(), available_cpus())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def is_distributed() -> bool:
    """A process group of more than one rank is open."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's CUDA device
    under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks (a new tensor on ``x``'s device; ``x`` itself on one process)."""
    if not is_distributed():
        return x
    y = x.detach().to(collective_device(), copy=True)
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y.to(x.device)
