"""Long sequences on one GPU: peak memory and tokens/s per row length, ``pgs run`` beside HF.

For each shape (``--shapes``: Qwen3-0.6B and Qwen3-4B, the shipped specs' models) and each row
length (``--lengths``, default 16k, 32k, 64k, 128k tokens), in one call:

1. ``pgs run`` on the shape's shipped spec (``specs/qwen3_0.6b_packed.toml``,
   ``specs/qwen3_4b_12gib.toml``) with the memory recipe for long rows (docs/memory.md):
   ``data.max_seq_len = L`` with ``truncation = "truncate"`` over a generated file of
   single-turn records a little longer than L tokens with the spec's tokenizer (``words_for``;
   so every row is one causal document of exactly L tokens, the case where
   attention is quadratic, as for the HF peer), ``memory.mlp_tiles`` (the MLP in token slices),
   ``loss.chunk_size`` (the chunked loss: no ``[L, V]`` logits), full activation checkpointing
   with the layer inputs offloaded to host memory, ``max_position_embeddings >= L``.  Figures
   from the run's own ``metrics.jsonl``: peak allocated / reserved memory and tokens/s of the
   steps after ``--skip``.
2. Each HF peer (``--peers``, ``bench/sft_step.py`` HF variants) on random tokens of one row of
   L tokens (positions 0..L-1, so transformers builds no mask and SDPA runs causal, the kernel
   PyTorch picks, as for pgs's one-document rows), the same model configuration as the spec's
   (``max_position_embeddings`` raised alike), in a child process.  Default ``hf_liger_ac``: HF
   with Liger's kernels and fused linear cross-entropy (no ``[L, V]`` logits either; the HF peer
   docs/performance.md's peer setup for Qwen3-0.6B), activation checkpointing of every layer, torch
   AdamW; ``hf_eager_ac`` is HF's own loss, whose fp32 ``[L, V]`` logits (74 GiB at 128k) are
   what stops it first.

3. With ``--seco CHUNK``, ``pgs run`` again with chunk-wise training (SeCO, docs/techniques/seco.md):
   the same recipe plus ``memory.seco_chunk = CHUNK`` (and ``tied_slabs = 0``,
   ``compile_layers = false``, which it refuses), setup ``pgs run seco``.  ``--cap GIB`` sets
   ``memory.device_limit_gib`` for both pgs setups (as on a card of that size); the lengths then
   climb until a setup does not fit (``oom``, or ``refused`` by the preflight's prediction) and the
   last line printed names the longest row each setup trained in the cap.

Every (setup, shape, length) is its own child process (its own process group) under
``--timeout`` seconds, and all of them under ``--budget`` seconds (an entry gets what is left;
one that would get less than 30 s is recorded as skipped).  Each entry's ``status``: ``ok``;
``oom`` (it does not fit: a result, with the peak reached before the failed allocation where the
child could read it; the longer rows of that setup and shape are then skipped); ``refused`` (pgs's
preflight, exit 83: the predicted peak is more than the device has free); ``timeout`` (the steps
logged before it still give tok/s and the peak; the note ends with the output's last lines); ``error`` (anything else, with the output's last
lines); ``skipped``.  A pgs run is stopped as soon as its last step is logged (the final
checkpoint it would write is no part of the measurement, and takes disk: 12 GB at 4B), and its
run folder is removed after its metrics are read (``metrics_<shape>_<length>.jsonl`` stays in the
work folder).  The JSON (``--out``) is rewritten after every entry, so a call cut short keeps
what it measured.  On the CPU, ``--small`` runs the same path at a tiny shape and short rows (a
smoke run of this script).

    python -m bench long-context --shapes qwen3-0.6b,qwen3-4b --lengths 16384,32768,65536,131072
    python -m bench long-context --shapes qwen3-4b --lengths 16384,32768,65536,131072 --peers= \
        --seco 4096 --cap 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # sft_step: the bench's HF variants, imported where used

from bench.product import markdown_table, read_metrics  # noqa: E402 - the bench's table format, metrics reader

SPECS = {"qwen3-0.6b": "specs/qwen3_0.6b_packed.toml", "qwen3-4b": "specs/qwen3_4b_12gib.toml"}
#: The long-row memory recipe (docs/memory.md) applied over each shipped spec.
RECIPE = ["memory.activation_checkpointing=full", "memory.offload_checkpoints=true", "train.batch_size=1", "train.grad_accum=1", "data.packing=false", "data.truncation=truncate",
          "train.eval_every=0", "checkpoint.every=0", "checkpoint.export=false",
          "memory.device_limit_gib=0"]  # the 4B spec's 12.5 GiB cap belongs to its 4k recipe, not to long rows
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.head_dim=16",
         "model.config.vocab_size=512", "model.dtype=float32", "memory.compile_layers=false",
         "memory.stochastic_rounding=false", "memory.offload_checkpoints=false", "memory.tied_slabs=0",
         "train.device=cpu"]


def long_texts(words: int, records: int, seed: int = 0):
    """``records`` texts of ``words`` words each (deterministic): two-letter syllables and numbers."""
    rng = random.Random(seed)
    vocab = [f"{a}{b}" for a in "abcdefghijklmnopqrstuvwxyz" for b in "aeiou"] + [str(i) for i in range(100)]
    for _ in range(records):
        yield " ".join(rng.choice(vocab) for _ in range(words))


def write_long_records(path: str, words: int, records: int, seed: int = 0) -> None:
    """``records`` prompt/completion records of about ``words`` words each (deterministic)."""
    with open(path, "w", encoding="utf-8") as handle:
        for text in long_texts(words, records, seed):
            handle.write(json.dumps({"prompt": "Continue.", "completion": text}) + "\n")


def words_for(tokens: int, tokenizer_path: str) -> int:
    """Words of ``write_long_records``'s text that make at least ``tokens`` tokens with this
    tokenizer (measured on a sample, 10% over): records sized for the row being run, not for the
    longest one (a record of the longest row's size is tokenized whole before it is cut to a
    shorter row's length)."""
    from pgs.runtime.model.loading import load_tokenizer

    sample = 2000
    (text,) = long_texts(sample, 1)
    per_word = len(load_tokenizer(tokenizer_path)(text, add_special_tokens=False)["input_ids"]) / sample
    return int(tokens * 1.1 / per_word) + 1


def _summary(records: list[dict], skip: int) -> dict:
    steps = [r for r in records if "loss" in r and "tokens" in r]
    out: dict = {"steps": len(steps), "skipped_steps": sum(int(r.get("skipped", 0) or 0) for r in steps)}
    timed = steps[skip:] or steps[-1:]
    if timed:
        out["tok_s"] = sum(r["tokens"] for r in timed) / sum(r["step_seconds"] for r in timed)
        out["median_step_s"] = statistics.median(r["step_seconds"] for r in timed)
        out["step_s"] = [round(r["step_seconds"], 4) for r in steps]  # every step, warm-up included
        out["tokens_per_row"] = timed[-1]["tokens"]
        out["last_loss"] = timed[-1]["loss"]
    peaks = [r for r in records if "mem_gib" in r]
    if peaks:
        out["max_allocated_gib"] = max(r["mem_gib"] for r in peaks)
        out["max_reserved_gib"] = max(r["reserved_gib"] for r in peaks)
    return out


def _tail(proc_out: str) -> str:
    lines = [x for x in (proc_out or "").strip().splitlines() if x.strip()]
    return " | ".join(lines[-3:])[-600:]


#: what an out-of-memory failure prints (torch's allocator, cuBLAS/cuDNN workspaces, the host)
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
               "out of memory")
