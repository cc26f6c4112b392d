"""The training loop behind ``pgs run spec.toml``.

Read top to bottom: :func:`run` sets a run up (:func:`setup`), optionally restores a
checkpoint, then repeats :func:`train_step` until ``train.steps``.  Everything with state of
its own lives in a component module: the model (``model``), the optimizer
(``bind``), the data (``data``), checkpoints (``checkpoint``), stops, skips and halts
(``control``), metrics (``metrics``) and the HF export (``export``).  What is trained is the
run's *objective* (``objective.py``: SFT's token loss, ``[preference]``'s pair loss, ...): its
data stream, micro-batch loss, loss denominator, metrics, eval and checkpoint state; this
module names no objective.

Gradient accumulation divides every micro-batch's summed loss by the objective's count for
the *whole* optimizer step (valid tokens for SFT, pairs for preference; known before any
forward), so the step's gradient is the gradient of one mean over all its micro-batches, and
a micro-batch with nothing to train adds 0, not 0/0.

Memory (``[memory]``, docs/memory.md): Liger kernels, activation checkpointing and
per-layer ``torch.compile`` are applied to the model in :func:`setup`; with
``gradient_release`` the chain is bound by ``GradientRelease`` (with several processes
``ShardedGradientRelease``, one FSDP unit after its reduce-scatter) and runs inside backward, so a
step's loss is computed and its finiteness agreed on *before* backward, and a non-finite
step never calls backward (no state changes).

Several processes (``WORLD_SIZE > 1``, started by torchrun or ``pgs run --nproc N``,
docs/distributed.md): the model is sharded with FSDP2, the chain is bound to the shards,
each rank reads its share of the global batch, the loss divides by the global valid-token
count, checkpoints are DCP folders written by every rank, and only rank 0 logs.

Tests inject faults (NaN losses, a SIGKILL mid-checkpoint or after a step, slow steps) with a
``Faults`` object (pgs/runtime/loop/faults.py) passed to ``setup`` / ``run``.
"""

from __future__ import annotations

import gc
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from pgs.errors import DiskFull, EXIT_OK, EXIT_WALL_BUDGET, HaltError, PreflightRefused, SpecError
from pgs.runtime.common import run_device
from pgs.runtime.data import require_packing_isolation
from pgs.runtime.data.loader import StepLoader
from pgs.runtime.dist import context as CP, fsdp as D
from pgs.runtime.loop import control, trackers
from pgs.runtime.loop.averaging import WeightAverager
from pgs.runtime.loop.samples import EvalSamples
from pgs.runtime.loop.checkpointer import (Checkpointer, export as _export, save, save_in_background,  # noqa: F401
                                           snapshot_groups, stateful)
