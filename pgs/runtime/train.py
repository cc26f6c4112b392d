"""The training loop behind ``pgs run spec.toml``.

Read top to bottom: :func:`run` sets a run up (:func:`setup`), optionally restores a
checkpoint, then repeats :func:`train_step` until ``train.steps``.  Everything with state of
its own lives in a component module: the model (``model``), the optimizer
(``bind``), the data (``data``), checkpoints (``checkpoint``), stops, skips and halts
(``control``), metrics (``metrics``), evaluation (``evaluate``) and the HF export
(``export``).

Gradient accumulation divides every micro-batch's summed loss by the number of valid tokens
of the *whole* optimizer step (known from the labels before any forward), so the step's
gradient is the gradient of one token-mean over all its micro-batches, and a micro-batch
whose labels are all masked adds 0, not 0/0.

Test hooks (environment): ``PGS_TEST_NAN_STEPS=5,6`` makes those steps' losses NaN;
``PGS_TEST_CRASH_AT=checkpoint_write:<step>`` SIGKILLs the process halfway through writing
that step's checkpoint, ``PGS_TEST_CRASH_AT=step:<step>`` right after that step's update; ``PGS_TEST_SLOW_STEP=<seconds>`` sleeps after each step.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from typing import Any

import attrs
import numpy as np
import torch

from pgs.errors import EXIT_OK, EXIT_WALL_BUDGET, HaltError, PreflightRefused
from pgs.func.losses import neftune, token_loss
from pgs.runtime import checkpoint as ckpt
from pgs.runtime import control
from pgs.runtime.bind import BoundOptimizer, bind
from pgs.runtime.data import EvalStream, TrainStream, require_packing_isolation
from pgs.runtime.evaluate import eval_loss, read_samples, task_accuracy, task_checker
from pgs.runtime.export import export_hf
from pgs.runtime.metrics import MetricsLog
from pgs.runtime.model import build_model, final_hidden, freeze, load_tokenizer, output_head, parameter_bytes

#: Eval prompts answered by greedy generation when the eval data has a known checker.
ACCURACY_SAMPLES = 48


@attrs.define
class Run:
    """Everything a run holds between steps; the counters are what a checkpoint records."""

    spec: Any
    run_dir: str
    device: torch.device
    model: Any
    tokenizer: Any
    bound: BoundOptimizer
    stream: TrainStream
    objective: Any
    total_steps: int
    micro_batch: int
    noise: torch.Generator | None
    skips: control.SkipCounter
    chain_has_norm: bool = False
    step: int = 0
    trained_tokens: int = 0
    best: float | None = None
    best_step: int | None = None
    entropy_low: bool = False
    log: MetricsLog | None = None

    def counters(self) -> dict:
        return {
            "trained_tokens": self.trained_tokens,
            "best": self.best,
            "best_step": self.best_step,
            "entropy_low": self.entropy_low,
            "skips": self.skips.state_dict(),
            "data": self.stream.state_dict(),
        }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _steps_per_epoch(spec, tokenizer) -> int:
    from pgs.runtime.data.inspect import dataset_stats

    sequences = dataset_stats(spec.data, tokenizer).sequences
    return max(1, math.ceil(sequences / spec.train.batch_size))


def setup(spec) -> Run:
    """Model, tokenizer, bound optimizer and data stream of a fresh run (nothing restored)."""
    seed_everything(spec.train.seed)
    device = _device(spec.train.device)
    m = spec.model
    tokenizer = load_tokenizer(m.tokenizer or m.path)
    config = None
    if m.config is not None:
        config = {k: v for k, v in m.config.items() if not (k == "vocab_size" and not v)}
    model = build_model(path=m.path, config=config, dtype=m.dtype, attn_implementation=m.attn_implementation,
                        init_seed=m.init_seed, vocab_size=len(tokenizer)).to(device)
    if spec.data.packing:
        verdict = require_packing_isolation(model, spec.data.allow_packing_leakage)
        if not verdict.isolates:
            print(f"pgs: warning: {verdict.reason}; packed documents will see each other", file=sys.stderr)
    freeze(model, m.freeze if isinstance(m.freeze, str) else list(m.freeze))
    total = spec.total_steps(None if spec.train.steps is not None else _steps_per_epoch(spec, tokenizer))
    bound = bind(spec.build_chain(total), model, compile=spec.optimizer.compile, jit=spec.optimizer.jit)
    stream = TrainStream(spec.data, tokenizer)
    noise = None
    if spec.loss.neftune_alpha > 0:
        noise = torch.Generator(device=device).manual_seed(spec.train.seed)
    return Run(
        spec=spec, run_dir=spec.checkpoint.dir, device=device, model=model, tokenizer=tokenizer, bound=bound,
        stream=stream, objective=spec.build_objective(), total_steps=total,
        micro_batch=spec.train.batch_size // spec.train.grad_accum, noise=noise,
        skips=control.SkipCounter(spec.train.max_consecutive_skips, spec.train.max_skip_fraction),
        chain_has_norm="grad_norm" in bound.last_metrics(),
    )


def restore(run: Run, folder: str) -> None:
    """Continue from a verified checkpoint folder: weights, chain state, RNG, data, counters."""
    saved = ckpt.load(folder)
    ckpt.load_model_state(run.model, saved.model, saved.trainer.get("aliases", {}))
    run.bound.load_state_dict(saved.optimizer)
    ckpt.restore_rng(saved.rng, run.noise)
    t = saved.trainer
    run.stream.load_state_dict(t["data"])
    run.skips.load_state_dict(t["skips"])
    run.step = saved.step
    run.trained_tokens = int(t["trained_tokens"])
    run.best, run.best_step, run.entropy_low = t["best"], t["best_step"], bool(t["entropy_low"])


def save(run: Run) -> str:
    """Write ``step_<N>`` (durably), then purge old ones beyond ``checkpoint.keep``."""
    step = run.step
    folder = ckpt.save(
        run.run_dir, step, model=run.model, optimizer_state=run.bound.state_dict(),
        rng=ckpt.capture_rng(run.noise), trainer=run.counters(), spec_toml=run.spec.to_toml(),
        crash_hook=lambda stage: stage == "optimizer" and control.crash_point("checkpoint_write", step),
    )
    ckpt.purge(run.run_dir, run.spec.checkpoint.keep)
    return folder


def _loss(run: Run, batch, n_valid_global: int, poison: bool):
    """Forward + backward of one micro-batch; returns its detached (loss_sum, entropy_sum, valid)."""
    dev = run.device
    ids, pos, labels = batch.input_ids.to(dev), batch.position_ids.to(dev), batch.labels.to(dev)
    embed_noise = None
    if run.noise is not None:
        lengths = torch.tensor([int(c[-1]) for c in batch.cu_seqlens], device=dev)
        embed_noise = lambda e: neftune(e, run.spec.loss.neftune_alpha, generator=run.noise,  # noqa: E731
                                        training=True, lengths=lengths)
    h = final_hidden(run.model, ids, pos, embed_noise=embed_noise)
    weight, bias, softcap = output_head(run.model)
    loss = run.spec.loss
    result = token_loss(h, weight, labels, backend=loss.backend, objective=run.objective, bias=bias,
                        softcap=softcap, z_loss=loss.z_loss, chunk_size=loss.chunk_size)
    loss_sum = result.loss_sum * float("nan") if poison else result.loss_sum
    (loss_sum / max(n_valid_global, 1)).backward()
    entropy = result.entropy_sum if result.entropy_sum is not None else torch.zeros(())
    return float(loss_sum.detach()), float(entropy), int(result.num_valid)


def train_step(run: Run, signals: control.StopSignals, wall: control.WallClock) -> tuple[dict, list[int]]:
    """One optimizer step (or a skipped one); returns its metrics and the agreed flags."""
    started = time.perf_counter()
    batches = [run.stream.next_batch(run.micro_batch) for _ in range(run.spec.train.grad_accum)]
    n_valid = sum(b.num_trained_tokens for b in batches)
    poison = (run.step + 1) in control.hook_steps("PGS_TEST_NAN_STEPS")
    loss_sum = entropy_sum = 0.0
    for batch in batches:
        l, e, _ = _loss(run, batch, n_valid, poison)
        loss_sum, entropy_sum = loss_sum + l, entropy_sum + e
    nonfinite = not math.isfinite(loss_sum) or n_valid == 0
    flags = control.agree([signals.received, wall.spent(), nonfinite, 0])
    record: dict[str, Any] = {}
    if flags[control.NONFINITE]:
        run.bound.zero_grad()
    else:
        # The chain's clip keeps the pre-clip norm in its state; measure it only when it does not.
        grad_norm = None if run.chain_has_norm else run.bound.grad_norm()
        run.bound.step()
        run.bound.zero_grad()
        opt = run.bound.last_metrics()
        flags[control.SPIKE] = control.agree([0, 0, 0, int(opt.get("spike", False))])[control.SPIKE]
        record.update(lr=opt.get("lr"), grad_norm=opt.get("grad_norm", grad_norm))
    skipped = bool(flags[control.NONFINITE] or flags[control.SPIKE])
    run.skips.record(skipped)
    run.step += 1
    run.trained_tokens += 0 if flags[control.NONFINITE] else n_valid
    elapsed = time.perf_counter() - started
    tokens = sum(b.num_tokens for b in batches)
    record = {
        "step": run.step,
        "loss": loss_sum / max(n_valid, 1),
        **{k: v for k, v in record.items() if v is not None},
        "entropy": entropy_sum / max(n_valid, 1),
        "valid_tokens": n_valid,
        "trained_tokens": run.trained_tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "skipped": int(skipped),
        "skipped_total": run.skips.skipped,
        "spike": int(bool(flags[control.SPIKE])),
    }
    return record, flags


def evaluate(run: Run) -> dict:
    """Eval loss (and task accuracy where a checker knows the data) at the current step."""
    spec = run.spec
    out: dict[str, Any] = {"step": run.step}
    batches = EvalStream(spec.data, run.tokenizer, max(1, run.micro_batch))
    out.update(eval_loss(run.model, batches, backend="chunked", chunk_size=spec.loss.chunk_size))
    samples = read_samples(spec.data.eval, ACCURACY_SAMPLES)
    checker = task_checker(samples)
    if checker is not None:
        prompt, is_correct = checker
        out.update(task_accuracy(run.model, run.tokenizer, samples, prompt=prompt, is_correct=is_correct))
    return out


def _improves(metric: str, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if "accuracy" in metric else value < best


def eval_and_keep_best(run: Run) -> None:
    result = evaluate(run)
    run.log.write(result)
    run.log.say("eval  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in result.items()))
    metric = run.spec.checkpoint.best_metric
    if metric and metric in result and _improves(metric, result[metric], run.best):
        run.best, run.best_step = float(result[metric]), run.step
        export_hf(run.model, run.tokenizer, os.path.join(run.run_dir, "best"),
                  info={"step": run.step, metric: run.best})


def watch_entropy(run: Run, record: dict) -> None:
    """Warn once each time the mean next-token entropy falls under ``train.entropy_warn``."""
    threshold = run.spec.train.entropy_warn
    if record.get("skipped") or not threshold:
        return
    low = record["entropy"] < threshold
    if low and not run.entropy_low:
        run.log.say(f"pgs: warning: mean next-token entropy {record['entropy']:.3f} fell under "
                    f"train.entropy_warn = {threshold} at step {run.step} (collapse?)")
        run.log.write({"step": run.step, "event": "entropy_low", "entropy": record["entropy"]})
    run.entropy_low = low


def run(spec, *, resume: str | None = None, spec_path: str | None = None) -> int:
    """Train ``spec`` to the end, or until a stop; returns the process exit code.

    ``resume``: None (fresh), ``"auto"`` (newest complete checkpoint in ``checkpoint.dir``,
    fresh if none) or a checkpoint folder.  Exit codes: 0 done, 128+signum after a signal,
    82 wall budget (both after a checkpoint), 81 skip cap (``HALT.json``), 83 preflight.
    """
    wall = control.WallClock(spec.train.max_wall_seconds or None)
    try:
        return _train(spec, resume, wall)
    except (HaltError, PreflightRefused) as err:
        print(f"pgs: {err}", file=sys.stderr, flush=True)
        return err.exit_code


def _train(spec, resume: str | None, wall: control.WallClock) -> int:
    run_dir = spec.checkpoint.dir
    r = setup(spec)
    state_bytes = sum(t.numel() * t.element_size() for t in r.bound.state_dict().values())
    control.preflight(run_dir, parameter_bytes(r.model) + state_bytes)
    ckpt.remove_stale_temporaries(run_dir)
    folder = ckpt.resolve(run_dir, resume)
    if folder is not None:
        restore(r, folder)
        MetricsLog.truncate_after(run_dir, r.step)
    spec.to_toml(os.path.join(run_dir, "spec.resolved.toml"))
    trackers = [name for name in ("wandb", "trackio") if getattr(spec.log, name, False)]
    r.log = MetricsLog(run_dir, total_steps=r.total_steps, print_every=spec.train.log_every, trackers=trackers,
                       config=spec.to_dict())
    if folder is not None:
        r.log.say(f"pgs: resumed from {folder} at step {r.step}")
        r.log.write({"step": r.step, "event": "resume", "from": folder})
    evals = bool(spec.data.eval) and spec.train.eval_every > 0
    slow = float(os.environ.get("PGS_TEST_SLOW_STEP", "0") or 0)
    try:
        with control.StopSignals() as signals:
            if evals and r.step == 0:
                eval_and_keep_best(r)
            r.log.start(r.step)
            while r.step < r.total_steps:
                record, flags = train_step(r, signals, wall)
                control.crash_point("step", r.step)
                r.log.step(record)
                if record["skipped"]:
                    r.log.write({"step": r.step, "event": "skip", "nonfinite": flags[control.NONFINITE],
                                 "spike": flags[control.SPIKE]})
                watch_entropy(r, record)
                verdict = r.skips.verdict()
                if verdict is not None:
                    raise control.halt(run_dir, verdict, step=r.step, details=r.skips.state_dict())
                if evals and (r.step % spec.train.eval_every == 0 or r.step == r.total_steps):
                    eval_and_keep_best(r)
                stop = flags[control.SIGNAL] or flags[control.WALL]
                every = spec.checkpoint.every
                if stop or (every and r.step % every == 0) or r.step == r.total_steps:
                    path = save(r)
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
                if slow:
                    time.sleep(slow)
            if spec.checkpoint.export:
                export_hf(r.model, r.tokenizer, os.path.join(run_dir, "final"), info={"step": r.step})
            r.log.write({"step": r.step, "event": "done"})
    finally:
        r.log.close()
    return EXIT_OK
