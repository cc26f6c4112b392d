"""Hybrid models packed and isolated: tokens/s of ``pgs run`` on a Qwen3.5 spec, packed vs one
document per row, beside HF's own training step unpacked, on the same chats.

For the spec (default ``specs/qwen3_5_4b_16gib.toml``: Qwen3.5-4B's text shape, its
linear-attention layers frozen, the bundled multi-turn chats of 350-3050 tokens), one after the
other in one call:

1. ``pgs run SPEC`` as shipped: documents packed into rows of ``data.max_seq_len``, each
   document isolated in the Gated DeltaNet layers (on CUDA the fused path: fla's causal
   convolution and ``chunk_gated_delta_rule`` given the boundaries) and in attention (varlen).
2. ``pgs run SPEC --set data.packing=false``: one document per row, the row padded to
   ``data.max_seq_len`` (pgs's rows always have that width: docs/data.md).
3. HF unpacked: transformers' ``Qwen3_5ForCausalLM`` from the same config (random init, bf16),
   the same layers frozen, its own forward and loss on one conversation per step (no padding,
   SDPA; its Gated DeltaNet layers through the kernels transformers dispatches to: fla's delta
   rule where installed, its PyTorch convolution without causal-conv1d), transformers-style
   activation checkpointing of every layer, ``torch.optim.AdamW(fused=True)``
   (``bench/sft_step.py``'s ``hf_eager_ac``).

Figures as ``bench/product.py``'s (``mean``: trained tokens of the timed steps over their
step times); the JSON has every row::

    python -m bench hybrid --steps 30 --skip 4

``--small`` runs the same path at a tiny shape on the CPU (a smoke run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench.product import SMALL, markdown_table, run_pgs  # noqa: E402 - the product path's runner and table

SPEC = os.path.join(ROOT, "specs", "qwen3_5_4b_16gib.toml")
#: ``--small``: the smoke shape of ``bench/product.py`` as a tiny hybrid (two Gated DeltaNet
#: layers under two attention layers, the linear ones frozen).
SMALL_HYBRID = [s for s in SMALL if not s.startswith("model.config.num_hidden_layers")] + [
    "model.config.num_hidden_layers=4", "model.config.linear_num_key_heads=2", "model.config.linear_num_value_heads=4",
    "model.config.linear_key_head_dim=16", "model.config.linear_value_head_dim=16", "model.config.full_attention_interval=2",
    "model.attn_implementation=sdpa", "memory.activation_checkpointing=sublayer"]
COLUMNS = [("packed", "packed", ""), ("mean tok/s", "mean_tok_s", ".0f"), ("median step s", "median_step_s", ".3f"),
           ("tokens/step", "mean_tokens_per_step", ".0f"), ("max alloc GiB", "max_allocated_gib", ".2f"),
           ("last loss", "last_loss", ".3f")]


def run_hf_unpacked(args) -> dict:
    """transformers' own step on one conversation per step (the HF row of the module docstring)."""
    import torch

    import sft_step  # noqa: E402 - the bench's HF variants, built one way everywhere

    from pgs.runtime.data import TrainStream
    from pgs.runtime.model.build import freeze
    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(args.spec, args.sets + ["data.packing=false"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stream = TrainStream(spec.data, load_tokenizer(spec.model.tokenizer))
    model = sft_step.build(dict(spec.model.config), device, "sdpa")
    frozen = freeze(model, spec.model.freeze if isinstance(spec.model.freeze, str) else list(spec.model.freeze))
    peer_args = argparse.Namespace(compile_backend=None, compile_options=None, small=args.small, triton_on_cpu=False,
                                   mlp_tiles=4, defer=False, no_defer=False)
    step, _ = sft_step.variant_setup("hf_eager_ac", model, peer_args, 0)
    times, tokens, losses = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        b = stream.next_batch(1)
        n = int(b.cu_seqlens[0][1])  # the row's one conversation, without the padding after it
        ids = b.input_ids[:, :n].to(device)
        labels = torch.full_like(b.labels[:, :n], -100)
        labels[:, 1:] = b.labels[:, :n - 1]  # pgs's labels are shifted targets; HF shifts inside its loss
        t0 = time.perf_counter()
        losses.append(float(step(ids, torch.arange(n, device=device)[None], labels.to(device))))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(int(b.num_tokens))
    timed, counted = times[args.skip:], tokens[args.skip:]
    out = {"setup": "HF unpacked (hf_eager_ac)", "packed": "no", "frozen_parameters": len(frozen),
           "mean_tok_s": sum(counted) / sum(timed), "median_step_s": statistics.median(timed),
           "mean_tokens_per_step": sum(counted) / len(counted), "last_loss": losses[-1],
           "step_s": [round(t, 3) for t in timed]}
    if device.type == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=SPEC, help="a hybrid model's spec (default: the Qwen3.5-4B recipe)")
    p.add_argument("--steps", type=int, default=30, help="steps of each setup")
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the figures")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec overrides for every setup")
    p.add_argument("--only", default="packed,unpacked,hf", help="which setups, in which order")
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run of this script)")
    p.add_argument("--timeout", type=float, default=None, help="seconds each pgs run may take (killed after)")
    p.add_argument("--out", default="", help="JSON results")
    args = p.parse_args(argv)
    args.sets = (SMALL_HYBRID if args.small else []) + args.set
    args.nvidia_smi, args.profile = False, ""
    workdir = tempfile.mkdtemp(prefix="pgs-hybrid-")
    results = []
    for which in args.only.split(","):
        if which in ("packed", "unpacked"):
            run_args = argparse.Namespace(**{**vars(args), "small": False,
                                             "set": args.sets + (["data.packing=false"] if which == "unpacked" else [])})
            row = run_pgs(args.spec, run_args, workdir)
            row.update(setup=f"pgs run, {which}", packed="yes, isolated" if which == "packed" else "no")
        elif which == "hf":
            try:
                row = run_hf_unpacked(args)
            except RuntimeError as err:  # e.g. fla's refusal of its backward on this GPU: the row says so
                row = {"setup": "HF unpacked (hf_eager_ac)", "packed": "no", "error": str(err)[:400]}
        else:
            p.error(f"--only {which}: not packed, unpacked or hf")
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_s", "stderr_tail")}), flush=True)
    print(markdown_table(results, COLUMNS))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"spec": args.spec, "steps": args.steps, "skip": args.skip, "results": results}, handle, indent=1)
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
