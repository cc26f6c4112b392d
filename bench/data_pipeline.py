"""CPU throughput of the training data pipeline: tokenize + template + pack + collate.

Not a test.  Builds long multi-turn chats from the quickstart's synthetic tasks
(``synthetic.long_chats``: many ``add`` and ``weather`` exchanges per conversation, 300-3000
tokens each, written to a temp JSONL), then times ``TrainStream.next_batch`` with the bundled tokenizer
(``pgs/assets/quickstart/tokenizer``) at ``max_seq_len`` 4096, on one core, and prints
tokens/s (non-padding tokens of the batches handed out, over wall time; the one-time
indexing pass that validates every record is timed apart).

    PYTHONPATH=. python bench/data_pipeline.py                      # defaults: 3 windows of 512
    PYTHONPATH=. python bench/data_pipeline.py --profile 25          # cProfile, top 25 by tottime
    PYTHONPATH=. python bench/data_pipeline.py --loader              # also StepLoader, threaded

Target (issue 19): >= 300k tokens/s on one core.
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

    # Warm up: the first window (jinja compiles the template once, caches fill).
    first = stream.next_batch(args.micro_batch)
    per_window = stream.stats.sequences
    want_batches = max(1, int(args.windows * per_window / args.micro_batch))
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
    del first
    if args.loader:
        from pgs.runtime.data.loader import StepLoader

        stream = TrainStream(config, tokenizer, pack_window=args.pack_window)
        with StepLoader(stream, args.micro_batch, 1, torch.device("cpu"), ahead=2) as loader:
            loader.next_step()
            got = 0
            started = time.perf_counter()
            for _ in range(want_batches):
                got += sum(b.num_tokens for b in loader.next_step())
            result["loader_tokens_per_s"] = round(got / (time.perf_counter() - started))

    print(f"data pipeline (CPU, {'1 core' if not args.all_cores else 'all cores'}): "
          f"{result['tokens_per_s']:,} tokens/s  ({tokens:,} tokens in {seconds:.2f} s, "
          f"{want_batches} batches of {args.micro_batch}x{args.max_seq_len}, "
          f"~{result['mean_tokens_per_conversation']:.0f} tokens/conversation, "
          f"packing efficiency {result['packing_efficiency']:.3f}; indexing {index_s:.2f} s)")
    print(f"  per CPU second (this process, all its threads): {result['tokens_per_cpu_s']:,} tokens/s "
          f"({cpu_seconds:.2f} CPU s; below the wall-clock figure's time when other work shares the core)")
    if "loader_tokens_per_s" in result:
        print(f"StepLoader (threaded, CPU device): {result['loader_tokens_per_s']:,} tokens/s")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
