"""The product path as the benchmark: ``pgs run`` on a shipped spec, and its HF peer on the same data.

For each spec this runs, in one call and one after the other:

1. ``pgs run SPEC`` through the real CLI (a child process: spec -> data pipeline -> loop ->
   checkpoint), for ``--steps`` steps with one checkpoint save inside the run, and reads
   everything from the run itself: ``metrics.jsonl``'s per-step records (time stamps, tokens,
   step seconds, peak allocated and reserved memory) and the launch-to-first-step time.  The
   device's used memory (``nvidia-smi``, CUDA context included) is sampled beside it.
2. The HF peer (``--peer``, a ``bench/sft_step.py`` HF variant: ``hf_liger_causal`` for the packed
   0.6B, ``hf_compiled_ac`` for the 4B) on the same spec's model config and the same batches
   from pgs's data pipeline (``TrainStream``), the trained-token masks as HF labels; rows are fed
   as single causal sequences for ``_causal`` variants (the usual peer setup), else with positions
   restarting per document.
3. Optionally (``--harness VARIANT``) ``bench/sft_step.py``'s own figure for the same shape
   (random tokens already on the device), the number the product is held to.

"mean" is the tokens of every step from ``--skip``+1 to N over the sum of their periods
(stalls included; the run's clock restarts after a checkpoint save, as the HF peer's timer
does not see one); "wall" is the same tokens over the run's time stamps, the checkpoint save
included; "median" and "max/median" are over the steps' periods.  Results go to ``--out`` as JSON and a Markdown table on stdout::

    python -m bench product --spec specs/qwen3_0.6b_packed.toml --peer hf_liger_causal \\
        --harness pgs_release_noac_varlen --steps 40
    python -m bench product --spec specs/qwen3_4b_12gib.toml --peer hf_compiled_ac --steps 40

Several GPUs (``--nproc 1,2``; issue 28): for each N, ``pgs run SPEC --nproc N`` (the CLI's
torchrun launch, FSDP2, the spec's ``[memory]`` less :data:`MULTI_PROCESS` where N > 1, one
checkpoint save, at the end) with the same ``--set``s, and with ``--peer titan_fsdp`` the torchtitan-style FSDP2 + fused AdamW
peer (``bench/titan_fsdp.py``) on the same model config and rows per rank.  Weak scaling: the
spec's global ``train.batch_size`` is multiplied by N, so every rank trains on the micro-batch
one process does.  The loop's step records are rank 0's, with ``tokens`` summed over the ranks,
so "mean" tok/s is global and per GPU is it over N; ``scaling`` is a setup's per-GPU tok/s over
its own N = 1 row of the same call, ``vs titan`` pgs's per-GPU tok/s over the peer's at the same
N; every rank's peak memory comes from the run's ``done`` record (the peer gathers its own)::

    python -m bench product --spec specs/qwen3_4b_12gib.toml --nproc 1,2 --peer titan_fsdp --steps 20 --skip 4

The N = 1 row is the spec as shipped (one process, no FSDP2): the one-GPU product the scaling
is held against.  Not run on GPUs yet (written before a multi-GPU machine was lent).

On the CPU, ``--small`` runs the same path at a tiny shape (a smoke run of this script; gloo
with ``--nproc``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.ranks import STOP_GRACE_S, add_scaling, run_bounded, torchrun_json  # noqa: E402 - the multi-process launch and figures

#: The smoke shape (``--small``).  Its rows are 512 tokens, so it reads the quickstart's short chats:
#: the recipes' bench chats are mostly longer than that, and a pack window would read and tokenize
#: the whole file (5,662 chats, ~25 s on the CPU) to find 512 that fit.
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.head_dim=16",
         "model.config.vocab_size=512", "data.max_seq_len=512", "model.dtype=float32", "memory.compile_layers=false",
         "memory.stochastic_rounding=false", "memory.tied_slabs=0", "memory.offload_checkpoints=false",
         "memory.device_limit_gib=0",
         "schedule.warmup=2", "train.device=auto", 'data.sources=["pgs:quickstart/train.jsonl"]']


#: ``[memory]`` overrides for ``--nproc N`` with N > 1: the one-GPU 4B recipe's options that a
#: sharded run refuses or that size the one-GPU run only (docs/distributed.md, "The multi-GPU
#: bench").  A ``--set`` of the same key wins.
MULTI_PROCESS = [
    # the row-slab step of the tied weight runs on one process (make_optimizer refuses it: under
    # FSDP2 the embedding's whole gradient is reduce-scattered anyway)
    "memory.tied_slabs=0",
    # the 12.5 GiB cap is the one-GPU budget (bf16 weights, no masters); FSDP2 keeps fp32 sharded
    # masters (4 B/param / N) and the root unit gathered, more than that at N = 2 by estimate
    "memory.device_limit_gib=0",
]


def spec_batch(spec: str, args) -> tuple[int, int]:
    """The spec's ``train.batch_size`` and ``train.grad_accum`` with this call's overrides."""
    from pgs.runtime.spec.load import load_spec

    loaded = load_spec(spec, (SMALL if args.small else []) + args.set)
    return loaded.train.batch_size, loaded.train.grad_accum


def world_sets(spec: str, args, nproc: int) -> list[str]:
    """The overrides of a run on ``nproc`` processes: one checkpoint save, at the end (the
    mid-run save left out, so that every N and the peer fit one call's budget), and
    :data:`MULTI_PROCESS` where N > 1, both before the call's own ``--set``s, which win; then
    the global batch ``nproc`` times the spec's, so that each rank trains on the micro-batch one
    process does (weak scaling)."""
    batch, _ = spec_batch(spec, args)
    return (["checkpoint.every=0"] + (MULTI_PROCESS if nproc > 1 else []) + args.set
            + [f"train.batch_size={batch * nproc}"])


def per_world(summary: dict, records: list[dict], nproc: int) -> dict:
    """The figures of a run on ``nproc`` processes: the step records' ``tokens`` are the whole
    step's (summed over the ranks by the loop), so the summary's tok/s is global, and per GPU is
    it over N.  Every rank's peak memory comes from the run's ``done`` record (CUDA only)."""
    out: dict = {"world_size": nproc}
    if summary.get("mean_tok_s"):
        out.update(global_tok_s=summary["mean_tok_s"], per_gpu_tok_s=summary["mean_tok_s"] / nproc)
    done = next((r for r in reversed(records) if r.get("event") == "done"), {})
    if "mem_gib_per_rank" in done:
        out["max_allocated_gib_per_rank"] = done["mem_gib_per_rank"]
        out["max_reserved_gib_per_rank"] = done["reserved_gib_per_rank"]
    elif "mem_gib" in done:  # one process: its own peaks
        out["max_allocated_gib_per_rank"], out["max_reserved_gib_per_rank"] = [done["mem_gib"]], [done["reserved_gib"]]
    return out


def run_titan(spec: str, args, nproc: int) -> dict:
    """The torchtitan-style FSDP2 + AdamW peer (``bench/titan_fsdp.py``) on ``nproc`` processes,
    the same model config and rows per rank as ``pgs run --nproc N``."""
    batch, accum = spec_batch(spec, args)
    sets = (SMALL if args.small else []) + args.set + [f"train.batch_size={batch * nproc}"]
    flags = ["--spec", spec, "--rows", str(batch // accum), "--steps", str(args.steps), "--skip", str(args.skip)]
    flags += [x for s in sets for x in ("--set", s)]
    out = torchrun_json(os.path.join(ROOT, "bench", "titan_fsdp.py"), nproc, flags,
                        timeout=getattr(args, "timeout", None))
    out["setup"] = f"titan_fsdp --nproc {nproc}"
    return out


class GpuMemory:
    """Samples the device's used memory (nvidia-smi: CUDA contexts included) every ``period`` s."""

    def __init__(self, period: float = 0.5):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.strip().splitlines()[0]) / 1024))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


