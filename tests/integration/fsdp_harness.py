"""The rank side of tests/integration/test_fsdp.py: a minimal distributed training loop and its scenarios.

Not a test module (it has no tests); ``tests/integration/test_fsdp.py`` imports its helpers for the
single-process reference and starts it as ``python tests/integration/fsdp_harness.py SCENARIO OUT``
once per rank, with the environment torchrun would give (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT).

The loop is the distributed skeleton of ``pgs.runtime.loop.train``: final hidden states through
the root's forward, the chunked loss divided by the GLOBAL valid-token count, one MAX
all-reduce of the control flags per step (``control.agree``), skip / halt / stop decided on
the agreed flags only, DCP checkpoints.  Data: a deterministic synthetic global batch per
step; rank r takes row block r.  The single-process reference runs the same row blocks as
micro-batches (gradient accumulation), in rank order.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import pgs.func as pf
from pgs.errors import EXIT_SKIP_CAP, HaltError
from pgs.func.base import MATRIX, EmptyState, Transform
from pgs.func.losses import token_loss
from pgs.func.muon_direction import newton_schulz
from pgs.runtime.loop import control
from pgs.runtime.store import dcp
from pgs.runtime.dist import fsdp as D
from pgs.runtime.model.build import final_hidden

# tests/tiny.py, also when this file runs as a rank's script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import from_config, tiny_config  # noqa: E402

VOCAB, SEQ, ROWS, WORLD = 64, 16, 2, 2  # ROWS rows per rank, WORLD ranks in the tests
STEPS = 20


def tiny_model(tied: bool = True):
    cfg = tiny_config(vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=tied)
    return from_config(cfg, seed=0, init_dtype=torch.float32, fork_rng=True, attn_implementation="sdpa")


def global_batch(step: int):
    """(ids, position_ids, labels) of the whole step: WORLD * ROWS rows.  Every 7th step the
    last rank's rows are all masked (a rank with 0 valid tokens must add 0, not 0/0)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (WORLD * ROWS, SEQ), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    cut = torch.randint(0, SEQ // 2, (WORLD * ROWS,), generator=g)
    for i, c in enumerate(cut.tolist()):
        labels[i, :c] = -100  # ranks get different valid counts
    if step % 7 == 3:
        labels[(WORLD - 1) * ROWS:] = -100
    pos = torch.arange(SEQ).expand(WORLD * ROWS, SEQ).contiguous()
    return ids, pos, labels


def block(batch, rank: int):
    return tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in batch)


def whole_matrix_transform() -> Transform:
    """A stand-in for Muon's matrix stage: u ← NS5(u) (fp32) for every matrix, via the hook."""

    def init(params, **extra):
        return EmptyState()

    def update(updates, state, params=None, *, ctx=pf.NO_CONTEXT, **extra):
        pairs = [(p, u) for p, u in pf.leaves_with_paths(updates) if u is not None and u.ndim >= 2]
        op = lambda fulls: [newton_schulz(f, dtype=torch.float32) for f in fulls]  # noqa: E731
        hook = ctx.whole_tensors
        mats = [u for _, u in pairs]
        done = op(mats) if hook is None else hook(op, [p for p, _ in pairs], mats)
        new = dict(zip([p for p, _ in pairs], done))
        return {p: new.get(p, u) for p, u in updates.items()}, state

    return Transform(init, update, name="whole_matrix_ns", locality=MATRIX, flat_ok=False)


CHAINS = {
    "adamw": (lambda: pf.adamw(3e-3, weight_decay=0.1), True),
    "lion": (lambda: pf.lion(1e-3, weight_decay=0.1), False),  # untied head
    "adamw_clip": (lambda: pf.chain(pf.clip_by_global_norm(0.05), pf.adamw(3e-3, weight_decay=0.1)), True),
    "matrix": (lambda: pf.chain(whole_matrix_transform(), pf.scale_by_learning_rate(1e-2)), True),
    # per-tensor norms from shard-local sums + all-reduce (adagc's clip, hyperball's sphere)
    "hyperball": (lambda: pf.chain(pf.adagc(warmup_steps=3), pf.scale_by_adam(b2=0.95), pf.hyperball(1e-2)), True),
    "muon": (lambda: pf.muon(1e-2, ns_dtype=torch.float32, weight_decay=0.1), False),
}
TRUST = ("whole_matrix_ns",)


def micro_loss(model, ids, pos, labels, n_global: int):
    h = final_hidden(model, ids, pos)
    weight = model.get_output_embeddings().weight
    result = token_loss(h, weight, labels)
    return result.loss_sum / max(n_global, 1)


def valid(labels) -> int:
    return int((labels != -100).sum())