#: pgs's exit code for a preflight refusal (docs/exit-codes.md)
EXIT_PREFLIGHT = 83


def outcome(returncode: int | None, output: str, timed_out: bool, timeout: float) -> tuple[str, str]:
    """``(status, note)`` of a child that exited with ``returncode`` after printing ``output``."""
    if timed_out:  # what it printed last says where it was (preflight, data, compilation, a step)
        return "timeout", f"timeout after {timeout:.0f} s" + (": " + _tail(output) if (output or "").strip() else "")
    if returncode == 0:
        return "ok", ""
    oom = next((line for line in (output or "").splitlines()[::-1] if any(m in line for m in OOM_MARKERS)), None)
    if oom is not None:
        return "oom", "does not fit: " + oom.strip()[:300]
    if returncode == EXIT_PREFLIGHT:
        return "refused", _tail(output)
    return "error", f"exit {returncode}: " + _tail(output)


#: the process groups of the children running now (killed if this process is terminated: they
#: run in groups of their own, which an outer ``timeout`` does not signal)
_CHILDREN: set[int] = set()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _on_terminate(signum, frame):
    for pid in list(_CHILDREN):
        _kill_group(pid)
    raise SystemExit(128 + signum)


def run_child(cmd: list[str], timeout: float, env: dict, done=None) -> tuple[int | None, str, bool]:
    """Run ``cmd`` in its own process group: ``(returncode or None, stdout + stderr, timed out)``.

    ``done()`` (polled every second) True ends the child early (the whole group, SIGKILL) as a
    success; past ``timeout`` the group is killed and the output so far is kept."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _CHILDREN.add(proc.pid)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + timeout
    timed_out = finished_early = False
    while proc.poll() is None:
        if time.time() > deadline:
            timed_out = True
            break
        if done is not None and done():
            finished_early = True
            break
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        _kill_group(proc.pid)
        proc.wait()
    _CHILDREN.discard(proc.pid)
    reader.join(timeout=10)
    return (0 if finished_early else proc.returncode), "".join(chunks), timed_out


def child_env() -> dict:
    """The environment of a child: this one's, the repository first on ``PYTHONPATH`` and the rest
    kept (device.sh installs the GPU extras, Liger among them, into a folder on ``PYTHONPATH``)."""
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")


def mlp_tiles(length: int) -> int:
    """``memory.mlp_tiles`` for rows of ``length`` tokens: slices of about 8k tokens (at least 2)."""
    return max(2, length // 8192)


def pgs_overrides(length: int, data: str, steps: int, chunk: int, run_dir: str, small: bool = False) -> list[str]:
    """The ``--set`` list of the pgs entry: the shipped spec with the long-row recipe at ``length``.

    ``schedule.warmup`` is cut to fit the few steps (the shipped specs' 10 warm-up steps are
    more than a run of ``steps`` < 10, which pgs refuses); the positions cover the row."""
    return RECIPE + [f"data.max_seq_len={length}", f"data.sources=[{{path = \"{data}\"}}]",
                     f"model.config.max_position_embeddings={max(length, 40960)}", f"memory.mlp_tiles={mlp_tiles(length)}",
                     f"loss.chunk_size={chunk}", f"train.steps={steps}", f"schedule.warmup={max(0, min(2, steps - 1))}",
                     f"checkpoint.dir={run_dir}", "train.log_every=1"] + (SMALL if small else [])


def seco_overrides(chunk: int) -> list[str]:
    """The ``--set`` list that turns the pgs entry chunk-wise (``--seco``): what SeCO refuses off."""
    return [f"memory.seco_chunk={chunk}", "memory.tied_slabs=0", "memory.compile_layers=false"]


def run_pgs(shape: str, length: int, data: str, args, workdir: str, timeout: float, seco: int = 0) -> dict:
    run_dir = os.path.join(workdir, f"run_{shape}_{length}{'_seco' if seco else ''}")
    shutil.rmtree(run_dir, ignore_errors=True)
    tiles = mlp_tiles(length)
    sets = pgs_overrides(length, data, args.steps, args.chunk, run_dir, args.small) + args.set
    sets += seco_overrides(seco) if seco else []
    sets += [f"memory.device_limit_gib={args.cap:g}"] if args.cap else []
    cmd = [sys.executable, "-m", "pgs", "run", SPECS[shape]] + [x for s in sets for x in ("--set", s)]
    out = {"setup": "pgs run seco" if seco else "pgs run", "shape": shape, "length": length, "mlp_tiles": tiles,
           "seco_chunk": seco, "cap_gib": args.cap,
           "command": "python -m pgs run " + " ".join(cmd[4:])}

    def last_step_logged() -> bool:  # the last step's record is written before the final checkpoint
        return any(r.get("step") == args.steps and "loss" in r for r in read_metrics(run_dir))

    started = time.time()
    rc, output, timed_out = run_child(cmd, timeout, child_env(), done=last_step_logged)
    out["returncode"] = rc
    out["status"], note = outcome(rc, output, timed_out, timeout)
    if note:
        out["error"] = note
    out["wall_s"] = round(time.time() - started, 1)
    records = read_metrics(run_dir)  # a run cut short still logged its steps
    if records:
        out.update(_summary(records, args.skip))
        metrics = os.path.join(run_dir, "metrics.jsonl")
        shutil.copyfile(metrics, os.path.join(workdir, f"metrics_{shape}_{length}{'_seco' if seco else ''}.jsonl"))
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: 12 GB at 4B, and no part of the figures
    return out


def peer_one(variant: str, shape: str, length: int, steps: int, skip: int, small: bool) -> dict:
    """One HF peer at one length, in this process (the child of :func:`run_peer`).  Prints a
    JSON line after every step (the parent keeps the last one if it has to stop this child);
    an out-of-memory error ends it with ``status = "oom"`` and the peak reached."""
    import torch

    import sft_step  # noqa: E402 - the bench's HF variants, built one way everywhere

    table, _batch, _seq = (sft_step.SMALL_SHAPES["tiny"] if small else sft_step.SHAPES[shape])
    table = dict(table, max_position_embeddings=max(length, int(table.get("max_position_embeddings", 0) or 0)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict = {"steps": 0, "tokens_per_row": length}

    def report(status: str) -> dict:
        out["status"] = status
        if device.type == "cuda":
            out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        print(json.dumps(out), flush=True)
        return out

    times = []
    try:
        model = sft_step.build(table, device, "sdpa")
        if small:
            model = model.float()
        out["attn_implementation"] = model.config._attn_implementation
        peer_args = argparse.Namespace(compile_backend=None, compile_options=None, small=small, triton_on_cpu=False,
                                       mlp_tiles=4, defer=False, no_defer=False)
        step, _opt = sft_step.variant_setup(sft_step.split_switches(variant)[0], model, peer_args, 0)
        gen = torch.Generator().manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            ids = torch.randint(0, table["vocab_size"], (1, length), generator=gen).to(device)
            pos = torch.arange(length, device=device)[None]
            t0 = time.perf_counter()
            loss = step(ids, pos, ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            timed = times[skip:] or times[-1:]
            out.update(steps=len(times), tok_s=length * len(timed) / sum(timed), median_step_s=statistics.median(timed),
                       step_s=[round(t, 4) for t in times], last_loss=float(loss))
            report("running")
    except torch.OutOfMemoryError as err:
        out["error"] = "does not fit: " + str(err).splitlines()[0][:300]
        return report("oom")
    return report("ok")


def run_peer(variant: str, shape: str, length: int, args, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-one", variant, "--shapes", shape,
           "--lengths", str(length), "--steps", str(args.steps), "--skip", str(args.skip)] + \
          (["--small"] if args.small else [])
    out = {"setup": variant, "shape": shape, "length": length}
    started = time.time()
    rc, output, timed_out = run_child(cmd, timeout, child_env())
    lines = [x for x in output.splitlines() if x.startswith("{")]
    if lines:  # the child's last report: its steps so far, or its out-of-memory error
        out.update(json.loads(lines[-1]))
    status, note = outcome(rc, output, timed_out, timeout)
    if out.get("status") != "oom":
        out["status"] = status
        if note:
            out["error"] = note
    out["wall_s"] = round(time.time() - started, 1)
    return out


def _note(r: dict) -> str:
    status = r.get("status", "")
    note = "" if status in ("ok", "running") else status
    if status == "timeout" and r.get("steps"):
        note += f" ({r['steps']} steps logged)"
    if r.get("skipped_steps"):  # pgs skipped non-finite steps: the figures are not a training step's
        note += f" {r['skipped_steps']} steps skipped (non-finite loss or spike)"
    if r.get("last_loss") is not None and r["last_loss"] != r["last_loss"]:
        note += " loss NaN"
    if r.get("tokens_per_row") not in (None, r["length"]):
        note += f" rows of {r['tokens_per_row']} tokens"
    error = (r.get("error") or "")
    if status in ("oom", "error", "refused", "skipped"):
        note += ": " + error[:110]
    return note.strip()


#: The table's columns: (header, result key or function of the row, format).
COLUMNS = [("shape", "shape", ""), ("tokens/row", "length", ","), ("setup", "setup", ""), ("tok/s", "tok_s", ",.0f"),
           ("median step s", "median_step_s", ".2f"), ("peak alloc GiB", "max_allocated_gib", ".2f"),
           ("peak reserved GiB", "max_reserved_gib", ".2f"), ("note", _note, "")]


def table(results: list[dict]) -> str:
    return markdown_table(results, COLUMNS, setup=None, inline_errors=True)  # the note column shows an error


def longest_line(results: list[dict], cap: float) -> str:
    """The longest row each (setup, shape) trained (``status`` ok), in the cap where one was set."""
    best: dict[tuple[str, str], int] = {}
    for r in results:
        key = (r["setup"], r["shape"])
        best.setdefault(key, 0)
        if r.get("status") == "ok":
            best[key] = max(best[key], r["length"])
    where = f" in {cap:g} GiB" if cap else ""
    return "longest row trained" + where + ": " + "; ".join(
        f"{setup} {shape}: {n:,}" if n else f"{setup} {shape}: none" for (setup, shape), n in best.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b", help=f"comma-separated, of {sorted(SPECS)}")
    p.add_argument("--lengths", default="16384,32768,65536,131072", help="tokens per row, comma-separated")
    p.add_argument("--peers", default="hf_liger_ac", help="bench/sft_step.py HF variants, comma-separated (--peers= for none)")
    p.add_argument("--steps", type=int, default=6, help="steps per entry")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of tok/s")
    p.add_argument("--chunk", type=int, default=4096, help="loss.chunk_size (rows of logits at a time)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per (setup, shape, length) entry")
    p.add_argument("--budget", type=int, default=0,
                   help="seconds for the whole call (0: no limit): an entry gets at most what is left, and one "
                        "that would get less than 30 s is skipped, so the table is printed before an outer timeout")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more spec overrides for pgs")
    p.add_argument("--seco", type=int, default=0, metavar="CHUNK",
                   help="also run pgs with chunk-wise training (memory.seco_chunk = CHUNK; 0: not)")
    p.add_argument("--cap", type=float, default=0.0, metavar="GIB",
                   help="memory.device_limit_gib for the pgs setups (0: none): the longest row in that cap")
    p.add_argument("--small", action="store_true", help="a tiny shape and short rows on the CPU (smoke run)")
    p.add_argument("--workdir", default="", help="run folders and the generated data (default: a temporary folder)")
    p.add_argument("--out", default="", help="JSON results (rewritten after every entry)")
    p.add_argument("--peer-one", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.small and args.lengths == p.get_default("lengths"):
        lengths = [256, 512]
    if args.small and args.peers == p.get_default("peers"):
        args.peers = "hf_eager_ac"  # Liger's kernels are Triton on CUDA
    if args.peer_one:
        peer_one(args.peer_one, shapes[0], lengths[0], args.steps, args.skip, args.small)  # prints its JSON lines
        return 0
    signal.signal(signal.SIGTERM, _on_terminate)  # an outer timeout: no child left on the GPU
    unknown = [s for s in shapes if s not in SPECS]
    if unknown:
        p.error(f"--shapes: {unknown} not in {sorted(SPECS)}")
    import sft_step  # noqa: E402 - the bench's HF variants, to refuse an unknown one before anything runs

    hf = [v for v in sft_step.VARIANTS if v.startswith("hf_")]
    unknown = [x for x in args.peers.split(",") if x and x not in hf]
    if unknown:
        p.error(f"--peers: {unknown} are not bench/sft_step.py HF variants ({', '.join(hf[:6])}, ...); "
                "--peers= for none")
    workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-long-")
    os.makedirs(workdir, exist_ok=True)
    data_files: dict[tuple[str, int], str] = {}

    def data_for(shape: str, length: int) -> str:
        """``args.steps + 2`` records a little longer than ``length`` tokens with the shape's tokenizer."""
        key = (shape, length)
        if key not in data_files:
            from pgs.runtime.spec.load import load_spec

            tokenizer = load_spec(os.path.join(ROOT, SPECS[shape]), args.set).model.tokenizer
            data_files[key] = os.path.join(workdir, f"long_{shape}_{length}.jsonl")
            write_long_records(data_files[key], words=words_for(length, tokenizer), records=args.steps + 2)
        return data_files[key]

    results: list[dict] = []
    peers = [x for x in args.peers.split(",") if x]
    began = time.time()
    too_long: dict[tuple[str, str], int] = {}  # (setup, shape) -> the length that did not fit
    for shape in shapes:
        for length in sorted(lengths):  # short rows first: a call cut short still has a table
            for setup in ["pgs", *(["pgs_seco"] if args.seco else []), *peers]:
                name = {"pgs": "pgs run", "pgs_seco": "pgs run seco"}.get(setup, setup)
                left = args.budget - (time.time() - began) if args.budget else float("inf")
                if (name, shape) in too_long:
                    r = {"setup": name, "shape": shape, "length": length, "status": "skipped",
                         "error": f"does not fit at {too_long[name, shape]:,} tokens per row"}
                elif left < 30:
                    r = {"setup": name, "shape": shape, "length": length, "status": "skipped",
                         "error": f"--budget {args.budget} s spent"}
                else:
                    timeout = min(args.timeout, left - 5)
                    r = (run_pgs(shape, length, data_for(shape, length), args, workdir, timeout,
                                 seco=args.seco if setup == "pgs_seco" else 0) if setup.startswith("pgs")
                         else run_peer(setup, shape, length, args, timeout))
                if r["status"] in ("oom", "refused"):
                    too_long[name, shape] = length
                results.append(r)
                print(json.dumps(r), flush=True)
                if args.out:
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w", encoding="utf-8") as handle:
                        json.dump({"shapes": shapes, "lengths": lengths, "steps": args.steps, "skip": args.skip,
                                   "results": results}, handle, indent=1)
    print(table(results))
    print(longest_line(results, args.cap))
    return 0 if all(r.get("status") != "error" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