#: step-record keys averaged into the summary where a run logs them (gradient release, the offload)
HOST_KEYS = ("release/host_ms", "offload/host_ms", "offload/fetches", "offload/unannounced")


def summarize(records: list[dict], skip: int) -> dict:
    """Throughput and step-time figures of a run's step records (see the module docstring)."""
    steps = [r for r in records if "loss" in r and "tokens" in r]
    if len(steps) <= skip + 1:
        return {"error": f"only {len(steps)} steps logged"}
    timed = steps[skip:]
    span = timed[-1]["time"] - timed[0]["time"]
    tokens = sum(r["tokens"] for r in timed[1:])
    periods = [r["step_seconds"] for r in timed]
    median = statistics.median(periods)
    out = {"steps": len(steps), "mean_tok_s": sum(r["tokens"] for r in timed) / sum(periods),
           "wall_tok_s": tokens / span if span > 0 else None,
           "median_step_s": median, "median_tok_s": statistics.median(r["tokens"] for r in timed) / median,
           "max_over_median": max(periods) / median, "slow_steps": [r["step"] for r in timed if r["step_seconds"] > 1.5 * median],
           "mean_tokens_per_step": tokens / max(len(timed) - 1, 1)}
    for key in HOST_KEYS:  # where a step's host time goes (docs/runtime.md), mean over the timed steps
        values = [r[key] for r in timed if key in r]
        if values:
            out["mean " + key] = sum(values) / len(values)
    peaks = [r for r in records if "mem_gib" in r]
    if peaks:
        out["max_allocated_gib"] = max(r["mem_gib"] for r in peaks)
        out["max_reserved_gib"] = max(r["reserved_gib"] for r in peaks)
    return out


