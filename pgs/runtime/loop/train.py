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

import datetime
import gc
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from pgs.errors import DiskFull, EXIT_OK, EXIT_TRIPWIRE, EXIT_WALL_BUDGET, HaltError, PreflightRefused, SpecError
from pgs.runtime.common import run_device
from pgs.runtime.data import require_packing_isolation
from pgs.runtime.data.loader import StepLoader
from pgs.runtime.dist import context as CP, fsdp as D
from pgs.runtime.loop import control, trackers
from pgs.runtime.loop.averaging import CHECKPOINT_FILE as AVERAGING_FILE, EXPORT_DIR as EMA_EXPORT, WeightAverager
from pgs.runtime.loop.faults import Faults, NO_FAULTS
from pgs.runtime.loop.health import HealthMonitor
from pgs.runtime.loop.metrics import MetricsLog, console_keys
from pgs.runtime.loop.msft import Msft, source_eval_losses
from pgs.runtime.loop.objective import build_objective, objective_class
from pgs.runtime.loop.run import Run
from pgs.runtime.loop.trace import Profiler
from pgs.runtime.model import layers
from pgs.runtime.model.build import build_model, freeze, parameter_bytes
from pgs.runtime.model.moe import router_tap
from pgs.runtime.model.tiled_mlp import apply_mlp_tiles
from pgs.runtime import process
from pgs.runtime.optim import StepMetrics, make_optimizer
from pgs.runtime.optim.memory import MemoryOptions
from pgs.runtime.spec.load import check_world_size
from pgs.runtime.spec.preflight import preflight_spec
from pgs.runtime.store import background, checkpoint as ckpt, dcp
from pgs.runtime.tools.resources import disk_copies
from pgs.runtime.store.export import export_hf

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
    """Liger kernels, activation checkpointing and per-layer compile from ``[memory]``, in place.
    ``fast_recompute=False``: checkpoint through ``torch.utils.checkpoint`` only (a router loss
    needs the forward's graph, which the fast recompute does not build)."""

    options = MemoryOptions.of(memory)
    if options.liger:
        layers.apply_liger(model)
    if options.mlp_tiles > 1:
        apply_mlp_tiles(model, options.mlp_tiles)
    if options.activation_checkpointing != "none":
        layers.apply_activation_checkpointing(model, options.activation_checkpointing, options.checkpoint_every,
                                              offload=options.checkpoint_offload, fast_recompute=fast_recompute)
    if options.compile_layers:
        layers.compile_layers(model)


