"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and the gathered HF export.

A distributed checkpoint is ``<run_dir>/step_<N>/``::

    __<rank>_0.distcp     each rank's shards of the weights and of the chain state (DCP)
    .metadata             DCP's index of every tensor (global shapes, who holds what)
    dcp.json              world size, which state keys are per rank, the services' entries
    trainer.json          counters and data-stream position (rank 0)
    spec.resolved.toml    the spec of the run (rank 0)
    COMPLETE              manifest (size + digest of every file above), written last

It has the same life as a single-process checkpoint (``pgs.runtime.store.checkpoint``): written
into ``.step_<N>.tmp-<pid>`` (rank 0's pid), fsynced, renamed, and valid only when its
``COMPLETE`` manifest matches (``checkpoint.problem`` / ``latest`` / ``purge`` work on it
unchanged).  Every rank calls :func:`save` and :func:`load` at the same point: both are
collectives, and no rank returns before the folder is published (no rank-dependent early
return around a save).

What is saved: the model state (``get_model_state_dict``: DTensor shards) and the chain
state (``Optimizer.dcp_state``: leaves that mirror a parameter are
DTensors of its placement, scalars are replicated, anything else — 8-bit codes of a shard —
is per rank), each rank's RNG states, and the state of the loop's services (``services``:
one entry per ``Service.state_name``, e.g. the weight EMA as DTensors of the parameters'
placements; their names are listed in ``dcp.json``).

Resuming on the same world size restores every bit.  Resuming on another world size:
start the new run with the new ``--nproc`` and resume from the folder; DCP reshards every
DTensor by its global shape (weights and every parameter-shaped moment), replicated scalars
load everywhere; RNG streams are not restored (they are per rank), and a checkpoint with
per-rank state leaves (block-wise 8-bit moments) refuses, naming the key.  A single
process without a process group can load a sharded checkpoint the same way
(:func:`load` with a plain model and a ``BoundOptimizer`` bound without ``compile``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist

from pgs.runtime.dist.fsdp import broadcast_object as _broadcast
from pgs.runtime.process import collective_device
from pgs.runtime.store import checkpoint as ckpt
from pgs.runtime.store.checkpoint import CheckpointError
from pgs.runtime.store.export import export_hf as write_hf

DCP_INFO = "dcp.json"
DCP_FORMAT = "pgs-dcp-1"
METADATA = ".metadata"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _model_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _rng_key(rank: int) -> str:
    return f"rank{rank}"


def save(run_dir: str, step: int, *, model, optimizer, trainer: dict[str, Any], spec_toml: str | None = None,
         generators: Mapping[str, torch.Generator] | None = None,
         services: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> str:
    """Write ``<run_dir>/step_<step>`` as a DCP checkpoint on every rank; returns its path.

    Collective: every rank calls it with the same ``step``; it returns (on every rank) only
    after rank 0 has published the folder.  ``trainer``: JSON-able counters (rank 0's are
    written).  ``services``: the loop's services' state by name (``Service.state_dict``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    final, tmp, state, need, per_rank, per_rank_any = _prepare(run_dir, step, model, optimizer, generators,
                                                               services)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except BaseException as err:  # DCP's CheckpointException (a BaseException) carries every rank's failure
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or not ckpt.is_disk_full(err):
            raise
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ckpt.disk_full_error(final, need, err=err) from None
    failure, full = None, False
    if _rank() == 0:
        try:
            _publish(tmp, final, step, trainer, spec_toml, per_rank_any, per_rank, sorted(services or {}))
        except Exception as err:  # every rank must hear of it, not wait in a barrier
            failure = f"{type(err).__name__}: {_first_line(err)}"
            full = ckpt.is_disk_full(err)
            if full:
                shutil.rmtree(tmp, ignore_errors=True)
    failure, full = _broadcast((failure, full))
    if full:
        raise ckpt.disk_full_error(final, need)
    if failure is not None:
        raise CheckpointError(f"writing {final} failed on rank 0: {failure}")
    return final


def _prepare(run_dir: str, step: int, model, optimizer, generators,
             services=None) -> tuple[str, str, dict, int, list[str], bool]:
    """Collective: the folder (rank 0 makes its temporary, every rank waits for it) and this
    rank's state; ``(final, tmp, state, need, per_rank, per_rank_any)``: ``need`` the global bytes
    of weights + state, ``per_rank`` this rank's per-rank state keys, ``per_rank_any`` whether
    any rank has some (``dcp.json``)."""
    final = os.path.join(run_dir, f"step_{step}")
    tmp = os.path.join(run_dir, f".step_{step}.tmp-{_broadcast(os.getpid())}")
    if _rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    opt_state = optimizer.dcp_state()
    state = {
        "model": _model_state(model),
        "optim": opt_state,
        "rng": {_rng_key(_rank()): ckpt.capture_rng(generators=generators)},
    }
    if services:
        state["services"] = {name: dict(tensors) for name, tensors in services.items()}
    need = ckpt.tensor_bytes(state["model"]) + ckpt.tensor_bytes(opt_state)  # global sizes (DTensors)
    for tensors in (services or {}).values():
        need += ckpt.tensor_bytes(dict(tensors))
    per_rank = sorted(k for k in opt_state if k.startswith("__rank"))
    return final, tmp, state, need, per_rank, _broadcast_any(bool(per_rank))


def save_async(run_dir: str, step: int, *, model, optimizer, trainer: dict[str, Any], spec_toml: str | None,
               generators: Mapping[str, torch.Generator] | None, group, writer=None,
               services: Mapping[str, Mapping[str, torch.Tensor]] | None = None):
    """:func:`save` with the writing left to a thread (``[checkpoint] background``).

    Collective, on the training thread: the folder is made, this rank's state copied to host
    memory (DCP's staging, ``torch.distributed.checkpoint.async_save``) and the write started,
    its collectives on ``group`` (a gloo group: the training's own group stays the training's).
    Returns ``(job, final, need, writer)``: ``job()``, run on a thread, waits for DCP's write
    and on rank 0 then writes the small files and the manifest and renames the folder (as
    :func:`save`); it returns the folder or raises (``DiskFull`` for a full disk, removing the
    temporary folder on rank 0).  ``writer``: the storage writer of the save before (its
    staging buffers are reused; the returned one is to be passed to the next save)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    final, tmp, state, need, per_rank, per_rank_any = _prepare(run_dir, step, model, optimizer, generators,
                                                               services)
    names = sorted(services or {})
    # staging buffers kept between saves are page-locked (DCP's cache), so only with CUDA
    writer = writer or FileSystemWriter(tmp, sync_files=True, cache_staged_state_dict=torch.cuda.is_available())
    response = dcp.async_save(state, checkpoint_id=tmp, storage_writer=writer, process_group=group)
    upload = getattr(response, "upload_completion", response)  # a Future, or a response holding one
    rank = _rank()

    def job() -> str:
        try:
            upload.result()
            if rank == 0:
                _publish(tmp, final, step, trainer, spec_toml, per_rank_any, per_rank, names)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            if not ckpt.is_disk_full(err):
                raise CheckpointError(f"writing {final} failed on rank {rank}: {type(err).__name__}: "
                                      f"{_first_line(err)}") from err
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt.disk_full_error(final, need, err=err) from None
        return final

    return job, final, need, writer


def _publish(tmp: str, final: str, step: int, trainer: dict, spec_toml: str | None, per_rank_any: bool,
             per_rank: list[str], services: list[str] = ()) -> None:
    """Rank 0: the small files, the manifest, the rename."""
    info = {"format": DCP_FORMAT, "step": step, "world_size": _world(), "per_rank_state": per_rank_any,
            "per_rank_example": per_rank[0] if per_rank else None, "services": list(services)}
    _write_json(os.path.join(tmp, DCP_INFO), info)
    _write_json(os.path.join(tmp, ckpt.TRAINER_FILE), {"format": ckpt.FORMAT_VERSION, "step": step, **trainer})
    files = [DCP_INFO, ckpt.TRAINER_FILE]
    if spec_toml is not None:
        with open(os.path.join(tmp, ckpt.SPEC_FILE), "w", encoding="utf-8") as handle:
            handle.write(spec_toml)
        files.append(ckpt.SPEC_FILE)
    files += sorted(n for n in os.listdir(tmp) if n.endswith(".distcp") or n == METADATA)
    ckpt.write_manifest(tmp, step, files)
    ckpt.publish(tmp, final)


def _broadcast_any(flag: bool) -> bool:
    if not _dist():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")


def is_dcp(folder: str) -> bool:
    """True for a folder written by :func:`save` (it has ``dcp.json``)."""
    return os.path.isfile(os.path.join(folder, DCP_INFO))


def info(folder: str) -> dict:
    """``dcp.json`` of a checkpoint folder (world size, per-rank state)."""
    with open(os.path.join(folder, DCP_INFO), encoding="utf-8") as handle:
        return json.load(handle)


def problem(folder: str, *, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a complete DCP checkpoint, or None (run by rank 0, then shared)."""
    why = ckpt.problem(folder, hashes=hashes)
    if why is None and not is_dcp(folder):
        why = f"no {DCP_INFO} (not a sharded checkpoint)"
    if why is None and not os.path.isfile(os.path.join(folder, METADATA)):
        why = f"no {METADATA} (DCP did not finish)"
    return why


def latest(run_dir: str) -> str | None:
    """The newest complete DCP step folder, decided by rank 0 and the same on every rank."""
    found = None
    if _rank() == 0:
        for _step, path in ckpt.step_folders(run_dir):
            why = problem(path)
            if why is None:
                found = path
                break
            print(f"pgs: skipping checkpoint {path}: {why}", flush=True)
    return _broadcast(found)


def load(folder: str, *, model, optimizer, generators: Mapping[str, torch.Generator] | None = None,
         services: dict[str, dict[str, torch.Tensor] | None] | None = None, rng: bool = True) -> dict[str, Any]:
    """Restore weights, chain state and (same world size) RNG from ``folder``; returns trainer.json.

    Collective.  Verifies the folder first (rank 0; all ranks raise together).  See the
    module docstring for another world size.  ``services``: name -> the tensors a service's
    ``state_dict`` returns now (their shapes and placements say what to read); each is loaded
    in place and left in the dict, or replaced by None where the checkpoint holds no entry of
    that name.  ``rng=False``: the RNG states are left as they are (an mSFT revert).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    why = _broadcast(problem(folder) if _rank() == 0 else None)
    if why is not None:
        raise CheckpointError(f"{folder}: not a complete checkpoint: {why}")
    meta = info(folder)
    same_world = int(meta["world_size"]) == _world()
    if meta.get("per_rank_state") and not same_world:
        raise CheckpointError(
            f"{folder}: written by {meta['world_size']} ranks with per-rank optimizer state "
            f"({meta.get('per_rank_example')!r}: block-wise 8-bit state of a shard cannot be resharded); "
            f"resume with --nproc {meta['world_size']}")
    state = {"model": _model_state(model), "optim": optimizer.dcp_state()}
    rng = rng and same_world
    if rng:
        state["rng"] = {_rng_key(_rank()): ckpt.capture_rng(generators=generators)}
    saved = set(meta.get("services") or ())
    for name in list(services or {}):
        if name not in saved:
            services[name] = None
    wanted = {name: tensors for name, tensors in (services or {}).items() if tensors is not None}
    if wanted:
        state["services"] = wanted
    try:
        with warnings.catch_warnings():  # one process loading a sharded checkpoint is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=not _dist())
    except Exception as err:  # DCP raises a CheckpointException carrying every rank's failure
        raise CheckpointError(f"{folder}: cannot load into this model/optimizer: {_first_line(err)}") from err
    set_model_state_dict(model, state["model"])
    optimizer.load_dcp_state(state["optim"])
    for name in wanted:  # DCP loads DTensors in place, and may replace a plain tensor in the dict
        services[name] = state["services"][name]
    if rng:
        ckpt.restore_rng(state["rng"][_rng_key(_rank())], generators=generators)
    with open(os.path.join(folder, ckpt.TRAINER_FILE), encoding="utf-8") as handle:
        return json.load(handle)


def _first_line(err: BaseException, limit: int = 400) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:limit]


# ----------------------------------------------------------------------------------------
# the HF export


class _Gathered:
    """What ``export.export_hf`` reads from a model, backed by a gathered state dict."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors
        self.config = model.config
        self.pgs_composite = getattr(model, "pgs_composite", None)  # a vision-language checkpoint's shape
        self.pgs_model = model  # whose weight conversions the export reverts (export.saved_names)
        self.generation_config = getattr(model, "generation_config", None)

    def state_dict(self, keep_vars: bool = False):
        return self._tensors


def _tied_output_key(model) -> str | None:
    """The state-dict key of the output head when the config ties it to the input embeddings."""
    config = getattr(model.config, "text_config", None) or model.config
    if not getattr(config, "tie_word_embeddings", False):
        return None
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is head:
            return f"{name}.weight" if name else "weight"
    return None


def gathered_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (unsharded) state on rank 0, on the CPU; empty on other ranks.  Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_hf(model, tokenizer, out_dir: str, *, info: dict | None = None, max_shard_size="5GB") -> str:
    """Gather the weights to rank 0 and write a HF folder there (``export.export_hf``).

    Collective: every rank calls it; rank 0 writes; every rank returns after the folder is
    published.  A tied output head is written once (transformers re-ties it from the config).
    """

    tensors = gathered_state_dict(model)
    failure = None
    if _rank() == 0:
        try:
            tied = _tied_output_key(model)
            if tied is not None and len(tensors) > 1:
                tensors.pop(tied, None)
            write_hf(_Gathered(model, tensors), tokenizer, out_dir, info=info, max_shard_size=max_shard_size)
        except Exception as err:
            failure = f"{type(err).__name__}: {_first_line(err)}"
    failure = _broadcast(failure)
    if failure is not None:
        raise CheckpointError(f"export to {out_dir} failed on rank 0: {failure}")
    return out_dir