def markdown_table(rows: list[dict], columns: list[tuple], setup=lambda r: r["setup"],
                   inline_errors: bool = False) -> str:
    """A Markdown table of result rows: ``columns`` as ``(header, key, format)``, ``key`` a row's
    key or a function of the row (``format`` "" for text; a missing or None value is an empty
    cell).  The first column is ``setup``: the row's ``setup``, or what the function ``setup``
    makes of the row (``None``: no such column).  A row with an ``error`` shows the error's last
    line instead of its cells, unless ``inline_errors`` (the caller's columns or ``setup`` show it)."""
    def cell(r: dict, key, fmt: str) -> str:
        value = key(r) if callable(key) else r.get(key)
        return "" if value is None else format(value, fmt)

    lead = [] if setup is None else ["setup"]
    lines = ["| " + " | ".join(lead + [h for h, _, _ in columns]) + " |", "|---" * (len(lead) + len(columns)) + "|"]
    for r in rows:
        first = [] if setup is None else [str(setup(r))]
        if r.get("error") and not inline_errors:
            last = (str(r["error"]).strip().splitlines() or [""])[-1][:150]
            lines.append("| " + "".join(f"{c} | " for c in first) + f"error: {last} " + "|" * len(columns))
            continue
        lines.append("| " + " | ".join(first + [cell(r, key, fmt) for _, key, fmt in columns]) + " |")
    return "\n".join(lines)