def configure_allocator(device: torch.device, limit_gib: float = 0.0) -> None:
    """CUDA's caching allocator for a training run.

    Expandable segments, unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise: variable-length
    packed batches, recomputed layers and the chunked loss allocate blocks of ever-changing
    sizes; with fixed segments the allocator keeps reserving new ones that the freed blocks
    cannot be split to fit (the 0.6B packed run reserved 56 GiB for 46 allocated), and with
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
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        setter("expandable_segments:True" + (",garbage_collection_threshold:0.9" if limit_gib else ""))
    if limit_gib:
        torch.cuda.set_per_process_memory_fraction(limit_gib * 2**30 / total, index)


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
    tokenizer = preflight_spec(spec, processes=world).tokenizer
    mem = spec.memory
    cp = spec.parallel.context
    shard = None
    if cp > 1:  # ranks split each row: ring attention (dist/context.py); the rest is data parallel
        chosen = objective_class(spec)
        if not chosen.splits_rows:
            raise SpecError(f"parallel.context: a [{chosen.section}] run needs whole sequences on each rank "
                            "(set parallel.context = 1)")
        if spec.loss.embedding_noise() is not None:
            raise SpecError("parallel.context: not with embedding noise (loss.neftune_alpha, loss.symnoise_alpha: "
                            "they read whole rows)")
        if not sharded:
            raise SpecError(f"parallel.context: {cp} ranks per sequence need pgs run --nproc N (N a multiple of {cp})")
    if sharded:
        check_world_size(spec.train, world, cp)
        if spec.averaging is not None:
            raise SpecError("averaging: weight averaging runs on one process for now (WORLD_SIZE = 1)")
        if cp > 1:
            shard = CP.make_shard(ctx.rank, world, cp, spec.parallel.layout)
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
    chain = spec.build_chain(total)
    if sharded:
        D.shard_model(model, ctx.mesh, mixed_precision=mixed)
    bound = make_optimizer(chain, model, mem, sharded=sharded, grad_accum=spec.train.grad_accum,
                           compile=spec.optimizer.compile, jit=spec.optimizer.jit)
    micro_batch = spec.train.batch_size // (spec.train.grad_accum * (world // cp))
    loader = StepLoader(objective.stream, micro_batch, spec.train.grad_accum, device, ahead=objective.loader_ahead)
    return Run(
        spec=spec, run_dir=spec.checkpoint.dir, device=device, model=model, tokenizer=tokenizer, bound=bound,
        objective=objective, total_steps=total, micro_batch=micro_batch, loader=loader,
        skips=control.SkipCounter(spec.train.max_consecutive_skips, spec.train.max_skip_fraction),
        chain_has_norm=bound.metrics().grad_norm is not None,
        ctx=ctx if sharded else None, faults=faults, moe=moe, context=shard,
        health=HealthMonitor.from_spec(spec, model, total),
        averaging=WeightAverager.from_spec(spec, model, total),  # its base: the weights as built, before any restore
        msft=Msft.create(spec, distributed=sharded),
    )


def restore(run: Run, folder: str) -> None:
    """Continue from a verified checkpoint folder: weights, chain state, RNG, data, counters.

    A DCP folder (several processes) is loaded by every rank through ``dcp.load``.
    """

    if run.ctx is not None or dcp.is_dcp(folder):
        t = dcp.load(folder, model=run.model, optimizer=run.bound, generators=run.objective.generators())
        step = int(t["step"])
    else:
        saved = ckpt.load(folder)
        ckpt.load_model_state(run.model, saved.model, saved.trainer.get("aliases", {}))
        run.bound.load_state_dict(saved.optimizer)
        ckpt.restore_rng(saved.rng, generators=run.objective.generators())
        if run.averaging is not None:
            run.averaging.load_state_dict(ckpt.load_extra(folder, AVERAGING_FILE), folder)
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


def save(run: Run, timings: dict[str, float] | None = None) -> str:
    """Write ``step_<N>`` (durably), then purge old ones beyond ``checkpoint.keep``.
    ``timings``: filled as ``pgs.runtime.store.checkpoint.save`` fills it (one process only)."""
    step = run.step
    if run.ctx is not None:
        folder = dcp.save(run.run_dir, step, model=run.model, optimizer=run.bound, trainer=run.counters(),
                          spec_toml=run.spec.to_toml(),
                          generators=run.objective.generators())
        if run.ctx.is_main:
            ckpt.purge(run.run_dir, run.spec.checkpoint.keep)
        D.barrier()
        return folder
    folder = ckpt.save(
        run.run_dir, step, model=run.model, optimizer_state=run.bound.state_dict(copy=False),
        rng=ckpt.capture_rng(generators=run.objective.generators()), trainer=run.counters(),
        spec_toml=run.spec.to_toml(),
        crash_hook=lambda stage: stage == "optimizer" and run.faults.crash("checkpoint_write", step),
        extra={AVERAGING_FILE: run.averaging.state_dict()} if run.averaging is not None and run.averaging.has_ema
        else None,
        timings=timings,
    )
    ckpt.purge(run.run_dir, run.spec.checkpoint.keep)
    return folder


def snapshot_groups(run: Run) -> tuple[dict, dict[str, str]]:
    """What a background save snapshots (file -> live tensors: the weights, the optimizer
    state, the EMA) and the weights' aliases."""
    tensors, aliases = ckpt.model_tensors(run.model)
    groups = {"model": tensors, "optimizer": run.bound.state_dict(copy=False)}
    if run.averaging is not None and run.averaging.has_ema:
        groups[AVERAGING_FILE] = run.averaging.state_dict()
    return groups, aliases