from pgs.runtime.loop.evaluator import Evaluator, evaluate  # noqa: F401
from pgs.runtime.loop.faults import Faults, NO_FAULTS
from pgs.runtime.loop.health import HealthMonitor
from pgs.runtime.loop.metrics import MetricsLog, console_keys
from pgs.runtime.loop.msft import Msft
from pgs.runtime.loop.objective import build_objective, objective_class
from pgs.runtime.loop.resume import check_resume
from pgs.runtime.loop.run import Run
from pgs.runtime.loop.services import Service, after_step, before_step, build_services
from pgs.runtime.loop.trace import Profiler
from pgs.runtime.model import layers
from pgs.runtime.model.build import build_model, freeze, parameter_bytes
from pgs.runtime.model.moe import router_tap
from pgs.runtime.model.tiled_mlp import apply_mlp_tiles
from pgs.runtime import process
from pgs.runtime.optim import StepMetrics, make_optimizer
from pgs.runtime.optim.memory import MemorySetup
from pgs.runtime.spec.chain import WHOLE_ROW_OBJECTIVES, build_chain
from pgs.runtime.spec.load import check_world_size
from pgs.runtime.spec.preflight import preflight_spec
from pgs.runtime.store import checkpoint as ckpt, dcp, lock as run_lock
from pgs.runtime.tools.resources import disk_copies

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _NullLog:
    """What ranks other than 0 log to: nothing (rank 0 writes metrics, console and events)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def is_main(run: Run) -> bool:
    return run.ctx is None or run.ctx.is_main


def apply_memory(model, memory, fast_recompute: bool = True) -> None:
    """Selective differentiation (``layers.skip_frozen_prefix``), Liger kernels, activation
    checkpointing and per-layer compile from ``[memory]``, in place.
    ``fast_recompute=False``: checkpoint through ``torch.utils.checkpoint`` only (a router loss
    needs the forward's graph, which the fast recompute does not build)."""

    setup = MemorySetup.of(memory)
    layers.skip_frozen_prefix(model)  # frozen layers with nothing trainable below: no backward
    if setup.liger:
        layers.apply_liger(model)
    if setup.mlp_tiles > 1:
        apply_mlp_tiles(model, setup.mlp_tiles)
    if setup.activation_checkpointing != "none":
        layers.apply_activation_checkpointing(model, setup.activation_checkpointing, setup.checkpoint_every,
                                              offload=setup.checkpoint_offload, fast_recompute=fast_recompute)
    if setup.compile_layers:
        layers.compile_layers(model)


def configure_allocator(device: torch.device, limit_gib: float = 0.0) -> None:
    """CUDA's caching allocator for a training run.

    Expandable segments, unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise: variable-length
    packed batches, recomputed layers and the chunked loss allocate blocks of ever-changing
    sizes; with fixed segments the allocator keeps reserving new ones that the freed blocks
    cannot be split to fit (docs/performance.md has a packed run's figures), and with
    expandable segments one mapping per stream grows and shrinks instead, so reserved stays
    next to allocated (docs/memory.md, "Allocator").

    ``limit_gib`` (``memory.device_limit_gib``; 0: none) caps the allocator's reserved bytes
    (``torch.cuda.set_per_process_memory_fraction``): a request that would pass the cap first
    has the cached free blocks returned to the driver and is retried, so a recipe meant for a
    smaller card reserves no more than that card holds even on a larger one, where nothing
    else would make the allocator give cached blocks back.  A garbage-collection threshold
    (0.9 of the cap, unless the environment sets the allocator) returns unused cached blocks
    before the cap is reached, so the retry path (which synchronizes the device) stays rare.
    """
    if device.type != "cuda":
        if limit_gib:  # a setting that would do nothing is refused, not ignored
            raise SpecError(f"memory.device_limit_gib: {limit_gib:g} caps CUDA's caching allocator, and this run "
                            f"trains on {device.type} (set it to 0, or train.device = \"cuda\")")
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if limit_gib and limit_gib * 2**30 > total:
        raise SpecError(f"memory.device_limit_gib: {limit_gib:g} GiB is more than the device's "
                        f"{total / 2**30:.1f} GiB ({torch.cuda.get_device_name(index)})")
    if not process.variable("PYTORCH_CUDA_ALLOC_CONF"):
        # the accelerator-wide setter where torch has it (the CUDA one warns that it is deprecated)
        setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                  or torch.cuda.memory._set_allocator_settings)
        setter("expandable_segments:True" + (",garbage_collection_threshold:0.9" if limit_gib else ""))
    if limit_gib:
        torch.cuda.set_per_process_memory_fraction(limit_gib * 2**30 / total, index)


def _process_layout(spec, ctx: D.DistContext | None, world: int):
    """What several processes need of the spec, checked; this rank's part of each row with
    ``[parallel] context > 1`` (ring attention, dist/context.py: the rest is data parallel), else None.
    ``ctx``: the distributed context of a sharded run (None: one process)."""
    cp = spec.parallel.context
    if cp > 1:
        chosen = objective_class(spec)
        if not chosen.splits_rows:
            raise SpecError(f"parallel.context: a [{chosen.section}] run needs whole sequences on each rank: "
                            f"{chosen.whole_rows_reason} (set parallel.context = 1)")
        if spec.loss.embedding_noise() is not None:
            raise SpecError("parallel.context: not with embedding noise (loss.neftune_alpha, loss.symnoise_alpha: "
                            "they read whole rows)")
        if spec.loss.objective in WHOLE_ROW_OBJECTIVES:
            raise SpecError(f"parallel.context: loss.objective {spec.loss.objective!r} reads statistics over the whole "
                            "row or sample, which one rank's part of a row does not see (set parallel.context = 1)")
        if ctx is None:
            raise SpecError(f"parallel.context: {cp} ranks per sequence need pgs run --nproc N (N a multiple of {cp})")
    if ctx is None:
        return None
    check_world_size(spec.train, world, cp)
    return CP.make_shard(ctx.rank, world, cp, spec.parallel.layout) if cp > 1 else None