def read_metrics(run_dir: str) -> list[dict]:
    """The records of a run's metrics.jsonl (a line cut short by a kill is left out; none before
    the run wrote its first)."""
    records = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def run_pgs(spec: str, args, workdir: str, nproc: int | None = None) -> dict:
    """``pgs run`` in a child process; the figures from its metrics.jsonl.  ``args.timeout``
    (optional, seconds): the child is killed after it, and the steps it logged are summarized
    (``timed_out`` says so).  ``nproc``: ``pgs run --nproc N`` with :func:`world_sets` (None:
    one process, as before ``--nproc`` existed)."""
    run_dir = os.path.join(workdir, "run" if nproc is None else f"run-{nproc}")
    shutil.rmtree(run_dir, ignore_errors=True)  # the bench's own scratch folder: a fresh run each time
    every = max(1, args.steps // 2)
    sets = [f"train.steps={args.steps}", f"checkpoint.dir={run_dir}", f"checkpoint.every={every}",
            "checkpoint.keep=1", "train.log_every=5"] + (SMALL if args.small else [])
    sets += args.set if nproc is None else world_sets(spec, args, nproc)
    cmd = [sys.executable, "-m", "pgs", "run", spec] + [x for s in sets for x in ("--set", s)]
    if nproc is not None:
        cmd += ["--nproc", str(nproc)]
    if args.profile:
        cmd += ["--profile", args.profile]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    timeout = getattr(args, "timeout", None)
    with GpuMemory() if args.nvidia_smi else _Null() as smi:
        # torchrun's workers stop with it (bench/ranks.py) within a short grace; one process is
        # killed at the timeout.  Either way what it logged so far still counts.
        if nproc is not None:
            env = dict(env, PGS_SHUTDOWN_GRACE_S=str(STOP_GRACE_S // 2))
        proc, timed_out = run_bounded(cmd, timeout, env=env, grace=STOP_GRACE_S if nproc is not None else 0)
        if timed_out:
            proc.returncode = None
    out = {"setup": "pgs run" if nproc is None else f"pgs run --nproc {nproc}", "spec": spec,
           "command": " ".join(cmd[1:]), "returncode": proc.returncode}
    if nproc is not None:
        out["world_size"] = nproc
    if timed_out:
        out["timed_out"] = f"{'stopped' if nproc is not None else 'killed'} after {timeout} s"
    if proc.returncode != 0 and not (timed_out and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        out["error"] = (out.get("timed_out", "") + "\n" + (proc.stderr or proc.stdout)[-3000:]).strip()
        return out
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r and "tokens" in r]
    out["launch_to_step1_s"] = steps[0]["time"] - started if steps else None
    out.update(summarize(records, args.skip))
    if nproc is not None:
        out.update(per_world(out, records, nproc))
    out["first_steps_s"] = [round(r["step_seconds"], 3) for r in steps[:args.skip]]
    out["step_s"] = [round(r["step_seconds"], 3) for r in steps[args.skip:]]
    out["last_loss"] = steps[-1]["loss"] if steps else None
    if smi is not None and smi.samples:
        out["nvidia_smi_max_gib"] = max(g for _, g in smi.samples)
        train_end = steps[-1]["time"] if steps else started
        out["nvidia_smi_train_max_gib"] = max((g for t, g in smi.samples if t <= train_end), default=None)
    out["stderr_tail"] = proc.stderr[-1500:]
    if args.profile:
        out["profile_dir"] = os.path.join(run_dir, "profile")
    return out


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_peer(spec_path: str, args) -> dict:
    """The HF peer (a bench/sft_step.py HF variant) on the spec's model and data, in this process."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import sft_step  # noqa: E402 - the bench's variants, so that peers are built one way everywhere

    from pgs.runtime.data import TrainStream
    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(spec_path, (SMALL if args.small else []) + args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = dict(spec.model.config)
    tokenizer = load_tokenizer(spec.model.tokenizer)
    stream = TrainStream(spec.data, tokenizer)
    name = args.peer
    causal = name.endswith("_causal")
    peer_args = argparse.Namespace(compile_backend=None, compile_options=None, small=args.small, triton_on_cpu=False,
                                   mlp_tiles=4, defer=False, no_defer=False)
    out: dict = {"setup": name, "spec": spec_path}
    model = sft_step.build(table, device, "sdpa" if causal or "_varlen" not in name else "varlen",
                           experts=spec.model.experts_implementation)
    out["experts_implementation"] = getattr(model.config, "_experts_implementation", None)  # None: a dense model
    if not (spec.model.dtype == "bfloat16"):
        model = model.to(getattr(torch, spec.model.dtype))
    hf_step, _opt = sft_step.variant_setup(sft_step.split_switches(name)[0], model, peer_args, 0)

    def batch_for_hf():
        b = stream.next_batch(spec.train.batch_size)
        ids = b.input_ids.to(device, non_blocking=True)
        # pgs's labels are shifted targets; HF shifts inside its loss, so give them unshifted
        labels = torch.full_like(b.labels, -100)
        labels[:, 1:] = b.labels[:, :-1]
        pos = (torch.arange(ids.shape[1]).expand_as(ids) if causal else b.position_ids).to(device)
        return ids, pos, labels.to(device), b.num_tokens

    times, tokens, losses = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        ids, pos, labels, n = batch_for_hf()
        t0 = time.perf_counter()
        loss = hf_step(ids, pos, labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(n)
        losses.append(loss)
    timed, counted = times[args.skip:], tokens[args.skip:]
    median = statistics.median(timed)
    out.update(mean_tok_s=sum(counted) / sum(timed), median_step_s=median, max_over_median=max(timed) / median,
               steps=args.steps, first_loss=float(losses[0]), last_loss=float(loss), step_s=[round(t, 3) for t in timed],
               mean_tokens_per_step=sum(counted) / len(counted))
    if device.type == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def run_harness(args) -> dict:
    """bench/sft_step.py's own figure for the spec's shape (random tokens on the device)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "harness.json")
        shape = "tiny" if args.small else args.harness_shape
        cmd = [sys.executable, os.path.join(ROOT, "bench", "sft_step.py"), "--shapes", shape, "--only", args.harness,
               "--steps", "8", "--warmup", "3", "--out", path] + (["--small"] if args.small else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            return {"setup": f"bench/sft_step.py {args.harness}", "error": proc.stderr[-2000:]}
        result = json.load(open(path))["results"][0]
    return {"setup": f"bench/sft_step.py {args.harness}", "mean_tok_s": result.get("tok_s"),
            "max_allocated_gib": result.get("peak_gib"), "error": result.get("error")}


#: The table's columns: (header, result key, format).
COLUMNS = [("mean tok/s", "mean_tok_s", ",.0f"), ("wall tok/s", "wall_tok_s", ",.0f"),
           ("median step s", "median_step_s", ".3f"), ("max/median", "max_over_median", ".2f"),
           ("max alloc GiB", "max_allocated_gib", ".3f"), ("max reserved GiB", "max_reserved_gib", ".3f"),
           ("nvidia-smi GiB", "nvidia_smi_max_gib", ".2f"), ("launch→step 1 s", "launch_to_step1_s", ".1f")]


def _per_rank(key: str):
    def cell(r: dict):
        values = r.get(key)
        return None if not values or None in values else " / ".join(f"{v:.2f}" for v in values)
    return cell


#: The columns of a ``--nproc`` call: global and per-GPU tok/s, the efficiency against the same
#: setup's one-process row, pgs against the titan peer at the same N, every rank's peaks.
WORLD_COLUMNS = [("GPUs", "world_size", "d"), ("global tok/s", "global_tok_s", ",.0f"),
                 ("tok/s per GPU", "per_gpu_tok_s", ",.0f"), ("scaling", "scaling_efficiency", ".3f"),
                 ("vs titan", "vs_titan", ".2f"), ("median step s", "median_step_s", ".3f"),
                 ("max/median", "max_over_median", ".2f"),
                 ("max alloc GiB per rank", _per_rank("max_allocated_gib_per_rank"), ""),
                 ("max reserved GiB per rank", _per_rank("max_reserved_gib_per_rank"), ""),
                 ("launch→step 1 s", "launch_to_step1_s", ".1f")]


def table(results: list[dict], columns: list[tuple] = COLUMNS) -> str:
    return markdown_table(results, columns)


def run_worlds(args, workdir: str) -> list[dict]:
    """``--nproc``: ``pgs run --nproc N`` and (``--peer titan_fsdp``) the titan peer for each N,
    in ``--order``; each setup's scaling against its own N = 1 row, pgs against the peer."""
    pgs_rows, titan_rows = [], []
    for which in args.order.split(","):
        for n in args.nproc:
            if which == "pgs":
                pgs_rows.append(run_pgs(args.spec, args, workdir, n))
            elif which == "peer" and args.peer == "titan_fsdp":
                titan_rows.append(run_titan(args.spec, args, n))
            else:
                continue
            print(json.dumps({k: v for k, v in (pgs_rows + titan_rows)[-1].items()
                              if k not in ("step_s", "stderr_tail")}), flush=True)
    for rows in (pgs_rows, titan_rows):
        add_scaling(rows, "per_gpu_tok_s")
    for row in pgs_rows:
        peer = next((t for t in titan_rows if t.get("world_size") == row.get("world_size")), None)
        if peer is not None and row.get("per_gpu_tok_s") and peer.get("per_gpu_tok_s"):
            row["vs_titan"] = row["per_gpu_tok_s"] / peer["per_gpu_tok_s"]
    return pgs_rows + titan_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="a shipped spec (specs/*.toml)")
    p.add_argument("--steps", type=int, default=40, help="steps of each setup")
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the figures")
    p.add_argument("--peer", default="", help="the HF peer: a bench/sft_step.py HF variant (empty: none)")
    p.add_argument("--harness", default="", help="also bench/sft_step.py's figure for this variant")
    p.add_argument("--harness-shape", default="qwen3-0.6b", help="its shape (bench/sft_step.py SHAPES)")
    p.add_argument("--profile", default="", metavar="A:B", help="pgs run --profile A:B (trace in the run folder)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec overrides for both")
    p.add_argument("--order", default="pgs,peer,harness", help="which setups, in which order")
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run of this script)")
    p.add_argument("--workdir", default="", help="where the run folder goes (default: a temporary folder)")
    p.add_argument("--out", default="", help="JSON results")
    p.add_argument("--nproc", default="", metavar="LIST",
                   help="pgs run --nproc N for each N (e.g. 1,2): global and per-GPU tok/s, scaling against N = 1")
    p.add_argument("--timeout", type=float, default=None, help="seconds each run may take (killed after)")
    args = p.parse_args(argv)
    args.nproc = [int(n) for n in args.nproc.split(",") if n.strip()]
    if args.peer == "titan_fsdp" and not args.nproc:
        p.error("--peer titan_fsdp runs beside --nproc (e.g. --nproc 1,2)")
    if args.nproc and args.peer not in ("", "titan_fsdp"):
        p.error(f"--peer {args.peer}: with --nproc the peer is titan_fsdp (or none)")
    args.nvidia_smi = not args.small
    workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-product-")
    results = run_worlds(args, workdir) if args.nproc else []
    for which in args.order.split(",") if not args.nproc else ["harness"]:
        before = len(results)
        if which == "pgs":
            results.append(run_pgs(args.spec, args, workdir))
        elif which == "peer" and args.peer:
            results.append(run_peer(args.spec, args))
        elif which == "harness" and args.harness:
            results.append(run_harness(args))
        if len(results) > before:
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_s", "stderr_tail")}), flush=True)
    print(table(results, WORLD_COLUMNS if args.nproc else COLUMNS))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"spec": args.spec, "steps": args.steps, "skip": args.skip, "nproc": args.nproc,
                       "results": results}, handle, indent=1)
        for folder in (r["profile_dir"] for r in results if r.get("profile_dir")):
            copy_profile(folder, os.path.splitext(args.out)[0])
    return 0 if all(not r.get("error") for r in results) else 1