def save_in_background(run: Run, saver: background.BackgroundSaver) -> float:
    """Start writing ``step_<N>`` on ``saver``'s thread (``[checkpoint] background``,
    ``pgs.runtime.store.background``): the weights, optimizer state and EMA are snapshot into
    host memory now, the RNG states and counters taken now; the thread writes the folder as
    :func:`save` does, then purges.  With several processes (collective) each rank's shards are
    staged and written by DCP (``dcp.save_async``) and rank 0 publishes the folder on its thread.
    Returns the snapshot's seconds (the training's wait).  The save's result, which
    ``saver.collect`` returns, is its ``checkpoint`` event."""
    step, run_dir, keep, faults = run.step, run.run_dir, run.spec.checkpoint.keep, run.faults
    trainer = json.loads(json.dumps(run.counters()))  # a copy: the run's own objects go on changing
    spec_toml = run.spec.to_toml()

    def event(path: str, **more) -> dict:
        return {"step": step, "event": "checkpoint", "path": path, "background": True,
                "checkpoint_seconds": round(saver.snapshot_seconds, 3), **more}

    if run.ctx is not None:  # several processes: DCP stages each rank's shards and writes them
        began = time.perf_counter()
        job, final, need, saver.writer = dcp.save_async(
            run_dir, step, model=run.model, optimizer=run.bound, trainer=trainer, spec_toml=spec_toml,
            generators=run.objective.generators(), group=saver.group, writer=saver.writer)
        saver.snapshot_seconds, saver.label, main = time.perf_counter() - began, (final, need), run.ctx.is_main

        def write_dcp() -> dict:
            path = job()
            if main:
                ckpt.purge(run_dir, keep)
            return event(path)

        saver.submit(write_dcp)
        return saver.snapshot_seconds
    groups, aliases = snapshot_groups(run)
    rng = ckpt.capture_rng(generators=run.objective.generators())
    saver.label = (os.path.join(run_dir, f"step_{step}"), ckpt.need_bytes(
        groups["model"], groups["optimizer"], rng, {k: v for k, v in groups.items() if k == AVERAGING_FILE}))

    def write(snap: dict) -> dict:
        timings: dict[str, float] = {}
        path = ckpt.save_tensors(
            run_dir, step, tensors=snap["model"], aliases=aliases, optimizer_state=snap["optimizer"], rng=rng,
            trainer=trainer, spec_toml=spec_toml,
            crash_hook=lambda stage: stage == "optimizer" and faults.crash("checkpoint_write", step),
            extra={AVERAGING_FILE: snap[AVERAGING_FILE]} if AVERAGING_FILE in snap else None, timings=timings)
        ckpt.purge(run_dir, keep)
        return event(path, snapshot_bytes=saver.snapshot.nbytes,
                     **{k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()})

    return saver.start(write, groups)


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
    loss_parts, stat_parts = [], []
    pending = None
    for batch in batches:
        if run.bound.in_backward:  # the update runs inside backward: agree on the loss before it
            pending, e = _forward(run, batch, poison)
            l = pending.detach()
        else:
            l, e = _loss(run, batch, n_mean, poison)
        loss_parts.append(l)
        stat_parts.append(e)
    loss_sum = float(sum(loss_parts))  # the control plane's read: every micro-batch's loss
    nonfinite = not math.isfinite(loss_sum) or n_valid == 0 or n_mean == 0
    save_flags = run.saver.flags() if run.saver is not None else (0, 0)  # a background save: running, failed
    flags = control.agree([signals.received, wall.spent(), nonfinite, 0, *save_flags])
    opt = StepMetrics()
    extra_values: dict = {}
    grad_norm = None
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
    stamp = round(time.time(), 3)
    step, trained, skipped_total, spike = run.step, run.trained_tokens, run.skips.skipped, int(bool(flags[control.SPIKE]))
    memory = _memory_gib(run.device)

    def finish(v: dict) -> dict:
        measured = objective.step_metrics([v[f"stat{i}"] for i in range(len(stats))], n_mean, n_valid, extra)
        return {
            "time": stamp,
            "step": step,
            "loss": loss_sum / max(n_mean, 1),
            **{k: v[k] for k in ("lr", "grad_norm") if k in v},
            **measured,
            "valid_tokens": n_valid,
            "trained_tokens": trained,
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_seconds": elapsed,
            **memory,
            "skipped": int(skipped),
            "skipped_total": skipped_total,
            "spike": spike,
            **{k: x for k, x in v.items() if k.startswith(("moe/", "release/", "offload/"))},
        }

    return StepRecord(values, finish), flags


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


def evaluate(run: Run) -> dict:
    """The objective's eval record at the current step (with several processes, every rank), and
    each source's own eval loss where sources name eval files (one process)."""
    out = {"step": run.step}
    if run.spec.data.eval:
        out.update(run.objective.evaluate(run))
    if run.ctx is None:
        out.update(source_eval_losses(run))
    return out


def _export(run: Run, out_dir: str, info: dict) -> None:
    shards = run.spec.checkpoint.max_shard_size
    if run.ctx is not None:
        dcp.export_hf(run.model, run.tokenizer, out_dir, info=info, max_shard_size=shards)
    else:
        export_hf(run.model, run.tokenizer, out_dir, info=info, max_shard_size=shards)