def setup(spec, ctx: D.DistContext | None = None, faults: Faults = NO_FAULTS) -> Run:
    """Model, tokenizer, bound optimizer and data stream of a fresh run (nothing restored).

    ``ctx``: the distributed context (``distributed.init()``) when several processes train
    together; the model is then sharded (FSDP2) and the chain bound to the shards.  The
    objective (``objective.build_objective``: its data stream, a reference or teacher) is made
    from the model's initial weights, before ``[memory]`` and sharding change the model.
    """

    sharded = ctx is not None and ctx.distributed
    world = ctx.world_size if sharded else 1
    # pgs validate's checks of the model, lengths, run folder, and the memory and disk the run needs
    found = preflight_spec(spec, processes=world)
    tokenizer = found.tokenizer
    if found.tokenizer_note is not None and (not sharded or ctx.is_main):  # allowed by the spec, said once
        print(f"pgs: warning: {found.tokenizer_note}", file=sys.stderr, flush=True)
    mem = spec.memory
    cp = spec.parallel.context
    shard = _process_layout(spec, ctx if sharded else None, world)
    seed_everything(spec.train.seed)
    device = ctx.device if sharded else run_device(spec.train.device)
    configure_allocator(device, spec.memory.device_limit_gib)
    m = spec.model
    config = None
    if m.config is not None:
        config = {k: v for k, v in m.config.items() if not (k == "vocab_size" and not v)}
    # FSDP2 keeps fp32 sharded masters and computes in bf16 (mixed precision) for a bf16 model
    mixed = "bf16" if sharded and m.dtype == "bfloat16" else None
    dtype = "float32" if mixed else m.dtype
    attn = CP.register() if shard is not None else m.attn_implementation
    model = build_model(path=m.path, config=config, dtype=dtype, attn_implementation=attn,
                        varlen_kernel=m.varlen_kernel, experts_implementation=m.experts_implementation,
                        init_seed=m.init_seed, vocab_size=len(tokenizer), device=device,
                        trust_remote_code=m.trust_remote_code)
    if spec.data.packing:
        verdict = require_packing_isolation(model, spec.data.allow_packing_leakage)
        if not verdict.isolates and (not sharded or ctx.is_main):
            print(f"pgs: warning: {verdict.reason}; packed documents will see each other", file=sys.stderr)
    freeze(model, m.freeze if isinstance(m.freeze, str) else list(m.freeze))
    moe = router_tap(model, spec.moe)  # None for a dense model
    chosen = objective_class(spec)
    if moe is not None and moe.aux and not chosen.router_tap:  # its forward does not feed the tap
        raise SpecError(f"moe.load_balance / moe.router_z_loss: a [{chosen.section}] run takes no router loss "
                        "(set them to 0)")
    objective = build_objective(spec, model=model, tokenizer=tokenizer, device=device, ctx=ctx)
    apply_memory(model, mem, fast_recompute=not (moe is not None and moe.aux))
    per_epoch = None if spec.train.steps is not None else objective.steps_per_epoch(spec.train.batch_size)
    total = spec.total_steps(per_epoch)
    schedule = spec.schedule.build(total)  # the learning rate: the chain's, and the resume check's
    chain = build_chain(spec.optimizer, schedule)
    if sharded:
        D.shard_model(model, ctx.mesh, mixed_precision=mixed)
    bound = make_optimizer(chain, model, mem, sharded=sharded, grad_accum=spec.train.grad_accum,
                           compile=spec.optimizer.compile, jit=spec.optimizer.jit)
    micro_batch = spec.train.batch_size // (spec.train.grad_accum * (world // cp))
    loader = StepLoader(objective.stream, micro_batch, spec.train.grad_accum, device, ahead=objective.loader_ahead)
    return Run(
        spec=spec, run_dir=spec.checkpoint.dir, device=device, model=model, tokenizer=tokenizer, bound=bound,
        objective=objective, total_steps=total, micro_batch=micro_batch, loader=loader, schedule=schedule,
        skips=control.SkipCounter(spec.train.max_consecutive_skips, spec.train.max_skip_fraction),
        chain_has_norm=bound.metrics().grad_norm is not None,
        ctx=ctx if sharded else None, faults=faults, moe=moe, context=shard,
        health=HealthMonitor.from_spec(spec, model, total),
        averaging=WeightAverager.from_spec(spec, model, total),  # its base: the weights as built, before any restore
        msft=Msft.create(spec),
        samples=EvalSamples(spec) if spec.eval.samples else None,
    )


