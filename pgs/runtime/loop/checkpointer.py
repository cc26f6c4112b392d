"""Checkpointing as one component (``[checkpoint]``, ``pgs.runtime.store.config.CheckpointSpec``):
its cadence, foreground and background saves, the purge of old ones, the best model and the
HF export.

The loop asks :meth:`Checkpointer.should_save` after every step and, when it says so, calls
:meth:`Checkpointer.save` (``last_step``, ``stop``): a periodic save goes to the background
saver when ``checkpoint.background`` is on (the step clock runs on: the snapshot is the
step's time); a stop and the last step save in the foreground, after the save in flight.
A background save's ``checkpoint`` event is logged when every process has seen it end
(:meth:`Checkpointer.collect_ended`, on the step's agreed flags).  The folder formats are
``pgs.runtime.store.checkpoint`` (one process) and ``pgs.runtime.store.dcp`` (several).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

from pgs.runtime.dist import fsdp as D
from pgs.runtime.loop import control
from pgs.runtime.store import background, checkpoint as ckpt, dcp
from pgs.runtime.store.export import export_hf


def export(run, out_dir: str, info: dict) -> None:
    """The model as a plain HF folder (``final/``, ``best/``, ``final-ema/``)."""
    shards = run.spec.checkpoint.max_shard_size
    if run.ctx is not None:
        dcp.export_hf(run.model, run.tokenizer, out_dir, info=info, max_shard_size=shards)
    else:
        export_hf(run.model, run.tokenizer, out_dir, info=info, max_shard_size=shards)


#: Parts of a metric's name that make higher better (accuracies, a preference run's reward margin,
#: rewards and log-probs); any other metric (losses, KLs) improves by falling.
HIGHER_IS_BETTER = ("accuracy", "margin", "reward", "logp")


def _improves(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if any(part in metric for part in HIGHER_IS_BETTER) else value < best


def stateful(run) -> list:
    """The run's services that keep state in checkpoints (``Service.state_name`` set), in order."""
    return [s for s in run.services if s.state_name]


def service_files(run) -> dict[str, dict]:
    """One process: the services' checkpoint state by file (``<state_name>.safetensors``)."""
    return {f"{s.state_name}.safetensors": s.state_dict(run) for s in stateful(run)}


def service_entries(run) -> dict[str, dict]:
    """Several processes: the services' checkpoint state by DCP entry (``state_name``)."""
    return {s.state_name: s.state_dict(run) for s in stateful(run)}


def save(run, timings: dict[str, float] | None = None) -> str:
    """Write ``step_<N>`` (durably), then purge old ones beyond ``checkpoint.keep``.
    ``timings``: filled as ``pgs.runtime.store.checkpoint.save`` fills it (one process only)."""
    step = run.step
    if run.ctx is not None:
        folder = dcp.save(run.run_dir, step, model=run.model, optimizer=run.bound, trainer=run.counters(),
                          spec_toml=run.spec.to_toml(),
                          generators=run.objective.generators(), services=service_entries(run))
        if run.ctx.is_main:
            ckpt.purge(run.run_dir, run.spec.checkpoint.keep)
        D.barrier()
        return folder
    folder = ckpt.save(
        run.run_dir, step, model=run.model, optimizer_state=run.bound.state_dict(copy=False),
        rng=ckpt.capture_rng(generators=run.objective.generators()), trainer=run.counters(),
        spec_toml=run.spec.to_toml(),
        crash_hook=lambda stage: stage == "optimizer" and run.faults.crash("checkpoint_write", step),
        extra=service_files(run) or None,
        timings=timings,
    )
    ckpt.purge(run.run_dir, run.spec.checkpoint.keep)
    return folder


def snapshot_groups(run) -> tuple[dict, dict[str, str]]:
    """What a background save snapshots (file -> live tensors: the weights, the optimizer
    state, the services' state, e.g. the EMA) and the weights' aliases."""
    tensors, aliases = ckpt.model_tensors(run.model)
    groups = {"model": tensors, "optimizer": run.bound.state_dict(copy=False), **service_files(run)}
    return groups, aliases


_OWN_GROUPS = ("model", "optimizer")


def _rounded(timings: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in timings.items()}


def _save_dcp_in_background(run, saver: background.BackgroundSaver, trainer: dict, spec_toml: str, event) -> float:
    """Several processes: DCP stages each rank's shards and writes them; rank 0 publishes the
    folder on its thread."""
    step, run_dir, keep = run.step, run.run_dir, run.spec.checkpoint.keep
    began = time.perf_counter()
    job, final, need, saver.writer = dcp.save_async(
        run_dir, step, model=run.model, optimizer=run.bound, trainer=trainer, spec_toml=spec_toml,
        generators=run.objective.generators(), group=saver.group, writer=saver.writer,
        services=service_entries(run))
    saver.snapshot_seconds, saver.label, main = time.perf_counter() - began, (final, need), run.ctx.is_main

    def write_dcp() -> dict:
        path = job()
        if main:
            ckpt.purge(run_dir, keep)
        return event(path)

    saver.submit(write_dcp)
    return saver.snapshot_seconds


