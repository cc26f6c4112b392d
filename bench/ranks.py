"""What the bench's multi-process measurements share: a worker script under torchrun whose
rank 0 writes one JSON result, every rank's peak device memory, and the scaling efficiency
of a call's world sizes against its one-process row.

Used by ``bench/fsdp_step.py`` (its hand-wired FSDP2 step) and ``bench/product.py``
(``--nproc``: ``pgs run --nproc N`` beside the torchtitan-style peer, ``bench/titan_fsdp.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: seconds a launcher has, after SIGTERM at its timeout, to stop its workers before SIGKILL
STOP_GRACE_S = 60


def run_bounded(cmd: list[str], timeout: float | None, *, env: dict | None = None,
                grace: float = STOP_GRACE_S) -> tuple[subprocess.CompletedProcess, bool]:
    """``cmd`` with its output captured, and whether it ran past ``timeout``.  At the timeout it
    gets SIGTERM, then SIGKILL after ``grace`` more seconds (0: at once).  A torchrun or
    ``pgs run --nproc`` launcher needs the grace: torchrun starts each worker in a session of its
    own, so killing the launcher would leave them running (holding their GPUs), while SIGTERM is
    forwarded (the workers stop; a ``pgs run`` worker checkpoints first).  One process needs
    none: the kill ends it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=grace) if grace > 0 else (None, None)
        except subprocess.TimeoutExpired:
            out, err = None, None
        if out is None:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), True


def torchrun_json(script: str, nproc: int, args: list[str], *, timeout: float | None = None,
                  env: dict | None = None) -> dict:
    """Run ``script`` on ``nproc`` local workers (``torch.distributed.run --standalone``) with
    ``args + ["--worker-out", PATH]``; rank 0 writes its result to PATH.  Returns that result,
    or ``{"world_size": nproc, "error": ...}`` with the output's tail when the launch failed."""
    with tempfile.TemporaryDirectory(prefix="pgs-ranks-") as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script] + list(args) + ["--worker-out", path]
        proc, timed_out = run_bounded(cmd, timeout, env=env)
        if timed_out:
            return {"world_size": nproc, "error": (proc.stderr or "")[-2000:] + f"\nstopped after {timeout} s"}
        if proc.returncode != 0 or not os.path.exists(path):
            return {"world_size": nproc, "error": f"exit {proc.returncode}\n" + (proc.stderr or proc.stdout)[-3000:]}
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)


def peaks_per_rank(device) -> dict:
    """Every rank's peak allocated and reserved device memory, GiB, rank by rank (a collective:
    call it on every rank); ``None`` entries off CUDA."""
    import torch

    from pgs.runtime.dist.fsdp import gather_object

    mine = ((torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30)
            if device.type == "cuda" else (None, None))
    every = gather_object(mine)
    return {"max_allocated_gib_per_rank": [a for a, _ in every], "max_reserved_gib_per_rank": [r for _, r in every]}


def add_scaling(rows: list[dict], per_gpu_key: str) -> None:
    """Set each row's ``scaling_efficiency``: its ``per_gpu_key`` (tokens/s per GPU) over that of
    the row of world size 1 among ``rows`` (the same call, the same setup); none without one."""
    base = next((r for r in rows if r.get("world_size") == 1 and r.get(per_gpu_key)), None)
    for r in rows:
        if base is not None and r.get(per_gpu_key):
            r["scaling_efficiency"] = r[per_gpu_key] / base[per_gpu_key]