def restore(run: Run, folder: str) -> None:
    """Continue from a verified checkpoint folder: weights, chain state, RNG, data, counters.

    A DCP folder (several processes) is loaded by every rank through ``dcp.load``.  The
    services that keep state (``Service.state_name``: the weight EMA) get theirs back.
    """

    keeping = stateful(run)
    if run.ctx is not None or dcp.is_dcp(folder):
        entries = {s.state_name: s.state_dict(run) for s in keeping}
        t = dcp.load(folder, model=run.model, optimizer=run.bound, generators=run.objective.generators(),
                     services=entries)
        step = int(t["step"])
        for service in keeping:
            service.load_state_dict(run, entries[service.state_name], folder)
    else:
        saved = ckpt.load(folder)
        ckpt.load_model_state(run.model, saved.model, saved.trainer.get("aliases", {}))
        run.bound.load_state_dict(saved.optimizer)
        ckpt.restore_rng(saved.rng, generators=run.objective.generators())
        for service in keeping:
            service.load_state_dict(run, ckpt.load_extra(folder, f"{service.state_name}.safetensors"), folder)
        t, step = saved.trainer, saved.step
    if run.msft is not None and "msft" in t:  # the mix of the active sources, before its position
        run.msft.load_state_dict(run, t["msft"])
    run.loader.load_state_dict(t["data"])
    run.skips.load_state_dict(t["skips"])
    run.step = step
    run.trained_tokens = int(t["trained_tokens"])
    run.best, run.best_step = t["best"], t["best_step"]
    run.objective.load_state_dict(t.get("objective"))
    if t.get("health") and run.health is not None:
        run.health.load_state_dict(t["health"])


def _forward(run: Run, batch, poison: bool):
    """Forward of one micro-batch: the objective's (loss_sum tensor with its graph, detached sums)."""
    return run.objective.forward(run, batch, poison)


def _loss(run: Run, batch, count: int, poison: bool):
    """Forward + backward of one micro-batch; returns its detached loss sum and the objective's
    sums.  ``count``: the step's global loss denominator (``Objective.count`` summed)."""
    loss_sum, stats = _forward(run, batch, poison)
    (loss_sum / max(count, 1)).backward()
    return loss_sum.detach(), stats


