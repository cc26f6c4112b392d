"""The rank side of tests/integration/test_fsdp_release.py: gradient release per FSDP2 unit on 2 gloo ranks.

Not a test module.  Started as ``python tests/integration/fsdp_release_harness.py release OUT`` once
per rank with torchrun's environment; reuses the loop and the data of tests/integration/fsdp_harness.py.
Scenario ``offload``: the state in host memory per rank (tests/integration/test_fsdp_offload.py;
``cuda_offload``: the same on one GPU over NCCL).
Scenario ``cuda``: one rank on one GPU over NCCL (tests/integration/test_fsdp_release.py's CUDA test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

import pgs.func as pf
from pgs.runtime.store import dcp
from pgs.runtime.dist import fsdp as D

HERE = Path(__file__).resolve().parent
STEPS = 10


def _harness():
    spec = importlib.util.spec_from_file_location("pgs_test_fsdp_harness", HERE / "fsdp_harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _harness()

#: name -> (chain factory, tied head)
CHAINS = {
    "adamw": H.CHAINS["adamw"],  # tied head
    "lion": H.CHAINS["lion"],  # untied head
    # collectives inside the hooks: reduce_sum (per-tensor norms), whole_tensors (Newton-Schulz)
    "clip_pt": (lambda: pf.chain(pf.clip_by_norm_per_tensor(0.05), pf.adamw(3e-3)), True),
    "muon": (lambda: pf.muon(1e-2, ns_dtype=torch.float32, weight_decay=0.1), False),
    # layer 0 holds a parameter that forward never uses: no gradient, so that unit steps at the
    # end of backward (zeros for the missing gradient, as bind_sharded)
    "adamw_unused": H.CHAINS["adamw"],
    # sublayer checkpoints with offloaded inputs through checkpointing._Recompute: each layer's
    # gradients come from a nested backward inside the outer one
    "adamw_ckpt": H.CHAINS["adamw"],
}


def build(name: str, ctx, *, release: bool, mixed_precision: str | None = None):
    from pgs.runtime.optim.sharded_bind import bind_sharded
    from pgs.runtime.optim.sharded_release import ShardedGradientRelease

    factory, tied = CHAINS[name]
    model = H.tiny_model(tied).to(ctx.device)
    if name.endswith("_unused"):
        model.model.layers[0].register_parameter("pgs_unused", torch.nn.Parameter(torch.ones(8, 4)))
    if name.endswith("_ckpt"):
        from pgs.runtime.model.layers import apply_activation_checkpointing

        apply_activation_checkpointing(model, "sublayer", offload=True)
    model = D.shard_model(model, ctx.mesh, mixed_precision=mixed_precision)
    opt = ShardedGradientRelease(factory(), model) if release else bind_sharded(factory(), model)
    return model, opt


def train(model, opt, ctx, first: int, last: int, report: dict | None = None) -> None:
    """H.train's loop on ``ctx.device``, also recording whether any gradient survived a backward."""
    for step in range(first, last + 1):
        ids, pos, labels = (t.to(ctx.device) for t in H.block(H.global_batch(step), ctx.rank))
        n = D.global_count(H.valid(labels))
        H.micro_loss(model, ids, pos, labels, n).backward()
        if report is not None:
            left = [k for k, p in model.named_parameters() if p.grad is not None]
            report["grads_left"] = report.get("grads_left", 0) + len(left)
            report.setdefault("grad_norms", []).append(opt.metrics().grad_norm)
            report.setdefault("streamed", []).append(opt.last_streamed)
        opt.step()
        opt.zero_grad()


def train_bound(model, opt, ctx, first: int, last: int) -> list[float]:
    """The non-release sharded loop; returns the global gradient norm of every step."""
    norms = []
    for step in range(first, last + 1):
        ids, pos, labels = (t.to(ctx.device) for t in H.block(H.global_batch(step), ctx.rank))
        n = D.global_count(H.valid(labels))
        H.micro_loss(model, ids, pos, labels, n).backward()
        norms.append(opt.grad_norm())
        opt.step()
        opt.zero_grad()
    return norms