# -- the single-process reference --------------------------------------------------------
def reference(name: str, steps: int, *, start=None):
    """A plain (unsharded) run of ``steps`` steps, each one micro-batch per rank block."""
    from pgs.runtime.optim.bound import bind

    factory, tied = CHAINS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, first = start if start is not None else (tiny_model(tied), None, 1)
        opt = opt or bind(factory(), model)
        for step in range(first, first + steps):
            batch = global_batch(step)
            n = valid(batch[2])
            for r in range(WORLD):
                micro_loss(model, *block(batch, r), n).backward()
            opt.step()
            opt.zero_grad()
        return model, opt
    finally:
        torch.set_num_threads(threads)


def full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


# -- the distributed loop ----------------------------------------------------------------
def build(name: str, ctx):
    factory, tied = CHAINS[name]
    model = D.shard_model(tiny_model(tied), ctx.mesh)
    from pgs.runtime.optim.sharded_bind import bind_sharded

    return model, bind_sharded(factory(), model, trust=TRUST)


def train(model, opt, ctx, first: int, last: int, *, run_dir: str | None = None, signals=None,
          skips: control.SkipCounter | None = None, nan_steps=(), nan_rank: int = -1, slow: float = 0.0,
          save_every: int = 0):
    """Steps first..last (inclusive).  Returns ("done" | "stop", step, exit code)."""
    skips = skips or control.SkipCounter(max_consecutive=2)
    for step in range(first, last + 1):
        batch = global_batch(step)
        ids, pos, labels = block(batch, ctx.rank)
        n = D.global_count(valid(labels))
        loss = micro_loss(model, ids, pos, labels, n)
        if step in nan_steps and ctx.rank == nan_rank:
            loss = loss * float("nan")
        loss.backward()
        nonfinite = not math.isfinite(float(loss.detach()))
        flags = control.agree([signals.received if signals else 0, 0, int(nonfinite), 0])
        if flags[control.NONFINITE]:
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        skips.record(bool(flags[control.NONFINITE]))
        if run_dir:
            with open(os.path.join(run_dir, f"progress_rank{ctx.rank}"), "w") as handle:
                handle.write(str(step))
        verdict = skips.verdict()
        if verdict is not None:
            raise control.halt(run_dir, verdict, step=step, exit_code=EXIT_SKIP_CAP)
        if flags[control.SIGNAL] or (save_every and step % save_every == 0):
            dcp.save(run_dir, step, model=model, optimizer=opt, trainer={"next_step": step + 1})
        if flags[control.SIGNAL]:
            return "stop", step, control.exit_code_for_signal(flags[control.SIGNAL])
        if slow:
            time.sleep(slow)
    return "done", last, 0


# -- scenarios ---------------------------------------------------------------------------
def scenario_equivalence(ctx, out: str) -> dict:
    """Every chain for STEPS steps; sharded norms; DCP resume; HF export; 8-bit per-rank state."""
    report: dict = {}
    for name in CHAINS:
        model, opt = build(name, ctx)
        run_dir = os.path.join(out, name)
        if name == "adamw":
            train(model, opt, ctx, 1, 10)
            dcp.save(run_dir, 10, model=model, optimizer=opt, trainer={"next_step": 11})
            train(model, opt, ctx, 11, STEPS)
            final = full_params(model)
            # resume into fresh objects, run the same 10 steps: bit-exact?
            model2, opt2 = build(name, ctx)
            trainer = dcp.load(dcp.latest(run_dir), model=model2, optimizer=opt2)
            train(model2, opt2, ctx, trainer["next_step"], STEPS)
            again = full_params(model2)
            report["resume_max_abs_diff"] = max((final[k] - again[k]).abs().max().item() for k in final)
            report["resume_state_equal"] = all(
                torch.equal(a, b) for a, b in zip(pf.tree.leaves(opt.state), pf.tree.leaves(opt2.state)))
            # sharded per-tensor norms against the gathered tensors
            local = {n: p.to_local().detach() for n, p in model.named_parameters()}
            sharded = pf.per_tensor_sumsq(local, reduce_sum=opt.reduce_sum)
            whole = pf.per_tensor_sumsq(final)
            report["sumsq_max_rel_diff"] = max(((sharded[k] - whole[k]).abs() / whole[k]).item() for k in whole)
            dots = pf.per_tensor_dot(local, local, reduce_sum=opt.reduce_sum)
            report["dot_max_rel_diff"] = max(((dots[k] - whole[k]).abs() / whole[k]).item() for k in whole)
            gn = pf.global_norm(local, None, opt.reduce_sum)
            report["global_norm_rel_diff"] = abs(gn.item() - pf.global_norm(final).item()) / pf.global_norm(final).item()
            dcp.export_hf(model, None, os.path.join(out, "hf"), info={"step": STEPS})
            # the same, cut into shards with an index, as save_pretrained(max_shard_size=...) would
            dcp.export_hf(model, None, os.path.join(out, "hf_sharded"), info={"step": STEPS}, max_shard_size="4KB")
        else:
            train(model, opt, ctx, 1, STEPS)
            final = full_params(model)
        if ctx.rank == 0:
            torch.save(final, os.path.join(out, f"{name}.pt"))
    # 8-bit state of a shard: per-rank keys, bit-exact round trip on the same world size
    model, _ = build("adamw", ctx)
    from pgs.runtime.optim.sharded_bind import bind_sharded

    opt = bind_sharded(pf.lion8bit(1e-3, block_size=64, min_8bit_size=64), model)
    train(model, opt, ctx, 1, 2)
    dcp.save(os.path.join(out, "lion8bit"), 2, model=model, optimizer=opt, trainer={"next_step": 3})
    model2, _ = build("adamw", ctx)
    opt2 = bind_sharded(pf.lion8bit(1e-3, block_size=64, min_8bit_size=64), model2)
    dcp.load(os.path.join(out, "lion8bit", "step_2"), model=model2, optimizer=opt2)
    report["lion8bit_per_rank_keys"] = len(opt.per_rank_keys())
    report["lion8bit_state_equal"] = all(
        torch.equal(a, b) for a, b in zip(pf.tree.leaves(opt.state), pf.tree.leaves(opt2.state)))
    return report


