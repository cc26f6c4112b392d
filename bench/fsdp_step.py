"""FSDP2 training-step throughput: tokens/s on 1 GPU vs 2 GPUs at Qwen3-1.7B shape.

    python -m bench fsdp                            # 2x H200
    python -m bench fsdp --small --nprocs 1 2       # CPU smoke (gloo)

The launcher runs this same file under ``torch.distributed.run`` once per world size in
``--nprocs``; each run builds a random-init Qwen3 (HF transformers, sdpa) from its config,
shards it with ``pgs.runtime.dist.fsdp.shard_model`` (bf16 compute, fp32 reduce, fp32
sharded master weights), binds AdamW with ``bind_sharded``, and times full steps (forward
through the root, chunked loss over the global token count, backward, sharded AdamW step,
one control-plane all-reduce).  Each rank processes ``--batch`` rows of ``--seq`` tokens, so
the global batch grows with the world size (weak scaling); the JSON reports global
tokens/s, per-GPU tokens/s, scaling efficiency against 1 GPU, and peak memory per rank.
Not a test: tests assert correctness, never wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ranks import add_scaling, peaks_per_rank, torchrun_json  # noqa: E402

QWEN3_1_7B = dict(model_type="qwen3", vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40_960, tie_word_embeddings=True, rope_theta=1_000_000)
SMALL = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             tie_word_embeddings=True)


def worker(args) -> None:
    import pgs.func as pf
    from pgs.func.losses import token_loss
    from pgs.runtime.loop import control
    from pgs.runtime.dist import fsdp as D
    from pgs.runtime.model.build import build_model, final_hidden
    from pgs.runtime.optim.sharded_bind import bind_sharded

    ctx = D.init(single=True)  # FSDP2 on 1 GPU too: the same code path, 1 vs 2 ranks
    cfg = dict(SMALL if args.small else QWEN3_1_7B)
    model = build_model(config=cfg, dtype="float32", attn_implementation="sdpa", init_seed=0).to(ctx.device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    mp = None if args.small else "bf16"
    D.shard_model(model, ctx.mesh, mixed_precision=mp)
    opt = bind_sharded(pf.adamw(3e-4, weight_decay=0.1), model)
    vocab = cfg["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(ctx.rank)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(ctx.device)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    pos = torch.arange(args.seq, device=ctx.device).expand(args.batch, args.seq)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def step():
        n = D.global_count(int((labels != -100).sum()))
        h = final_hidden(model, ids, pos)
        loss = token_loss(h, model.get_output_embeddings().weight, labels, chunk_size=args.chunk).loss_sum / n
        loss.backward()
        control.agree([0, 0, int(not torch.isfinite(loss.detach()).item()), 0])
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    sync()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = args.batch * args.seq * ctx.world_size
    peaks = peaks_per_rank(ctx.device)["max_allocated_gib_per_rank"]
    if ctx.rank == 0:
        result = {"world_size": ctx.world_size, "median_step_s": med, "tokens_per_step": tokens,
                  "tokens_per_s": tokens / med, "tokens_per_s_per_gpu": tokens / med / ctx.world_size,
                  "peak_gib_per_rank": peaks, "step_times_s": times,
                  "params": sum(p.numel() for p in model.parameters()), "mixed_precision": mp or "fp32",
                  "batch_per_rank": args.batch, "seq": args.seq, "checkpointing": args.checkpointing}
        with open(args.worker_out, "w") as handle:
            json.dump(result, handle)
    D.shutdown()


def launch(args) -> None:
    runs = []
    for n in args.nprocs:
        flags = ["--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--chunk", str(args.chunk)]
        flags += ["--small"] if args.small else []
        flags += ["--checkpointing"] if args.checkpointing else []
        runs.append(torchrun_json(os.path.abspath(__file__), n, flags))
    add_scaling(runs, "tokens_per_s_per_gpu")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "shape": "small" if args.small else "qwen3-1.7b"}
    out = {"env": env, "runs": runs}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="rows per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    p.add_argument("--small", action="store_true", help="tiny model on the CPU (smoke)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.seq = min(args.seq, 64)
        args.steps = min(args.steps, 3)
        args.warmup = min(args.warmup, 1)
    if args.worker_out:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