def save_in_background(run, saver: background.BackgroundSaver) -> float:
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

    if run.ctx is not None:
        return _save_dcp_in_background(run, saver, trainer, spec_toml, event)
    groups, aliases = snapshot_groups(run)
    rng = ckpt.capture_rng(generators=run.objective.generators())
    saver.label = (os.path.join(run_dir, f"step_{step}"), ckpt.need_bytes(
        groups["model"], groups["optimizer"], rng, {k: v for k, v in groups.items() if k not in _OWN_GROUPS}))

    def write(snap: dict) -> dict:
        timings: dict[str, float] = {}
        path = ckpt.save_tensors(
            run_dir, step, tensors=snap["model"], aliases=aliases, optimizer_state=snap["optimizer"], rng=rng,
            trainer=trainer, spec_toml=spec_toml,
            crash_hook=lambda stage: stage == "optimizer" and faults.crash("checkpoint_write", step),
            extra={k: v for k, v in snap.items() if k not in _OWN_GROUPS} or None, timings=timings)
        ckpt.purge(run_dir, keep)
        return event(path, snapshot_bytes=saver.snapshot.nbytes, **_rounded(timings))

    return saver.start(write, groups)


class Checkpointer:
    """A run's checkpoints: when to save, how (foreground or on the background saver), the
    best model by ``checkpoint.best_metric`` and the exports.  ``run.saver`` is its background
    saver (None without ``checkpoint.background``), whose flags every step agrees on."""

    def __init__(self, run):
        c = run.spec.checkpoint
        self.every, self.best_metric, self.exports, self.last = c.every, c.best_metric, c.export, c.last
        self.saver = run.saver = background.BackgroundSaver() if c.background else None
        if self.saver is not None and run.ctx is not None:  # the saves' own collectives, beside the training's
            self.saver.group = torch.distributed.new_group(backend="gloo",
                                                           timeout=datetime.timedelta(seconds=D.timeout_seconds()))

    def reserve(self, run) -> None:
        """The background snapshot's host buffers, now rather than in the first save's step."""
        every = self.every
        if self.saver is not None and run.ctx is None and every and (run.step // every + 1) * every < run.total_steps:
            self.saver.snapshot.reserve(snapshot_groups(run)[0])

    def should_save(self, step: int, *, last_step: bool, stop: bool) -> bool:
        return bool(stop or (self.every and step % self.every == 0) or (last_step and self.last))

    def save(self, run, *, last_step: bool, stop: bool) -> str | None:
        """Save ``step_<N>``: periodic saves on the background saver when there is one (None
        returned: its event is logged when it ends), else in the foreground (its path)."""
        if self.saver is not None and not stop and not last_step:
            self.collect(run)  # one save in flight: the one before ends first
            save_in_background(run, self.saver)  # the step clock runs on: the snapshot is the step's time
            return None
        self.collect(run)  # a stop and the last step save in the foreground, after the one in flight
        began, timings = time.perf_counter(), {}
        path = save(run, timings)
        run.log.write({"step": run.step, "event": "checkpoint", "path": path,
                       "checkpoint_seconds": round(time.perf_counter() - began, 3), **_rounded(timings)})
        run.step_clock = None
        return path

    def _log(self, run, record: dict | None) -> None:  # a background save's event, when it has ended
        if record is not None:
            run.log.write({**record, "logged_at_step": run.step})

    def collect_ended(self, run, flags: list[int]) -> None:
        """After a step: the background save that every process saw end (a full disk: exit 84 on each)."""
        if self.saver is not None and self.saver.pending and not flags[control.SAVE_RUNNING]:
            self.collect(run, flags[control.SAVE_FAILED])

    def collect(self, run, agreed: int | None = None) -> None:
        """The background save in flight, collected by every process at the same step: its
        ``checkpoint`` event logged, or its failure raised on every process (``agreed``: the
        failure code the step's flags agreed on; None: agreed here, a collective)."""
        saver = self.saver
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
        self._log(run, record)

    def keep_best(self, run, result: dict) -> None:
        """``best/``: the model at the best ``checkpoint.best_metric`` so far."""
        metric = self.best_metric
        if metric and metric in result and _improves(metric, result[metric], run.best):
            run.best, run.best_step = float(result[metric]), run.step
            with run.bound.eval_weights():  # a schedule-free chain's x
                export(run, os.path.join(run.run_dir, "best"), {"step": run.step, metric: run.best})

    def finish(self, run) -> None:
        """``final/``: the model after the last step (``checkpoint.export``)."""
        if self.exports:
            with run.bound.eval_weights():  # a schedule-free chain's x
                export(run, os.path.join(run.run_dir, "final"), {"step": run.step})

    def close(self, run) -> None:
        """A halt or an error: the save in flight completes (or fails) before the exit."""
        if self.saver is None:
            return
        failing = sys.exc_info()[1]
        try:
            self._log(run, self.saver.close())
        except Exception as err:
            if failing is None:
                raise
            run.log.say(f"pgs: the checkpoint written in the background failed as well: {err}")
