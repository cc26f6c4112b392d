"""The multi-GPU peer of ``bench/product.py --nproc``: torchtitan-style FSDP2 + fused AdamW on a spec's model.

A worker script under torchrun (``bench/ranks.py`` launches it; one process per GPU).  What
torchtitan's Llama/Qwen3 recipe does, with plain torch on HF's model:

- the spec's ``[model.config]`` built by ``pgs.runtime.model.build.build_model`` in fp32
  (sdpa attention), activation checkpointing on every decoder layer (HF's, non-reentrant);
- ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the last one keeps its
  parameters after forward, as torchtitan does) and then the root, ``MixedPrecisionPolicy``
  with bf16 parameters and fp32 gradient reduction; FSDP2's own gradient averaging;
- ``torch.optim.AdamW`` on the sharded fp32 parameters, ``fused=True`` on CUDA (``foreach``
  on the CPU), the spec's peak learning rate, weight decay 0.1;
- the loss: cross-entropy of the full fp32 logits over the trained tokens (each rank's mean).

Data: each rank takes its share of the same global batches that ``pgs run`` reads
(``TrainStream(rank=, world_size=)``, ``rows`` rows per rank), each row fed as one causal
sequence (positions 0..S-1: torchtitan has no document mask).  Rank 0 writes global and
per-GPU tokens/s and every rank's peak memory (``--worker-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.ranks import peaks_per_rank  # noqa: E402


def worker(args) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from pgs.runtime.data import TrainStream
    from pgs.runtime.model.build import build_model
    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    mesh = init_device_mesh(device.type, (world,))

    spec = load_spec(args.spec, args.set)
    tokenizer = load_tokenizer(spec.model.tokenizer or spec.model.path)
    config = {k: v for k, v in (spec.model.config or {}).items() if not (k == "vocab_size" and not v)}
    model = build_model(path=spec.model.path, config=config or None, dtype="float32", attn_implementation="sdpa",
                        init_seed=spec.model.init_seed, vocab_size=len(tokenizer), device=device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # as pgs run: a bfloat16 spec computes in bf16 over fp32 masters, a float32 one in fp32
    mixed = spec.model.dtype == "bfloat16"
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed
              else MixedPrecisionPolicy())
    layers = list(model.base_model.layers)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.schedule.peak, weight_decay=0.1,
                            **({"fused": True} if cuda else {"foreach": True}))

    stream = TrainStream(spec.data, tokenizer, rank=rank, world_size=world)

    def step() -> int:
        b = stream.next_batch(args.rows)
        ids = b.input_ids.to(device, non_blocking=True)
        labels = b.labels.to(device, non_blocking=True)  # already the next token of each position
        pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(b.num_tokens)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, tokens = [], []
    for i in range(args.steps):
        if i == args.skip and cuda:
            torch.cuda.reset_peak_memory_stats()  # the peak of the timed steps
        t0 = time.perf_counter()
        n = step()
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(n)
    counts = torch.tensor(tokens, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(counts)  # every rank's tokens of each step: the global step's
    peaks = peaks_per_rank(device)
    dist.destroy_process_group()
    if rank != 0:
        return None
    timed, counted = times[args.skip:], counts.tolist()[args.skip:]
    global_tok_s = sum(counted) / sum(timed)
    median = statistics.median(timed)
    return {"setup": "titan_fsdp", "world_size": world, "steps": args.steps, "rows_per_rank": args.rows,
            "mixed_precision": "bf16" if mixed else "fp32", "optimizer": "AdamW fused" if cuda else "AdamW foreach",
            "mean_tok_s": global_tok_s, "global_tok_s": global_tok_s, "per_gpu_tok_s": global_tok_s / world,
            "median_step_s": median, "max_over_median": max(timed) / median,
            "mean_tokens_per_step": sum(counted) / len(counted), "step_s": [round(t, 3) for t in timed],
            **peaks, "max_allocated_gib": max(peaks["max_allocated_gib_per_rank"], default=None) if cuda else None,
            "max_reserved_gib": max(peaks["max_reserved_gib_per_rank"], default=None) if cuda else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec overrides")
    p.add_argument("--rows", type=int, default=1, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the figures")
    p.add_argument("--worker-out", required=True)
    args = p.parse_args(argv)
    result = worker(args)
    if result is not None:
        with open(args.worker_out, "w", encoding="utf-8") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
    # As `python -m pgs` under torchrun: leave without C++ static destructors, which can abort a
    # finished worker while a gloo thread winds down (SIGABRT turns a finished run into a failure).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