#: the summaries of ``pgs run --profile`` (pgs/runtime/loop/trace.py) that a suite keeps; the
#: trace itself stays in the run folder
PROFILE_SUMMARIES = ("ops.txt", "streams.txt")


def copy_profile(folder: str, stem: str) -> list[str]:
    """Copy a run's profile summaries (``folder``: its ``profile/``) to ``<stem>-ops.txt`` and
    ``<stem>-streams.txt`` (``streams.txt`` exists on CUDA only); returns the paths written."""
    written = []
    for name in PROFILE_SUMMARIES:
        if os.path.exists(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), f"{stem}-{name}")
            written.append(f"{stem}-{name}")
    return written


def keep_profile(out: dict, run_dir: str, stem: str, profile: str) -> None:
    """A ``pgs run --profile`` row's summaries kept as ``<stem>-*.txt`` (``out["profile"]``: the
    paths), or ``out["error"]`` when the run wrote none (and had no error of its own)."""
    out["profile"] = copy_profile(os.path.join(run_dir, "profile"), stem)
    if not out["profile"] and "error" not in out:
        out["error"] = f"--profile {profile}: the run wrote no profile summary"


def check_profile(parser, profile: str, steps: int) -> None:
    """``parser.error`` (exit 2, one line) unless ``profile`` is empty or ``A:B`` within ``steps``."""
    if not profile:
        return
    from pgs.errors import SpecError
    from pgs.runtime.loop.trace import parse_steps

    try:
        last = parse_steps(profile)[1]
    except SpecError as err:
        parser.error(str(err))
    if last > steps:
        parser.error(f"--profile {profile}: step {last} is past --steps {steps}")


if __name__ == "__main__":
    raise SystemExit(main())
