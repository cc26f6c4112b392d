"""The benchmark suites and the one entry point that runs them: ``python -m bench SUITE [ARGS]``.

Each suite is one parameterised script of this folder; the entry point runs it as if it were
called directly (same interpreter, same arguments, the repository root on ``PYTHONPATH`` so
that child processes import the same ``pgs``), adding where its JSON goes:
``bench/results/<YYYY-MM-DD>-<suite>.json`` (``-2``, ``-3``, ... when that name is taken),
or ``--out PATH``.  Smoke runs (``--small``) go to a temporary folder unless ``--out`` or
``--results`` says otherwise, so that ``bench/results/`` holds only device measurements.

    python -m bench --list
    python -m bench optim-step                      # -> bench/results/<date>-optim-step.json
    python -m bench sft-step --shapes qwen3-4b --only pgs_release,hf_compiled_ac
    python -m bench --results /tmp/out loss-memory  # -> /tmp/out/<date>-loss-memory.json
    python -m bench sft-step --help                 # the suite's own arguments
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from dataclasses import dataclass

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")


@dataclass(frozen=True)
class Suite:
    name: str
    script: str  # file in bench/
    group: str
    summary: str
    positional_out: bool = False  # the script takes its JSON path as its first positional argument

    @property
    def path(self) -> str:
        return os.path.join(BENCH, self.script)


SUITES = {s.name: s for s in (
    Suite("optim-step", "optim_step.py", "optimizer step",
          "pgs compiled chains (fused AdamW/Lion kernels, generic graph, clip chain) vs torch.optim, "
          "Qwen3-1.7B tensor shapes"),
    Suite("optim-8bit", "optim_8bit.py", "optimizer step",
          "pgs 8-bit kernels and the 8-bit chain vs bitsandbytes and torch fused AdamW, "
          "isolated and back to back", positional_out=True),
    Suite("optim-muon", "muon_bench.py", "optimizer step",
          "batched Muon and its Newton-Schulz kernels vs torch.optim.Muon, Qwen3-1.7B hidden matrices",
          positional_out=True),
    Suite("sft-step", "sft_step.py", "SFT step",
          "one training step, HF baselines vs pgs variants, Qwen3-4B 1x4096 and Qwen3-0.6B 8x4096 packed"),
    Suite("sft-converge", "sft_converge.py", "SFT step",
          "short convergence check: pgs's memory-lean recipe vs HF AdamW on the same batches"),
    Suite("loss-memory", "loss_memory.py", "loss memory",
          "peak memory and time of one loss forward + backward per backend (dense, chunked, liger, cce)",
          positional_out=True),
    Suite("fsdp", "fsdp_step.py", "FSDP",
          "FSDP2 step throughput, 1 vs 2 GPUs, Qwen3-1.7B shape"),
    Suite("data", "data_pipeline.py", "data pipeline",
          "CPU throughput of TrainStream (tokenize, template, pack, collate) and StepLoader's overlap"),
    Suite("long-context", "long_context.py", "product",
          "peak memory and tok/s per row length (16k-128k) for Qwen3-0.6B/4B: pgs run's long-row recipe "
          "beside HF, each entry under a timeout, partial JSON after each"),
    Suite("product", "product.py", "product",
          "`pgs run` on a shipped spec (--spec) beside its HF peer and the sft-step harness, same batches; "
          "--nproc 1,2 --peer titan_fsdp: pgs run --nproc N beside torchtitan-style FSDP2, scaling per GPU"),
    Suite("preference", "preference.py", "product",
          "`pgs run` with [preference] DPO (cached reference) on a shipped recipe beside its SFT run and "
          "TRL's DPOTrainer, same pairs"),
    Suite("distill", "distill.py", "product",
          "on-policy distillation (GKD, lambda 1): `pgs run` with [distill] (0.6B student, 4B teacher) beside "
          "TRL's GKDTrainer, same chats; generated + trained tokens/s, peak memory, partial JSON after each"),
    Suite("generate", "generate.py", "product",
          "sampling completions (the distill loop's decode): pgs generate (static cache, CUDA-graph decode) "
          "beside transformers' generate, static and dynamic cache, Qwen3-0.6B shape; decode ms vs the byte floor"),
    Suite("moe", "moe.py", "product",
          "mixture-of-experts experts: `pgs run` on OLMoE-1B-7B per expert implementation (eager, grouped_mm) "
          "beside HF's own forward + backward + AdamW with the same implementations, same batches"),
    Suite("hybrid", "hybrid_packing.py", "product",
          "hybrid linear-attention models: `pgs run` on the Qwen3.5-4B recipe packed and isolated (fla's kernels "
          "given the boundaries) vs one document per row, beside HF's own step on one conversation per step"),
    Suite("offload", "offload_bench.py", "product",
          "optimizer state on the host: `pgs run` on the 8B 20 GiB spec beside HF compiled + AC + fused AdamW, "
          "the 4B recipe with and without offload, PCIe bandwidth; saves in the foreground and background, "
          "resume after a SIGKILL (--only)"),
)}


def listing() -> str:
    width = max(len(n) for n in SUITES)
    return "\n".join(f"{s.name:<{width}}  {s.group + ':':<16} {s.summary}" for s in SUITES.values())


def default_out(suite: str, folder: str, today: datetime.date | None = None) -> str:
    """``folder/<date>-<suite>.json``, or ``-2``, ``-3``, ... before ``.json`` when that file exists."""
    stem = os.path.join(folder, f"{(today or datetime.date.today()).isoformat()}-{suite}")
    path, n = stem + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}-{n}.json"
    return path


def _take_out(args: list[str]) -> tuple[str | None, list[str]]:
    """``--out PATH`` / ``--out=PATH`` taken out of ``args``: (PATH or None, the other args)."""
    rest, out, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == "--out" and i + 1 < len(args):
            out, i = args[i + 1], i + 2
            continue
        if a.startswith("--out="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return out, rest


def command(name: str, args: list[str], results: str | None = None,
            today: datetime.date | None = None) -> tuple[list[str], str | None]:
    """The command line that runs suite ``name`` with ``args``, and the JSON path it writes
    (None for ``--help``).  ``results``: the folder of the default path (default
    ``bench/results``, or a temporary folder for ``--small`` runs)."""
    suite = SUITES[name]
    args = list(args)
    if "-h" in args or "--help" in args:
        return [sys.executable, suite.path, *args], None
    out, args = _take_out(args)
    if out is None and suite.positional_out and args and not args[0].startswith("-"):
        out, args = args[0], args[1:]  # the script's own form: SCRIPT OUT.json [...]
    if out is None:
        if results is None:
            results = os.path.join(tempfile.gettempdir(), "pgs-bench") if "--small" in args else RESULTS
        out = default_out(name, results, today)
    argv = [out, *args] if suite.positional_out else [*args, "--out", out]
    return [sys.executable, suite.path, *argv], out


USAGE = """usage: python -m bench [--results DIR] SUITE [SUITE ARGS ...]
       python -m bench --list

Runs one benchmark suite; its JSON goes to bench/results/<YYYY-MM-DD>-<suite>.json unless
--out PATH (a suite argument) or --results DIR (the folder of the dated name) says otherwise.
`python -m bench SUITE --help` shows the suite's arguments.  Suites:

"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    results = None
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt == "--list":
            print(listing())
            return 0
        if opt in ("-h", "--help"):
            print(USAGE + listing())
            return 0
        if opt == "--results" and argv:
            results = argv.pop(0)
        elif opt.startswith("--results="):
            results = opt.split("=", 1)[1]
        else:
            print(f"unknown option {opt}\n\n{USAGE}{listing()}", file=sys.stderr)
            return 2
    if not argv or argv[0] not in SUITES:
        what = f"unknown suite {argv[0]!r}" if argv else "no suite given"
        print(f"{what}\n\n{USAGE}{listing()}", file=sys.stderr)
        return 2
    cmd, out = command(argv[0], argv[1:], results)
    if out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        print(f"[bench] {argv[0]} -> {out}", file=sys.stderr, flush=True)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths + [ROOT])
    os.execv(cmd[0], cmd)  # the script itself, as if called directly (signals and exit status are its own)
    return 1  # not reached
