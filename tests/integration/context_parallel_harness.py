"""One rank of tests/integration/test_context_parallel.py (started with torchrun's environment, gloo, CPU).

Writes ``result_rank{r}.json`` into the folder given as argv[1]: the largest differences between
the context-parallel computation and the single-process one, which every rank also computes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pgs.func.losses import token_loss
from pgs.runtime.dist.context import SequenceShard, register, ring_attention, sequence_parallel, shard_rows
from pgs.runtime.documents import document_ids
from pgs.runtime.model.build import build_model, final_hidden, output_head

F64 = torch.float64


def packed_positions(width: int, lengths_per_row) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(width - sum(lengths))])
        rows.append(pos)
    return torch.stack(rows)


def attention_case(shard: SequenceShard) -> dict:
    gen = torch.Generator().manual_seed(11)
    b, h, hk, s, d = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=F64) for n in (h, hk, hk))
    grad = torch.randn(b, h, s, d, generator=gen, dtype=F64)
    pos = packed_positions(s, [(5, 9, 7), (24,)])
    doc = document_ids(pos)
    # the reference: the whole rows on one process, SDPA with the block-diagonal causal mask
    i = torch.arange(s)
    mask = (doc[:, :, None] == doc[:, None, :]) & (i[None, None, :] <= i[None, :, None])
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1),
                                                           attn_mask=mask[:, None])
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), grad)
    qs, ks, vs = (shard_rows(x, shard, dim=2).requires_grad_() for x in (q, k, v))
    out = ring_attention(qs, ks, vs, doc, shard)
    grads = torch.autograd.grad(out, (qs, ks, vs), shard_rows(grad, shard, dim=2))
    return {"out": float((out - shard_rows(ref, shard, dim=2)).abs().max()),
            **{f"d{n}": float((g - shard_rows(r, shard, dim=2)).abs().max())
               for n, g, r in zip("qkv", grads, ref_grads)}}


MODELS = {
    "qwen3": dict(model_type="qwen3", intermediate_size=64),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2),
}


def model_case(name: str, shard: SequenceShard, dtype) -> dict:
    config = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, vocab_size=97, **MODELS[name])
    model = build_model(config=config, dtype=dtype, attn_implementation=register(), init_seed=5)
    gen = torch.Generator().manual_seed(3)
    width = 32
    ids = torch.randint(1, 97, (2, width), generator=gen)
    pos = packed_positions(width, [(10, 13, 4), (20, 9)])
    labels = torch.randint(0, 97, (2, width), generator=gen)
    labels[pos == 0] = -100
    labels[torch.rand(2, width, generator=gen) < 0.2] = -100
    n_valid = int((labels != -100).sum())
    weight, bias, _ = output_head(model)
    params = [p for p in model.parameters()]

    def loss_of(ids, pos, labels):
        h = final_hidden(model, ids, pos)
        return token_loss(h, weight, labels, backend="chunked", bias=bias, chunk_size=16).loss_sum

    ref = loss_of(ids, pos, labels)
    ref_grads = torch.autograd.grad(ref / n_valid, params)
    with sequence_parallel(shard, pos):
        local = loss_of(shard_rows(ids, shard), shard_rows(pos, shard), shard_rows(labels, shard))
    grads = torch.autograd.grad(local / n_valid, params)
    flat = torch.cat([g.reshape(-1) for g in grads] + [local.detach().reshape(1)]).to(F64)
    dist.all_reduce(flat)  # what FSDP's reduce-scatter does over the same ranks: a sum
    total_loss = float(flat[-1])
    grads_sum = flat[:-1]
    ref_flat = torch.cat([g.reshape(-1) for g in ref_grads]).to(F64)
    return {"loss": abs(total_loss - float(ref)) / abs(float(ref)),
            "grad": float((grads_sum - ref_flat).abs().max()),
            "grad_scale": float(ref_flat.abs().max())}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    result = {}
    for layout in ("zigzag", "contiguous"):
        shard = SequenceShard(rank, world, layout)
        result[f"attention_{layout}"] = attention_case(shard)
    shard = SequenceShard(rank, world, "zigzag")
    result["qwen3_fp64"] = model_case("qwen3", shard, F64)
    result["qwen3_moe_fp32"] = model_case("qwen3_moe", shard, torch.float32)
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