def _improves(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if "accuracy" in metric else value < best


def eval_and_keep_best(run: Run) -> None:
    result = evaluate(run)
    if run.averaging is not None and run.averaging.ready:  # the EMA weights, evaluated the same way
        with run.averaging.ema_weights(run.model):
            result.update({f"ema_{k}": v for k, v in evaluate(run).items() if k != "step"})
    run.log.write(result)
    run.log.say("eval  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in result.items()))
    if run.msft is not None:
        event = run.msft.after_eval(run, result)
        if event is not None:
            run.log.write(event)
            run.log.say(f"mSFT: {event['source']} overfit first (best at step {event['best_step']}); "
                        f"excluded, weights reverted to that step; active: {', '.join(event['active']) or 'none'}")
    metric = run.spec.checkpoint.best_metric
    if metric and metric in result and _improves(metric, result[metric], run.best):
        run.best, run.best_step = float(result[metric]), run.step
        _export(run, os.path.join(run.run_dir, "best"), {"step": run.step, metric: run.best})


def run(spec, *, resume: str | None = None, spec_path: str | None = None,
        profile: tuple[int, int] | None = None, overwrite: bool = False, faults: Faults = NO_FAULTS) -> int:
    """Train ``spec`` to the end, or until a stop; returns the process exit code.

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


def _train_loop(r: Run, spec, resume: str | None, wall: control.WallClock, profile: tuple[int, int] | None) -> int:
    run_dir = spec.checkpoint.dir
    main = is_main(r)
    control.preflight(run_dir, parameter_bytes(r.model) + r.bound.state_bytes(),
                      factor=disk_copies(spec.checkpoint, run_dir))  # the same count as pgs validate's check
    if main:
        ckpt.remove_stale_temporaries(run_dir)
    D.barrier()
    folder = _resolve(r, resume)
    if folder is not None:
        restore(r, folder)
        if main:
            MetricsLog.truncate_after(run_dir, r.step)
    if main:
        spec.to_toml(os.path.join(run_dir, "spec.resolved.toml"))
        project, run_name = trackers.names(spec)
        r.log = MetricsLog(run_dir, total_steps=r.total_steps, print_every=spec.train.log_every,
                           trackers=trackers.enabled(spec.log), project=project, run_name=run_name,
                           config=spec.to_dict(), console=console_keys(r.objective.console_keys))
    else:
        r.log = _NullLog()
    if folder is not None:
        r.log.say(f"pgs: resumed from {folder} at step {r.step}")
        r.log.write({"step": r.step, "event": "resume", "from": folder})
    else:  # pgs report reads the records after the last fresh start
        r.log.write({"step": r.step, "event": "start"})
    offload = getattr(r.bound, "offload_stats", None)
    if offload is not None:  # memory.offload_optimizer: what lives where, and the PCIe traffic it costs
        o = offload()
        r.log.say(f"pgs: optimizer state in host memory: {o['host_state_bytes'] / 2**30:.2f} GiB pinned, "
                  f"{o['staging_bytes'] / 2**30:.2f} GiB of device staging, "
                  f"{o['pcie_bytes_per_step'] / 2**30:.2f} GiB over PCIe per step")
        r.log.write({"step": r.step, "event": "offload", **{k: o[k] for k in
                     ("host_state_bytes", "staging_bytes", "pcie_bytes_per_step")}})
    evals = (bool(spec.data.eval) or any(s.eval for s in spec.data.sources)) and spec.train.eval_every > 0
    profiler = Profiler(run_dir, profile, r.device) if profile and main else None
    saver = r.saver = background.BackgroundSaver() if spec.checkpoint.background else None
    if saver is not None and r.ctx is not None:  # the saves' own collectives, beside the training's
        saver.group = torch.distributed.new_group(backend="gloo",
                                                  timeout=datetime.timedelta(seconds=D.timeout_seconds()))

    def log_save(record: dict | None) -> None:  # a background save's event, when it has ended
        if record is not None:
            r.log.write({**record, "logged_at_step": r.step})

    def collect(agreed: int | None = None) -> None:
        """The background save in flight, collected by every process at the same step: its
        ``checkpoint`` event logged, or its failure raised on every process (``agreed``: the
        failure code the step's flags agreed on; None: agreed here, a collective)."""
        if saver is None or not saver.pending:
            return
        record, err = saver.collect()
        code = agreed if agreed is not None else control.agree(
            [0] * control.SAVE_FAILED + [background.failure_code(err)])[control.SAVE_FAILED]
        if err is not None:
            raise err
        if code:  # another process's save failed
            final, need = saver.label
            if code == background.DISK_FULL:
                raise ckpt.disk_full_error(final, need)
            raise ckpt.CheckpointError(f"writing the checkpoint {final} failed on another process (its log says why)")
        log_save(record)

    try:
        with control.StopSignals() as signals:
            if evals and r.step == 0:
                eval_and_keep_best(r)
            every = spec.checkpoint.every
            if saver is not None and r.ctx is None and every and (r.step // every + 1) * every < r.total_steps:
                saver.snapshot.reserve(snapshot_groups(r)[0])  # now, not in the first save's step
            r.log.start(r.step)
            frozen = False
            last: StepRecord | None = None  # the previous step's record, read once this step is launched

            def emit(step_record: StepRecord) -> dict:
                record = step_record.read()
                events = r.health.observe(record)  # the interval's health keys join the record
                r.log.step(record)
                r.objective.after_step(r, record)
                for event in events:
                    r.log.write(event)
                if r.health.verdict is not None:
                    raise control.halt(run_dir, r.health.verdict, step=record["step"], exit_code=EXIT_TRIPWIRE,
                                       details={"tripwire": "train.entropy_halt"})
                return record

            while r.step < r.total_steps:
                if profiler is not None:
                    profiler.before(r.step + 1)
                r.health.before_step(r.step + 1)
                step_record, flags = train_step(r, signals, wall)
                r.health.after_step(r.step)
                if r.averaging is not None:  # merge-back and the EMA's copy, when due
                    r.averaging.after_step(r.step)
                if profiler is not None:
                    profiler.after(r.step)
                if not frozen:  # see freeze_gc
                    freeze_gc()
                    frozen = True
                r.faults.crash("step", r.step)
                if saver is not None and saver.pending and not flags[control.SAVE_RUNNING]:
                    collect(flags[control.SAVE_FAILED])  # ended on every process (a full disk: exit 84 on each)
                if last is not None:
                    emit(last)
                last = step_record
                if flags[control.NONFINITE] or flags[control.SPIKE]:
                    emit(last)
                    last = None
                    r.log.write({"step": r.step, "event": "skip", "nonfinite": flags[control.NONFINITE],
                                 "spike": flags[control.SPIKE]})
                verdict = r.skips.verdict()
                evaluating = evals and (r.step % spec.train.eval_every == 0 or r.step == r.total_steps)
                stop = flags[control.SIGNAL] or flags[control.WALL]
                saving = stop or (every and r.step % every == 0) or r.step == r.total_steps
                if last is not None and (verdict is not None or evaluating or saving):
                    emit(last)  # the record goes before whatever this step ends with
                    last = None
                if verdict is not None:
                    raise control.halt(run_dir, verdict, step=r.step, details=r.skips.state_dict())
                if evaluating:
                    eval_and_keep_best(r)
                    r.step_clock = None  # evaluation is not a training step's time
                if saving and saver is not None and not stop and r.step < r.total_steps:
                    collect()  # one save in flight: the one before ends first
                    save_in_background(r, saver)  # the step clock runs on: the snapshot is the step's time
                elif saving:
                    collect()  # a stop and the last step save in the foreground, after the one in flight
                    began, timings = time.perf_counter(), {}
                    path = save(r, timings)
                    r.log.write({"step": r.step, "event": "checkpoint", "path": path,
                                 "checkpoint_seconds": round(time.perf_counter() - began, 3),
                                 **{k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()}})
                    r.step_clock = None
                    if stop:
                        if flags[control.SIGNAL]:
                            code = control.exit_code_for_signal(flags[control.SIGNAL])
                            why = f"signal {code - 128}"
                        else:
                            code, why = EXIT_WALL_BUDGET, f"train.max_wall_seconds = {spec.train.max_wall_seconds:g} spent"
                            control.halt(run_dir, why, step=r.step, exit_code=code, details={"checkpoint": path})
                        r.log.write({"step": r.step, "event": "stop", "reason": why, "exit_code": code})
                        r.log.say(f"pgs: stopped at step {r.step} ({why}); checkpoint {path}")
                        return code
                if r.faults.slow_step_s:
                    time.sleep(r.faults.slow_step_s)
            if last is not None:
                emit(last)
            if spec.checkpoint.export:
                _export(r, os.path.join(run_dir, "final"), {"step": r.step})
                if r.averaging is not None and r.averaging.has_ema:
                    with r.averaging.ema_weights(r.model):
                        _export(r, os.path.join(run_dir, EMA_EXPORT), {"step": r.step, "ema": r.averaging.decay})
            r.log.write({"step": r.step, "event": "done", **_final_memory(r)})
    finally:
        if saver is not None:  # a halt or an error: the save in flight completes (or fails) before the exit
            failing = sys.exc_info()[1]
            try:
                log_save(saver.close())
            except Exception as err:
                if failing is None:
                    raise
                r.log.say(f"pgs: the checkpoint written in the background failed as well: {err}")
        if profiler is not None:
            profiler.close()
        r.loader.close()
        r.log.close()
    return EXIT_OK