def scenario_release(ctx, out: str) -> dict:
    report: dict = {}
    for name in CHAINS:
        model, opt = build(name, ctx, release=True)
        info: dict = {}
        train(model, opt, ctx, 1, STEPS, info)
        released = H.full_params(model)
        model_b, opt_b = build(name, ctx, release=False)
        norms = train_bound(model_b, opt_b, ctx, 1, STEPS)
        bound = H.full_params(model_b)
        report[name] = {
            "max_abs_diff": max((released[k] - bound[k]).abs().max().item() for k in released),
            "grads_left": info["grads_left"],
            "release_steps": opt.steps,
            "units": len(opt.units),
            "streamed": info["streamed"],
            "counts": sorted({int(x) for s in opt.states.values() for p, x in pf.tree.leaves_with_paths(s)
                              if p.rsplit(".", 1)[-1] == "count"}),
        }
        report[name]["grad_norm_rel"] = max(abs(a - b) / b for a, b in zip(info["grad_norms"], norms))
        if name == "adamw":
            # DCP: save after 5 steps, resume into fresh objects, run to STEPS: bit-exact?
            model2, opt2 = build(name, ctx, release=True)
            train(model2, opt2, ctx, 1, 5)
            run_dir = os.path.join(out, "release_adamw")
            dcp.save(run_dir, 5, model=model2, optimizer=opt2, trainer={"next_step": 6})
            model3, opt3 = build(name, ctx, release=True)
            trainer = dcp.load(dcp.latest(run_dir), model=model3, optimizer=opt3)
            train(model3, opt3, ctx, trainer["next_step"], STEPS)
            again = H.full_params(model3)
            report["resume_max_abs_diff"] = max((released[k] - again[k]).abs().max().item() for k in released)
        if ctx.rank == 0:
            torch.save(released, os.path.join(out, f"release_{name}.pt"))
    return report


#: name -> (chain factory, tied head): the chains of the offloaded state on 2 ranks (fp32 and
#: 8-bit state; blocks of 64 are whole rows of every shard of the tiny model's matrices)
OFFLOAD_CHAINS = {
    "adamw": CHAINS["adamw"],
    "adamw8bit": (lambda: pf.adamw8bit(3e-3, weight_decay=0.1, block_size=64, min_8bit_size=64), True),
    "lion8bit": (lambda: pf.lion8bit(1e-3, weight_decay=0.1, block_size=64, min_8bit_size=64), False),
}


def build_offload(name: str, ctx, *, offload: bool, mixed_precision: str | None = None):
    """The sharded tiny model and its release: the state in host memory (``offload``) or on the device."""
    from pgs.runtime.optim.sharded_offload import ShardedOffloadedRelease
    from pgs.runtime.optim.sharded_release import ShardedGradientRelease

    factory, tied = OFFLOAD_CHAINS[name]
    model = D.shard_model(H.tiny_model(tied).to(ctx.device), ctx.mesh, mixed_precision=mixed_precision)
    return model, (ShardedOffloadedRelease if offload else ShardedGradientRelease)(factory(), model)


def _same_states(a, b) -> bool:
    la, lb = pf.tree.leaves(a.states), pf.tree.leaves(b.states)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(la, lb))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def scenario_offload(ctx, out: str) -> dict:
    """The state of each rank's shards in host memory (``ShardedOffloadedRelease``) against the
    on-device sharded release, STEPS steps per chain: weights and state; the host bytes of
    each rank; a DCP save after 5 steps resumed into a fresh offloaded release (and into an
    on-device one) and run to STEPS."""
    report: dict = {}
    for name in OFFLOAD_CHAINS:
        model, opt = build_offload(name, ctx, offload=True)
        info: dict = {}
        train(model, opt, ctx, 1, STEPS, info)
        got = H.full_params(model)
        model_b, opt_b = build_offload(name, ctx, offload=False)
        train(model_b, opt_b, ctx, 1, STEPS)
        homes = {h.untyped_storage().data_ptr() for h in opt.stager.host.values()}
        stats = opt.offload_stats()
        report[name] = {
            "max_abs_diff": _max_diff(got, H.full_params(model_b)), "state_equal": _same_states(opt, opt_b),
            "grads_left": info["grads_left"], "streamed": info["streamed"], "units": len(opt.units),
            "unannounced": opt.stager.unannounced, "step_extras": opt.step_extras, **stats,
            "on_device_state_bytes": opt_b.state_bytes(), "release_steps": opt.steps,
            "host_leaves": sum(len(lay.entries) for lay in opt.stager.layouts.values()),
            "state_on_host": all(x.untyped_storage().data_ptr() in homes for s in opt.states.values()
                                 for x in pf.tree.leaves(s) if x.dim() > 0),
        }
        if ctx.rank == 0:
            torch.save(got, os.path.join(out, f"offload_{name}.pt"))
        if name == "adamw8bit":
            model2, opt2 = build_offload(name, ctx, offload=True)
            train(model2, opt2, ctx, 1, 5)
            run_dir = os.path.join(out, "offload_adamw8bit")
            dcp.save(run_dir, 5, model=model2, optimizer=opt2, trainer={"next_step": 6})
            report["per_rank_keys"] = len(opt2.per_rank_keys())
            for key, offload in (("resume", True), ("resume_on_device", False)):
                model3, opt3 = build_offload(name, ctx, offload=offload)
                trainer = dcp.load(dcp.latest(run_dir), model=model3, optimizer=opt3)
                train(model3, opt3, ctx, trainer["next_step"], STEPS)
                report[f"{key}_max_abs_diff"] = _max_diff(got, H.full_params(model3))
                report[f"{key}_state_equal"] = _same_states(opt, opt3)
    return report