class StepRecord:
    """A step's metrics whose numbers still live on the device (entropy, lr, ‖g‖, a loss that
    was not read for the control plane): they are stacked, copied to pinned host memory with
    ``non_blocking=True`` and an event recorded, so no host read stalls the queue.  The loop
    reads a record (:meth:`read`) one step later, when that copy is long done; reading it at
    once would drain the GPU's queue at the end of every step, leaving it idle while the host
    prepares and launches the next one."""

    def __init__(self, values: dict[str, Any], finish):
        self._finish = finish  # plain numbers -> the metrics.jsonl record
        self._host = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        self._keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
        self._buffer: torch.Tensor | None = None
        self._event = None
        self._record: dict | None = None
        if self._keys:
            stacked = torch.stack([values[k].detach().reshape(()).to(torch.float64) for k in self._keys])
            if stacked.device.type == "cuda":
                self._buffer = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                self._buffer.copy_(stacked, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._buffer = stacked

    def read(self) -> dict:
        """The record with plain numbers (waits for the copy only if it is still in flight)."""
        if self._record is None:
            if self._event is not None:
                self._event.synchronize()
            values = dict(self._host)
            if self._keys:
                values.update(zip(self._keys, self._buffer.tolist()))
            self._record = self._finish(values)
        return self._record

    def __getitem__(self, key: str):
        return self.read()[key]


def _micro_batches(run: Run, batches, n_mean: int, poison: bool) -> tuple[list, list, Any]:
    """Forward (and, unless the chain runs inside backward, backward) of every micro-batch:
    their detached loss sums, the objective's sums, and the graph of the last one whose backward
    waits for the agreement on finiteness (gradient release; else None)."""
    loss_parts, stat_parts = [], []
    pending = None
    for batch in batches:
        if run.bound.in_backward:  # the update runs inside backward: agree on the loss before it
            pending, e = _forward(run, batch, poison)
            loss = pending.detach()
        else:
            loss, e = _loss(run, batch, n_mean, poison)
        loss_parts.append(loss)
        stat_parts.append(e)
    return loss_parts, stat_parts, pending


def _update(run: Run, flags: list[int], pending, n_mean: int) -> tuple[StepMetrics, dict, Any]:
    """The optimizer's step on the agreed flags (none on a non-finite step): its metrics, the
    binder's extra host figures, and the measured gradient norm where the chain keeps none."""
    opt, extra_values, grad_norm = StepMetrics(), {}, None
    if flags[control.NONFINITE]:
        del pending  # no backward (release): the chain state and the weights stay as they were
        run.bound.zero_grad()
    elif run.bound.in_backward:
        (pending / max(n_mean, 1)).backward()  # every group steps inside this call
        run.bound.step()  # completes what backward started (groups that got no gradient)
        opt = run.bound.metrics(tensors=True)
        extra_values = dict(getattr(run.bound, "step_extras", None) or {})  # release/, offload/ host figures
    else:
        # The chain's clip keeps the pre-clip norm in its state; measure it only when it does not.
        grad_norm = None if run.chain_has_norm else run.bound.grad_norm()
        run.bound.step()
        run.bound.zero_grad()
        opt = run.bound.metrics()
        flags[control.SPIKE] = control.agree([0, 0, 0, int(opt.spike)])[control.SPIKE]
    return opt, extra_values, grad_norm


def train_step(run: Run, signals: control.StopSignals, wall: control.WallClock) -> tuple[StepRecord, list[int]]:
    """One optimizer step (or a skipped one); returns its metrics (read them with ``.read()``)
    and the agreed flags.

    With gradient release the step's one host read before backward is its loss, for the
    agreement on finiteness (``control.agree``) that decides whether backward runs at all;
    everything else that is logged is read a step later (:class:`StepRecord`)."""
    started = time.perf_counter()
    objective = run.objective
    batches, extra = objective.prepare(run, run.loader.next_step())
    if run.context is not None:  # this rank's part of every row (the counts below are then its own)
        batches = [CP.shard_batch(b, run.context) for b in batches]
    # the loss's denominator, on every rank before any forward: the objective's count (valid
    # tokens, pairs) of the whole step; valid tokens are counted for every objective
    n_valid, n_mean = D.global_counts(sum(b.num_trained_tokens for b in batches), objective.count(batches))
    poison = run.faults.poisons(run.step + 1, D.rank())
    if run.moe is not None and objective.router_tap:  # the objective's forward feeds the tap
        run.moe.begin_step(batches, run.device, n_valid)
    loss_parts, stat_parts, pending = _micro_batches(run, batches, n_mean, poison)
    loss_sum = float(sum(loss_parts))  # the control plane's read: every micro-batch's loss
    nonfinite = not math.isfinite(loss_sum) or n_valid == 0 or n_mean == 0
    save_flags = run.saver.flags() if run.saver is not None else (0, 0)  # a background save: running, failed
    flags = control.agree([signals.received, wall.spent(), nonfinite, 0, *save_flags])
    opt, extra_values, grad_norm = _update(run, flags, pending, n_mean)
    del pending
    if run.context is not None:
        CP.end_rows()
    skipped = bool(flags[control.NONFINITE] or flags[control.SPIKE])
    run.skips.record(skipped)
    run.step += 1
    run.trained_tokens += 0 if flags[control.NONFINITE] else n_valid
    tokens = sum(b.num_tokens for b in batches)
    stats = list(torch.stack(stat_parts).sum(0).unbind())  # the objective's sums, still on the device
    if run.ctx is not None:  # the logged loss, sums and throughput are the whole step's
        sums = process.all_reduce_sum(torch.tensor([loss_sum, *(float(v) for v in stats), float(tokens)],
                                             dtype=torch.float64))
        loss_sum, stats, tokens = float(sums[0]), [float(v) for v in sums[1:-1]], int(sums[-1])
    values = {"lr": opt.lr, "grad_norm": opt.grad_norm if opt.grad_norm is not None else grad_norm}
    values.update({f"stat{i}": v for i, v in enumerate(stats)})
    if run.moe is not None and objective.router_tap:
        values.update(run.moe.step_values())
    values.update(extra_values)
    values = {k: v for k, v in values.items() if v is not None}
    ended = time.perf_counter()
    # the step's period: from the end of the previous step's launches (or this step's start) to
    # the end of this one's; with the queue kept full this is the device's time per step
    elapsed = ended - (run.step_clock if run.step_clock is not None else started)
    run.step_clock = ended
    counts = dict(step=run.step, trained=run.trained_tokens, skipped_total=run.skips.skipped,
                  spike=int(bool(flags[control.SPIKE])), skipped=int(skipped), n_mean=n_mean, n_valid=n_valid,
                  tokens=tokens, loss_sum=loss_sum, elapsed=elapsed, n_stats=len(stats))
    return StepRecord(values, _finisher(objective, extra, counts, _memory_gib(run.device))), flags


def _finisher(objective, extra, c: dict, memory: dict):
    """The function that turns a step's values, once on the host, into its metrics.jsonl record."""
    stamp = round(time.time(), 3)

    def finish(v: dict) -> dict:
        measured = objective.step_metrics([v[f"stat{i}"] for i in range(c["n_stats"])], c["n_mean"], c["n_valid"],
                                          extra)
        elapsed, tokens = c["elapsed"], c["tokens"]
        return {
            "time": stamp,
            "step": c["step"],
            "loss": c["loss_sum"] / max(c["n_mean"], 1),
            **{k: v[k] for k in ("lr", "grad_norm") if k in v},
            **measured,
            "valid_tokens": c["n_valid"],
            "trained_tokens": c["trained"],
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_seconds": elapsed,
            **memory,
            "skipped": c["skipped"],
            "skipped_total": c["skipped_total"],
            "spike": c["spike"],
            **{k: x for k, x in v.items() if k.startswith(("moe/", "release/", "offload/"))},
        }

    return finish


def _memory_gib(device: torch.device) -> dict:
    """Peak allocated and reserved device memory of the run so far, GiB (host-side counters of
    the caching allocator: no sync).  Empty off CUDA."""
    if device.type != "cuda":
        return {}
    return {"mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def _final_memory(run: Run) -> dict:
    """The ``done`` record's peak memory: this rank's, and with several processes every rank's
    (``mem_gib_per_rank``, ``reserved_gib_per_rank``; a collective, which every rank reaches at
    the same step).  Empty off CUDA."""
    mine = _memory_gib(run.device)
    if run.ctx is None:
        return mine
    every = D.gather_object(mine)
    if not mine:
        return mine
    return {**mine, "mem_gib_per_rank": [m["mem_gib"] for m in every],
            "reserved_gib_per_rank": [m["reserved_gib"] for m in every]}


def run(spec, *, resume: str | None = None, spec_path: str | None = None,
        profile: tuple[int, int] | None = None, overwrite: bool = False, faults: Faults = NO_FAULTS) -> int:
    """Train ``spec`` to the end, or until a stop; returns the process exit code.

    The run folder has one writer: the process of rank 0 locks it for its life before anything
    there is read or written (``pgs.runtime.store.lock``); a folder a live run holds is refused
    (``RunInUse``, exit 2).
    """
    with run_lock.hold(spec.checkpoint.dir, main=process.layout().rank == 0) as folder_lock:
        return _run(spec, folder_lock, resume=resume, spec_path=spec_path, profile=profile,
                    overwrite=overwrite, faults=faults)


def _run(spec, folder_lock: run_lock.RunLock, *, resume: str | None = None, spec_path: str | None = None,
         profile: tuple[int, int] | None = None, overwrite: bool = False, faults: Faults = NO_FAULTS) -> int:
    """:func:`run` with the run folder locked (``folder_lock``).

    ``resume``: None (fresh), ``"auto"`` (newest complete checkpoint in ``checkpoint.dir``,
    fresh if none) or a checkpoint folder.  A fresh start (``resume`` None) refuses a run
    folder that already holds a run (``RunExists``, exit 2) unless ``overwrite``, which moves
    the old run aside to ``<dir>.old-<timestamp>``.  Exit codes: 0 done, 128+signum after a
    signal, 82 wall budget (both after a checkpoint), 81 skip cap and 80 tripwire (``HALT.json``), 83
    preflight, 84 disk full while writing a checkpoint.
    """
    if resume is None:  # before the process group: no rank has written anything yet
        if not overwrite:
            ckpt.refuse_existing_run(spec.checkpoint.dir)
        elif process.layout().rank == 0:
            aside = ckpt.move_aside(spec.checkpoint.dir)
            if aside is not None:
                folder_lock.relock()  # the lock moved with the old run: lock the fresh folder
                print(f"pgs: --overwrite: moved the previous run to {aside}", file=sys.stderr, flush=True)
    wall = control.WallClock(spec.train.max_wall_seconds or None)
    ctx = D.init(device=spec.train.device, trace_dir=spec.checkpoint.dir) if process.launched() else None
    together = False  # every rank reached the same exit (then they leave the group together)
    try:
        code = _train(spec, resume, wall, ctx, profile, faults)
        together = True
        return code
    except (HaltError, PreflightRefused) as err:
        # a halt reports what the run did; a refusal is an error like any other (one line)
        print(f"pgs: {'error: ' if isinstance(err, PreflightRefused) else ''}{err}", file=sys.stderr, flush=True)
        together = isinstance(err, HaltError)  # halts are decided on agreed flags
        return err.exit_code
    except DiskFull as err:
        if ctx is None or ctx.is_main:
            print(f"pgs: error: {err}", file=sys.stderr, flush=True)
        together = ctx is not None  # every rank raises it together (dcp.save agrees on it)
        return err.exit_code
    finally:
        if ctx is not None and ctx.distributed:
            if together:
                D.barrier()
            D.shutdown()


def _resolve(r: Run, resume: str | None) -> str | None:
    if r.ctx is None or resume is None:
        return ckpt.resolve(r.run_dir, resume)

    return dcp.latest(r.run_dir) if resume == "auto" else resume  # dcp.load verifies it


def freeze_gc() -> None:
    """After the first step: collect once, then move every live object (model, compiled code,
    caches) to the garbage collector's permanent generation.  Python's full collections then
    walk only what later steps create instead of the whole heap, whose walk stalls the host
    that launches the GPU's work (docs/memory.md)."""
    gc.collect()
    gc.freeze()


def _train(spec, resume: str | None, wall: control.WallClock, ctx: D.DistContext | None = None,
           profile: tuple[int, int] | None = None, faults: Faults = NO_FAULTS) -> int:
    r = setup(spec, ctx, faults)
    try:
        return _train_loop(r, spec, resume, wall, profile)
    finally:
        r.loader.close()  # also when a check refuses the run before its first step: no data worker left behind


def _prepare(r: Run, resume: str | None) -> tuple[str | None, str | None]:
    """Before the first step: the disk the checkpoints need, stale temporaries gone, and the
    checkpoint to continue from (restored; the metrics after it dropped).  Returns its folder
    and what the resume changed that the schedule depends on (``loop/resume.py``), or Nones."""
    run_dir, main = r.run_dir, is_main(r)
    control.preflight(run_dir, parameter_bytes(r.model) + r.bound.state_bytes(),
                      factor=disk_copies(r.spec.checkpoint, run_dir))  # the same count as pgs validate's check
    if main:
        ckpt.remove_stale_temporaries(run_dir)
    D.barrier()
    folder = _resolve(r, resume)
    changed = None  # what the resume changes that the schedule depends on (loop/resume.py)
    if folder is not None:
        restore(r, folder)
        changed = check_resume(r.spec, folder, r.step, r.total_steps, r.schedule, r.objective.steps_per_epoch)
        if main:
            MetricsLog.truncate_after(run_dir, r.step)
    return folder, changed


def _open_log(r: Run, folder: str | None, changed: str | None = None) -> None:
    """The metrics log (rank 0; the others log nothing) and the run's first records."""
    spec = r.spec
    if is_main(r):
        spec.to_toml(os.path.join(r.run_dir, "spec.resolved.toml"))
        project, run_name = trackers.names(spec)
        r.log = MetricsLog(r.run_dir, total_steps=r.total_steps, print_every=spec.train.log_every,
                           trackers=trackers.enabled(spec.log), project=project, run_name=run_name,
                           config=spec.to_dict(), console=console_keys(r.objective.console_keys))
    else:
        r.log = _NullLog()
    for field, source in spec.hub.items():  # where a hub name's files come from (spec.resolved.toml pins it)
        r.log.say(f"pgs: {field}: {source.repo} at revision {source.revision} ({source.path})")
    if folder is not None:
        r.log.say(f"pgs: resumed from {folder} at step {r.step}")
        r.log.write({"step": r.step, "event": "resume", "from": folder})
        if changed is not None:
            r.log.say(changed)
    else:  # pgs report reads the records after the last fresh start
        r.log.write({"step": r.step, "event": "start"})
    offload = getattr(r.bound, "offload_stats", None)
    if offload is not None:  # memory.offload_optimizer: what lives where, and the PCIe traffic it costs
        o = offload()
        ranks = r.ctx.world_size if r.ctx is not None else 1  # with several, each holds its own shards' state
        each = f" per process ({ranks} processes, each its own shards)" if ranks > 1 else ""
        r.log.say(f"pgs: optimizer state in host memory{each}: {o['host_state_bytes'] / 2**30:.2f} GiB pinned, "
                  f"{o['staging_bytes'] / 2**30:.2f} GiB of device staging, "
                  f"{o['pcie_bytes_per_step'] / 2**30:.2f} GiB over PCIe per step")
        r.log.write({"step": r.step, "event": "offload", "processes": ranks, **{k: o[k] for k in
                     ("host_state_bytes", "staging_bytes", "pcie_bytes_per_step")}})


class _FreezeGc(Service):
    """:func:`freeze_gc` once, after the process's first step."""

    def __init__(self):
        self.frozen = False

    def after_step(self, run, step: int) -> None:
        if not self.frozen:
            freeze_gc()
            self.frozen = True


class _Records:
    """Step records are read one step late (:class:`StepRecord`); this holds the one not yet
    logged and logs it (with what the services observe in it) when the next one arrives or
    before whatever a step ends with (a skip, a halt, an eval, a checkpoint)."""

    def __init__(self, run: Run, services: list[Service]):
        self.run, self.services, self.last = run, services, None

    def push(self, step_record: StepRecord) -> None:
        self.flush()
        self.last = step_record

    def flush(self) -> None:
        if self.last is None:
            return
        r, record = self.run, self.last.read()
        self.last = None
        events = [event for s in self.services for event in s.observe(r, record)]
        r.log.step(record)
        r.objective.after_step(r, record)
        for event in events:
            r.log.write(event)
        for s in reversed(self.services):
            s.after_record(r, record)


def _stopped(r: Run, flags: list[int], path: str) -> int:
    """A signal or the wall budget: the checkpoint is written; the ``stop`` event and exit code."""
    if flags[control.SIGNAL]:
        code = control.exit_code_for_signal(flags[control.SIGNAL])
        why = f"signal {code - 128}"
    else:
        code, why = EXIT_WALL_BUDGET, f"train.max_wall_seconds = {r.spec.train.max_wall_seconds:g} spent"
        control.halt(r.run_dir, why, step=r.step, exit_code=code, details={"checkpoint": path})
    r.log.write({"step": r.step, "event": "stop", "reason": why, "exit_code": code})
    r.log.say(f"pgs: stopped at step {r.step} ({why}); checkpoint {path}")
    return code


def _steps(r: Run, services: list[Service], evaluator: Evaluator, checkpointer: Checkpointer,
           signals: control.StopSignals, wall: control.WallClock) -> int | None:
    """Steps until ``train.steps``; returns a stop's exit code, or None at the end."""
    records = _Records(r, services)
    while r.step < r.total_steps:
        before_step(services, r, r.step + 1)
        step_record, flags = train_step(r, signals, wall)
        after_step(services, r, r.step)
        checkpointer.collect_ended(r, flags)
        records.push(step_record)
        if flags[control.NONFINITE] or flags[control.SPIKE]:
            records.flush()
            r.log.write({"step": r.step, "event": "skip", "nonfinite": flags[control.NONFINITE],
                         "spike": flags[control.SPIKE]})
        verdict, last_step = r.skips.verdict(), r.step == r.total_steps
        stop = bool(flags[control.SIGNAL] or flags[control.WALL])
        evaluating = evaluator.should_evaluate(r.step, last_step=last_step)
        saving = checkpointer.should_save(r.step, last_step=last_step, stop=stop)
        if verdict is not None or evaluating or saving:
            records.flush()  # the record goes before whatever this step ends with
        if verdict is not None:
            raise control.halt(r.run_dir, verdict, step=r.step, details=r.skips.state_dict())
        if evaluating:
            evaluator.run(r, services, checkpointer)
            r.step_clock = None  # evaluation is not a training step's time
        if saving:
            path = checkpointer.save(r, last_step=last_step, stop=stop)
            if stop:
                return _stopped(r, flags, path)
    records.flush()
    return None


def _train_loop(r: Run, spec, resume: str | None, wall: control.WallClock, profile: tuple[int, int] | None) -> int:
    """Prepare, then step until the end or a stop; every service closes however the run ends."""
    profiler = Profiler(r.run_dir, profile, r.device) if profile and is_main(r) else None
    services = r.services = build_services(r, profiler, extra=(_FreezeGc(),))  # before a restore: their state
    folder, changed = _prepare(r, resume)
    _open_log(r, folder, changed)
    evaluator, checkpointer = Evaluator(spec), Checkpointer(r)
    try:
        with control.StopSignals() as signals:
            if r.step == 0 and evaluator.should_evaluate(r.step):
                evaluator.run(r, services, checkpointer)
            checkpointer.reserve(r)
            r.log.start(r.step)
            code = _steps(r, services, evaluator, checkpointer, signals, wall)
            if code is not None:
                return code
            checkpointer.finish(r)
            for service in services:
                service.finish(r)
            r.log.write({"step": r.step, "event": "done", **_final_memory(r)})
    finally:
        checkpointer.close(r)
        for service in reversed(services):
            service.close(r)
        r.loader.close()
        r.log.close()
    return EXIT_OK
