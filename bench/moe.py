"""Mixture-of-experts experts on the GPU: ``pgs run`` on OLMoE-1B-7B per expert implementation,
beside HF's own forward + backward + AdamW step with the same implementations, in one call.

transformers runs an MoE layer's experts one of several ways (``model.experts_implementation``,
docs/moe.md): ``eager`` loops over the experts that got tokens (two small matmuls each, 64
experts x 16 layers at OLMoE's shape), ``grouped_mm`` sorts the token-expert pairs by expert and
runs each projection as one grouped GEMM (``torch.nn.functional.grouped_mm`` /
``torch._grouped_mm``).  This suite answers whether the expert loop is the bottleneck and what the
grouped GEMM buys, inside pgs and inside HF alike.  For each implementation of ``--impls``
(default: ``eager`` and ``grouped_mm``, those of them the installed transformers has;
``batched_mm`` gathers every pair's expert weights, 275 GB a layer at 4096 tokens x top-8, and is
for short inputs only):

1. ``pgs run SPEC --set model.experts_implementation=IMPL`` (default ``specs/olmoe_1b_7b.toml``)
   through the real CLI in a child process, ``--steps`` steps, no checkpoint inside the run; the
   child is stopped as soon as its last step is logged (the final checkpoint, 28 GB here, is no
   part of the measurement: ``bench/long_context.py``'s ``run_child``); a record every step, the
   health summary (``train.health_every``) at the spec's own interval.  Figures from the run's
   own ``metrics.jsonl`` (``bench/product.py``'s ``summarize``: tokens/s over the steps after
   ``--skip``, step times, peak allocated / reserved memory) and the last step's router
   telemetry; the device's used memory sampled by ``nvidia-smi`` beside it.
2. The HF peer (``--peer``, a ``bench/sft_step.py`` HF variant, default ``hf_eager``:
   transformers' model and loss, no checkpointing, no compile, ``torch.optim.AdamW(fused=True)``)
   on the same model configuration and the same batches from pgs's data pipeline, with the same
   ``model.experts_implementation`` (``bench/product.py``'s ``run_peer``), in this process.

Each row says which implementation the model was built with (the build refuses a mismatch);
``vs eager`` is a setup's tokens/s over the same setup's ``eager`` row, ``vs HF`` a pgs row's over
the HF row of the same implementation.  The same init seed and batches give each side the same
step-1 loss under every implementation (up to the kernels' rounding); both sides seed their init
with 0 (the spec's ``init_seed``, ``sft_step.build``): on the CPU they start from the same weights
too (tests/integration/test_bench_moe.py; not checked on a GPU).  The JSON (``--out``) is
rewritten after every entry, a Markdown table goes to stdout::

    python -m bench moe                                  # eager and grouped_mm, 12 steps each
    python -m bench moe --impls grouped_mm --steps 30 --peer ""

``--profile A:B`` passes ``pgs run --profile A:B`` to every pgs run and copies each run's
``profile/ops.txt`` and ``profile/streams.txt`` (pgs/runtime/loop/trace.py: operators by device
and host time; per stream busy time and the compute stream's idle gaps) to
``<out stem>-<impl>-ops.txt`` / ``-streams.txt`` beside the JSON (``bench/product.py``'s
``copy_profile``).  The traced steps run under the profiler, so a profiled call's figures are
not the speed: run it apart::

    python -m bench moe --impls grouped_mm --steps 8 --skip 3 --profile 5:7 --out bench/results/moe-profile.json

On the CPU, ``--small`` runs the same path at a tiny shape (8 experts of 2, two layers): the
smoke run of this script (tests/integration/test_bench_moe.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

import long_context  # noqa: E402 - its child runner (stopped once the work is logged) and outcome
import product  # noqa: E402 - its run summary, metrics reader, HF peer and table

SPEC = "specs/olmoe_1b_7b.toml"
#: the implementations run by default, where the installed transformers has them
DEFAULT_IMPLS = ("eager", "grouped_mm")
#: the CPU smoke shape: product's tiny dense sizes, 8 experts of which 2 are active
SMALL = product.SMALL + ["model.config.num_experts=8", "model.config.num_experts_per_tok=2"]
#: the router telemetry kept from a run's last step (docs/moe.md, "Metrics")
TELEMETRY = ("moe/utilization", "moe/dead_frac", "moe/max_vio", "moe/lb_loss")


def available_impls() -> list[str]:
    """``DEFAULT_IMPLS`` that the installed transformers offers."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return []
    return [i for i in DEFAULT_IMPLS if i == "eager" or i in ALL_EXPERTS_FUNCTIONS.valid_keys()]