def scenario_cuda_offload(ctx, out: str) -> dict:
    """One GPU, NCCL, one rank: the offloaded sharded release's copies on side streams, ordered
    by events against FSDP2's reduce-scatter stream (where its hooks run), fp32 and bf16 mixed
    precision: weights and state against the on-device sharded release, and a DCP resume."""
    report: dict = {"backend": ctx.backend, "device": str(ctx.device)}
    for name in OFFLOAD_CHAINS:
        for mp in (None, "bf16"):
            model, opt = build_offload(name, ctx, offload=True, mixed_precision=mp)
            info: dict = {}
            train(model, opt, ctx, 1, STEPS, info)
            model_b, opt_b = build_offload(name, ctx, offload=False, mixed_precision=mp)
            train(model_b, opt_b, ctx, 1, STEPS)
            torch.cuda.synchronize()
            got = H.full_params(model)
            model2, opt2 = build_offload(name, ctx, offload=True, mixed_precision=mp)
            train(model2, opt2, ctx, 1, 5)
            run_dir = os.path.join(out, f"cuda_offload_{name}_{mp or 'fp32'}")
            dcp.save(run_dir, 5, model=model2, optimizer=opt2, trainer={"next_step": 6})
            model3, opt3 = build_offload(name, ctx, offload=True, mixed_precision=mp)
            trainer = dcp.load(dcp.latest(run_dir), model=model3, optimizer=opt3)
            train(model3, opt3, ctx, trainer["next_step"], STEPS)
            torch.cuda.synchronize()
            report[f"{name}_{mp or 'fp32'}"] = {
                "max_abs_diff": _max_diff(got, H.full_params(model_b)), "state_equal": _same_states(opt, opt_b),
                "resume_max_abs_diff": _max_diff(got, H.full_params(model3)),
                "resume_state_equal": _same_states(opt, opt3), "grads_left": info["grads_left"],
                "page_locked": opt.stager.page_locked, "unannounced": opt.stager.unannounced,
                "finite": all(bool(torch.isfinite(v).all()) for v in got.values()),
            }
    return report


def scenario_cuda(ctx, out: str) -> dict:
    """One GPU, NCCL, one rank (``D.init(single=True)``): FSDP2's reduce-scatter and the
    release's steps on CUDA streams.  For AdamW (tied) and Lion (untied), fp32 and bf16 mixed
    precision: 10 steps with release against 10 of ``bind_sharded``, a DCP resume of the
    release run; rank 0's row block of tests/integration/fsdp_harness.py's batches."""
    report: dict = {"backend": ctx.backend, "device": str(ctx.device)}
    for name in ("adamw", "lion"):
        for mp in (None, "bf16"):
            key = f"{name}_{mp or 'fp32'}"
            model, opt = build(name, ctx, release=True, mixed_precision=mp)
            info: dict = {}
            train(model, opt, ctx, 1, STEPS, info)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            released = H.full_params(model)
            model_b, opt_b = build(name, ctx, release=False, mixed_precision=mp)
            train_bound(model_b, opt_b, ctx, 1, STEPS)
            bound = H.full_params(model_b)
            start = {k: p.detach().to(ctx.device) for k, p in H.tiny_model(CHAINS[name][1]).named_parameters()}
            model2, opt2 = build(name, ctx, release=True, mixed_precision=mp)
            train(model2, opt2, ctx, 1, 5)
            run_dir = os.path.join(out, f"cuda_{key}")
            dcp.save(run_dir, 5, model=model2, optimizer=opt2, trainer={"next_step": 6})
            model3, opt3 = build(name, ctx, release=True, mixed_precision=mp)
            trainer = dcp.load(dcp.latest(run_dir), model=model3, optimizer=opt3)
            train(model3, opt3, ctx, trainer["next_step"], STEPS)
            again = H.full_params(model3)
            report[key] = {
                "max_abs_diff": max((released[k] - bound[k]).abs().max().item() for k in released),
                "resume_max_abs_diff": max((released[k] - again[k]).abs().max().item() for k in released),
                "moved": max((released[k] - start[k]).abs().max().item() for k in released),
                "finite": all(bool(torch.isfinite(v).all()) for v in released.values()),
                "grads_left": info["grads_left"],
                "streamed": info["streamed"],
                "units": len(opt.units),
            }
    return report


def offload(out) -> None:
    """The ``offload`` scenario as one step of tests/integration/runs_harness.py: the start of the
    2 ranks that tests/integration/test_fsdp_offload.py shares with its ``pgs run``s."""
    main(["offload", str(out)])


def main(argv: list[str]) -> int:
    name, out = argv[0], argv[1]
    torch.set_num_threads(1)
    ctx = D.init(single=name.startswith("cuda"))
    result = {"release": scenario_release, "offload": scenario_offload, "cuda": scenario_cuda,
              "cuda_offload": scenario_cuda_offload}[name](ctx, out)
    result.update(rank=ctx.rank, world=ctx.world_size)
    with open(os.path.join(out, f"result_{name}_rank{ctx.rank}.json"), "w") as handle:
        json.dump(result, handle)
    D.shutdown()
    return 0


if __name__ == "__main__":
    _code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