def scenario_signal(ctx, out: str) -> dict:
    """Train slowly until a SIGTERM reaches one rank; both stop at the same step and save."""
    model, opt = build("adamw", ctx)
    with control.StopSignals() as signals:
        kind, step, code = train(model, opt, ctx, 1, 10_000, run_dir=out, signals=signals, slow=0.05)
    return {"kind": kind, "step": step, "exit_code": code, "received": signals.received}


def scenario_nan(ctx, out: str) -> dict:
    """Resume the stopped run; rank 1's loss turns NaN from the 2nd step on: both halt (81)."""
    model, opt = build("adamw", ctx)
    folder = dcp.latest(out)
    trainer = dcp.load(folder, model=model, optimizer=opt)
    first = trainer["next_step"]
    result = {"resumed_from": os.path.basename(folder), "first": first}
    nan = set(range(first + 1, first + 100))
    train(model, opt, ctx, first, first + 50, run_dir=out, nan_steps=nan, nan_rank=1)
    result["kind"] = "done"
    return result


#: activation checkpointing under FSDP2 (applied before sharding, as ``train.setup`` does):
#: (policy, offload, fast_recompute) per mode; "none" is the reference
CHECKPOINT_MODES = {"none": None, "full": ("full", False, True), "full_torch": ("full", False, False),
                    "sublayer_offload": ("sublayer", True, True)}


def scenario_checkpointing(ctx, out: str) -> dict:
    """AdamW, 3 steps, each checkpoint mode; rank 0 saves the gathered weights per mode."""
    from pgs.runtime.model.layers import apply_activation_checkpointing
    from pgs.runtime.optim.sharded_bind import bind_sharded

    for mode, how in CHECKPOINT_MODES.items():
        model = tiny_model(True)
        if how is not None:
            policy, offload, fast = how
            apply_activation_checkpointing(model, policy, offload=offload, fast_recompute=fast)
        model = D.shard_model(model, ctx.mesh)
        opt = bind_sharded(CHAINS["adamw"][0](), model)
        train(model, opt, ctx, 1, 3)
        final = full_params(model)
        if ctx.rank == 0:
            torch.save(final, os.path.join(out, f"ckpt_{mode}.pt"))
    return {}


SCENARIOS = {"equivalence": scenario_equivalence, "signal": scenario_signal, "nan": scenario_nan,
             "checkpointing": scenario_checkpointing}


def main(argv: list[str]) -> int:
    """``NAME[+NAME...] OUT``: the scenarios one after the other on one process group (one start
    of the ranks for several), each's result in ``OUT/result_NAME_rankR.json``; the first that
    ends with a non-zero code ends the run."""
    names, out = argv[0].split("+"), argv[1]
    torch.set_num_threads(1)
    ctx = D.init()
    code = 0
    for name in names:
        try:
            result = SCENARIOS[name](ctx, out)
            code = int(result.get("exit_code", 0))
        except HaltError as err:
            result, code = {"kind": "halt", "message": str(err)}, err.exit_code
        result.update(rank=ctx.rank, world=ctx.world_size)
        with open(os.path.join(out, f"result_{name}_rank{ctx.rank}.json"), "w") as handle:
            json.dump(result, handle)
        if code:
            break
    D.shutdown()
    return code


if __name__ == "__main__":
    # os._exit: skip C++ static destructors, which can abort a gloo worker at exit under load
    # ("terminate called without an active exception") after its result is written.
    _code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
