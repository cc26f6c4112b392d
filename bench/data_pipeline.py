"""CPU throughput of the training data pipeline: tokenize + template + pack + collate.

Not a test.  Builds long multi-turn chats from the quickstart's synthetic tasks
(``synthetic.long_chats``: many ``add`` and ``weather`` exchanges per conversation, 300-3000
tokens each, written to a temp JSONL), then times ``TrainStream.next_batch`` with the bundled tokenizer
(``pgs/assets/quickstart/tokenizer``) at ``max_seq_len`` 4096, on one core, and prints
tokens/s (non-padding tokens of the batches handed out, over wall time; the one-time
indexing pass that validates every record is timed apart).

    python -m bench data                            # defaults: 3 windows of 512
    python -m bench data --profile 25               # cProfile, top 25 by tottime
    python -m bench data --loader                   # also StepLoader, threaded
    python -m bench data --all-cores --overlap 60   # steps fed by StepLoader

Target: >= 300k tokens/s on one core (docs/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "pgs", "assets", "quickstart", "tokenizer")


def one_core() -> None:
    """Pin this process (and the tokenizer's Rust pool) to one core."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[0]})


def overlap(config, tokenizer, args) -> dict:
    """Time of training-like steps: batches already there, StepLoader with a worker process,
    with a worker thread, and the synchronous path (median, mean, max seconds a step).

    A step consumes its batch on the device, launches ``--launches`` small ops (host work that
    needs the GIL, like a training step's Python) and keeps the device busy ``--step-ms``
    (``torch.cuda._sleep``; ``time.sleep`` without CUDA), then waits for the device.
    """
    import statistics

    import torch

    from pgs.runtime.data import TrainStream
    from pgs.runtime.data.loader import StepLoader

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cycles_per_ms = 0
    if cuda:  # calibrate torch.cuda._sleep
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        cycles_per_ms = int(10_000_000 / start.elapsed_time(end))
    acc = torch.zeros(1024, device=device)

    def step(batches) -> None:
        nonlocal acc
        for b in batches:
            acc = acc + b.input_ids.reshape(-1)[:1024].float()
        for _ in range(args.launches):
            acc = acc * 1.0001 + 0.0001
        if cuda:
            torch.cuda._sleep(int(args.step_ms * cycles_per_ms))
            torch.cuda.synchronize()
        else:
            time.sleep(args.step_ms / 1000)

    def timed(next_step) -> float:
        for _ in range(3):
            step(next_step())
        times = []
        for _ in range(args.overlap):
            started = time.perf_counter()
            step(next_step())
            times.append(time.perf_counter() - started)
        return statistics.median(times), sum(times) / len(times), max(times)

    def loader(threaded: bool, worker: str = "process") -> StepLoader:
        return StepLoader(TrainStream(config, tokenizer, pack_window=args.pack_window), args.micro_batch, 1,
                          device, threaded=threaded, worker=worker, ahead=args.ahead)

    with loader(False) as ready_source:
        ready = ready_source.next_step()
    out = {"device": str(device), "step_tokens": sum(b.num_tokens for b in ready), "ahead": args.ahead}
    out["ready"] = timed(lambda: ready)
    for worker in ("process", "thread"):
        with loader(True, worker) as ahead:
            out[worker] = timed(ahead.next_step)
    with loader(False) as sync:
        out["sync"] = timed(sync.next_step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU throughput of TrainStream (tokenize + template + pack + collate).")
    parser.add_argument("--conversations", type=int, default=1536, help="conversations in the temp JSONL")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--pack-window", type=int, default=512)
    parser.add_argument("--windows", type=float, default=3.0, help="how many windows' worth of sequences to time")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-cores", action="store_true", help="do not pin to one core")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the timed part, print top N")
    parser.add_argument("--loader", action="store_true", help="also time StepLoader (threaded, CPU device)")
    parser.add_argument("--overlap", type=int, default=0, metavar="STEPS",
                        help="also time STEPS training-like steps fed by StepLoader (threaded and not) against "
                             "steps whose batches are ready (use with --all-cores; CUDA if present)")
    parser.add_argument("--ahead", type=int, default=None, help="StepLoader(ahead=): default a window's worth")
    parser.add_argument("--step-ms", type=float, default=300.0, help="--overlap: device time of one step")
    parser.add_argument("--launches", type=int, default=3000, help="--overlap: small ops launched per step (host work)")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    if not args.all_cores:
        one_core()
    import torch
    from transformers import AutoTokenizer

    from pgs.runtime.data import DataConfig, TrainStream
    from pgs.runtime.data.synthetic import long_chats, write_jsonl

    if not args.all_cores:
        torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    folder = tempfile.mkdtemp(prefix="pgs-bench-data-")
    path = os.path.join(folder, "long_chats.jsonl")
    write_jsonl(path, long_chats(args.conversations, args.seed))
    config = DataConfig(sources=[path], max_seq_len=args.max_seq_len)

    started = time.perf_counter()
    stream = TrainStream(config, tokenizer, pack_window=args.pack_window)
    index_s = time.perf_counter() - started

    # Warm-up on a stream of its own: jinja compiles the template, caches fill, and the first
    # window tells how many batches a window makes.  The timed stream starts fresh, so the
    # timed batches pay for every window they use (``--windows`` of them).
    stream.next_batch(args.micro_batch)
    per_window = stream.stats.sequences
    want_batches = max(1, round(args.windows * per_window / args.micro_batch))
    stream = TrainStream(config, tokenizer, pack_window=args.pack_window)
    profiler = cProfile.Profile() if args.profile else None
    tokens = padded = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    for _ in range(want_batches):
        batch = stream.next_batch(args.micro_batch)
        tokens += batch.num_tokens
        padded += batch.input_ids.numel()
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    stats = stream.stats
    result = {
        "conversations": args.conversations,
        "mean_tokens_per_conversation": round(stats.tokens / max(stats.samples, 1), 1),
        "max_seq_len": args.max_seq_len,
        "pack_window": args.pack_window,
        "micro_batch": args.micro_batch,
        "batches": want_batches,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "cpu_seconds": round(cpu_seconds, 3),
        "tokens_per_cpu_s": round(tokens / cpu_seconds),
        "packing_efficiency": round(tokens / padded, 4),
        "index_seconds": round(index_s, 3),
        "one_core": not args.all_cores,
        "torch": torch.__version__,
    }
    if args.loader:
        from pgs.runtime.data.loader import StepLoader

        stream = TrainStream(config, tokenizer, pack_window=args.pack_window)
        with StepLoader(stream, args.micro_batch, 1, torch.device("cpu"), ahead=args.ahead) as loader:
            got = 0
            started = time.perf_counter()
            for _ in range(want_batches):
                got += sum(b.num_tokens for b in loader.next_step())
            result["loader_tokens_per_s"] = round(got / (time.perf_counter() - started))

    if args.overlap:
        result["overlap"] = overlap(config, tokenizer, args)

    print(f"data pipeline (CPU, {'1 core' if not args.all_cores else 'all cores'}): "
          f"{result['tokens_per_s']:,} tokens/s  ({tokens:,} tokens in {seconds:.2f} s, "
          f"{want_batches} batches of {args.micro_batch}x{args.max_seq_len}, "
          f"~{result['mean_tokens_per_conversation']:.0f} tokens/conversation, "
          f"packing efficiency {result['packing_efficiency']:.3f}; indexing {index_s:.2f} s)")
    print(f"  per CPU second (this process, all its threads): {result['tokens_per_cpu_s']:,} tokens/s "
          f"({cpu_seconds:.2f} CPU s; below the wall-clock figure's time when other work shares the core)")
    if "loader_tokens_per_s" in result:
        print(f"StepLoader (threaded, CPU device): {result['loader_tokens_per_s']:,} tokens/s")
    if "overlap" in result:
        o = result["overlap"]
        print(f"{args.overlap} steps of {o['step_tokens']:,} tokens ({args.launches} launches + {args.step_ms:.0f} ms "
              f"on {o['device']}; StepLoader ahead={o['ahead']}), s/step median / mean / max:")
        for name, what in (("ready", "batches ready (no data work)"), ("process", "StepLoader, worker process"),
                           ("thread", "StepLoader, worker thread"), ("sync", "StepLoader(threaded=False)")):
            print(f"  {what:29s} {o[name][0]:.4f} / {o[name][1]:.4f} / {o[name][2]:.4f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