def health_every(spec_path: str, sets: list[str]) -> int:
    """The spec's own health-summary interval (``train.health_every``, 0: ``train.log_every``)
    with ``sets`` applied."""
    from pgs.runtime.spec.load import load_spec

    train = load_spec(spec_path, sets).train
    return train.health_every or train.log_every


def pgs_overrides(impl: str, args, run_dir: str) -> list[str]:
    """The ``--set`` list of one pgs entry: the implementation, the steps, no checkpoint inside
    the run, a warm-up that fits the few steps (pgs refuses one longer than the run), a record
    every step, and the health summary (its update ratio samples every weight before and after
    the step) at the spec's own interval, which would otherwise follow ``log_every`` to every
    step."""
    sets = (SMALL if args.small else []) + args.set
    return ([f"model.experts_implementation={impl}", f"train.steps={args.steps}", f"checkpoint.dir={run_dir}",
             "checkpoint.every=0", "checkpoint.export=false", "train.log_every=1", "train.eval_every=0",
             f"train.health_every={health_every(args.spec, sets)}",
             f"schedule.warmup={max(0, min(2, args.steps - 1))}"] + sets)


def run_pgs(impl: str, args, workdir: str) -> dict:
    """``pgs run`` with ``model.experts_implementation = impl``: figures from its metrics.jsonl."""
    run_dir = os.path.join(workdir, f"run_{impl}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "pgs", "run", args.spec]
    cmd += [x for s in pgs_overrides(impl, args, run_dir) for x in ("--set", s)]
    if args.profile:
        cmd += ["--profile", args.profile]
    out: dict = {"setup": f"pgs run {impl}", "side": "pgs", "experts_implementation": impl,
                 "command": "python -m pgs run " + " ".join(cmd[4:])}
    metrics = os.path.join(run_dir, "metrics.jsonl")

    def last_step_logged() -> bool:  # the last step's record is written before the final checkpoint
        return any(r.get("step") == args.steps and "loss" in r for r in product.read_metrics(run_dir))

    started = time.time()
    with product.GpuMemory() if args.nvidia_smi else contextlib.nullcontext() as smi:
        rc, output, timed_out = long_context.run_child(cmd, args.timeout, long_context.child_env(),
                                                       done=last_step_logged)
    out["returncode"] = rc
    out["status"], note = long_context.outcome(rc, output, timed_out, args.timeout)
    if note:
        out["error"] = note
    out["wall_s"] = round(time.time() - started, 1)
    records = product.read_metrics(run_dir)
    steps = [r for r in records if "loss" in r and "tokens" in r]
    if steps:  # a run cut short still logged its steps
        summary = product.summarize(records, args.skip)
        if "error" in summary and "error" not in out:
            out["error"] = summary["error"]
        out.update({k: v for k, v in summary.items() if k != "error"})
        out["launch_to_step1_s"] = steps[0]["time"] - started
        out["first_loss"], out["last_loss"] = steps[0]["loss"], steps[-1]["loss"]
        out["step_s"] = [round(r["step_seconds"], 3) for r in steps]
        out.update({k: steps[-1][k] for k in TELEMETRY if k in steps[-1]})
        shutil.copyfile(metrics, os.path.join(workdir, f"metrics_{impl}.jsonl"))
    elif "error" not in out:
        out["error"] = "no step logged: " + long_context._tail(output)
    if smi is not None and smi.samples:
        out["nvidia_smi_max_gib"] = max(g for _, g in smi.samples)
    if args.profile:  # the trace's summaries beside the JSON (or in the workdir), before the folder goes
        stem = f"{os.path.splitext(args.out)[0] if args.out else os.path.join(workdir, 'moe')}-{impl}"
        product.keep_profile(out, run_dir, stem, args.profile)
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: no part of the figures
    return out


def run_hf(impl: str, args) -> dict:
    """The HF peer with ``model.experts_implementation = impl`` on the spec's model and batches."""
    import torch

    peer = argparse.Namespace(small=False, peer=args.peer, steps=args.steps, skip=args.skip,
                              set=(SMALL if args.small else []) + args.set + [f"model.experts_implementation={impl}"])
    try:
        out = product.run_peer(args.spec, peer)
    except Exception as err:  # noqa: BLE001 - an OOM or a failing kernel is a result; the next setup runs
        out = {"error": f"{type(err).__name__}: {err}"}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out.update(setup=f"HF {impl} ({args.peer})", side="hf", requested=impl)
    out.setdefault("experts_implementation", impl)
    return out


def compare(results: list[dict]) -> None:
    """``vs_eager`` (tok/s over the same side's eager row) and, on pgs rows, ``vs_hf`` (over the
    HF row of the same implementation)."""
    rate = {(r["side"], r["experts_implementation"]): r.get("mean_tok_s") for r in results if not r.get("error")}
    for r in results:
        own = r.get("mean_tok_s")
        eager = rate.get((r["side"], "eager"))
        if own and eager:
            r["vs_eager"] = own / eager
        hf = rate.get(("hf", r["experts_implementation"]))
        if own and hf and r["side"] == "pgs":
            r["vs_hf"] = own / hf


#: The table's columns: (header, result key, format).
COLUMNS = [("experts", "experts_implementation", "s"), ("mean tok/s", "mean_tok_s", ",.0f"),
           ("median step s", "median_step_s", ".3f"), ("max/median", "max_over_median", ".2f"),
           ("vs eager", "vs_eager", ".2f"), ("vs HF", "vs_hf", ".2f"),
           ("max alloc GiB", "max_allocated_gib", ".2f"), ("max reserved GiB", "max_reserved_gib", ".2f"),
           ("nvidia-smi GiB", "nvidia_smi_max_gib", ".1f"), ("step-1 loss", "first_loss", ".4f"),
           ("last loss", "last_loss", ".4f")]


def write(args, results: list[dict]) -> None:
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"spec": args.spec, "steps": args.steps, "skip": args.skip, "impls": args.impls,
                   "peer": args.peer, "small": args.small, "profile": args.profile, "results": results},
                  handle, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=SPEC, help="the MoE spec (default: OLMoE-1B-7B's shipped spec)")
    p.add_argument("--impls", default=",".join(available_impls()),
                   help="expert implementations, comma-separated (default: eager and grouped_mm, those available)")
    p.add_argument("--steps", type=int, default=12, help="steps of each setup")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the figures")
    p.add_argument("--peer", default="hf_eager", help="the HF peer: a bench/sft_step.py HF variant (empty: none)")
    p.add_argument("--order", default="pgs,hf", help="which sides, in which order")
    p.add_argument("--timeout", type=float, default=300, help="seconds for each pgs run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec overrides for both sides")
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run of this script)")
    p.add_argument("--profile", default="", metavar="A:B",
                   help="pgs run --profile A:B: each pgs run's ops.txt and streams.txt beside the JSON")
    p.add_argument("--workdir", default="", help="where the run folders go (default: a temporary folder)")
    p.add_argument("--out", default="", help="JSON results")
    args = p.parse_args(argv)
    product.check_profile(p, args.profile, args.steps)
    args.impls = [i for i in args.impls.split(",") if i]
    if not args.impls:
        p.error("--impls: no expert implementation to run (this transformers has none to choose)")
    args.nvidia_smi = not args.small and shutil.which("nvidia-smi") is not None
    workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-moe-")
    results: list[dict] = []
    for side in args.order.split(","):
        for impl in args.impls:
            if side == "pgs":
                results.append(run_pgs(impl, args, workdir))
            elif side == "hf" and args.peer:
                results.append(run_hf(impl, args))
            else:
                continue
            compare(results)
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_s", "command")}), flush=True)
            write(args, results)
    print(product.markdown_table(results, COLUMNS))
    return 0 if results and all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
