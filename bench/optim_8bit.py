"""Optimizer-step benchmark at Qwen3-1.7B shapes: pgs 8-bit vs bitsandbytes vs torch fused AdamW.

    python bench/optim_8bit.py out.json            # H200: full shapes, bf16 params + grads
    python bench/optim_8bit.py out.json --small    # CPU smoke: 2 layers, tiny dims

Reports per optimizer: median ms, bytes that must move per step, the byte floor
(bytes / 4284 GB/s, ANCHORS.md copy bandwidth) and the fraction of copy bandwidth reached
(floor / median).  All rows come from the same run, so compare them as ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import pgs.func as pf

COPY_GBPS = 4284.0


def qwen3_shapes(small: bool) -> dict[str, tuple]:
    h, kv, inter, layers, vocab, hd = (2048, 1024, 6144, 28, 151936, 128) if not small else (256, 128, 768, 2, 4096, 32)
    shapes = {"embed": (vocab, h), "final_norm": (h,)}
    for i in range(layers):
        for name, s in [("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)), ("gate", (inter, h)),
                        ("up", (inter, h)), ("down", (h, inter)), ("q_norm", (hd,)), ("k_norm", (hd,)),
                        ("ln1", (h,)), ("ln2", (h,))]:
            shapes[f"layers.{i}.{name}"] = s
    return shapes


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated row names")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    dev = "cuda" if cuda else "cpu"
    shapes = qwen3_shapes(args.small)
    gen = torch.Generator(device=dev).manual_seed(0)
    params = {k: (torch.randn(s, device=dev, generator=gen) * 0.02).bfloat16() for k, s in shapes.items()}
    grads = {k: (torch.randn(s, device=dev, generator=gen) * 1e-3).bfloat16() for k, s in shapes.items()}
    n = sum(p.numel() for p in params.values())
    n8 = sum(p.numel() for p in params.values() if p.numel() >= 4096)
    blocks = n8 / 256 * 4
    # bytes that must move: grad read (2) + param read/write (4) + state read/write
    bytes_needed = {
        "pgs_lion8bit": n * 6 + n8 * 2 + 2 * blocks + (n - n8) * 8,
        "pgs_adamw8bit": n * 6 + n8 * 4 + 4 * blocks + (n - n8) * 16,
        "bnb_lion8bit": n * 6 + n8 * 2 + 2 * blocks + (n - n8) * 8,
        "bnb_adamw8bit": n * 6 + n8 * 4 + 4 * blocks + (n - n8) * 16,
        "torch_adamw_fused_bf16": n * 14,
    }
    rows = {}
    only = set(filter(None, args.only.split(",")))
    iters, warmup = (args.iters, 3) if cuda else (2, 1)

    def pgs_row(name, opt):
        fast = pf.compile(opt, jit=False, donate=True)
        p = {k: v.clone() for k, v in params.items()}
        fast.bind_buffers(p)
        g = {k: v.clone() for k, v in grads.items()}
        state = fast.init(p)
        box = [state]

        def step():
            _, box[0] = fast.step(g, box[0], p)

        return step

    def bnb_row(cls):
        import bitsandbytes as bnb

        ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        opt = getattr(bnb.optim, cls)(ps, lr=1e-4, min_8bit_size=4096)
        return opt.step

    def torch_row():
        ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        opt = torch.optim.AdamW(ps, lr=1e-4, fused=cuda)
        return opt.step

    makers = {
        "pgs_lion8bit": lambda: pgs_row("lion8bit", pf.lion8bit(1e-5, weight_decay=0.1)),
        "pgs_adamw8bit": lambda: pgs_row("adamw8bit", pf.adamw8bit(1e-5, weight_decay=0.1)),
        "bnb_lion8bit": lambda: bnb_row("Lion8bit"),
        "bnb_adamw8bit": lambda: bnb_row("AdamW8bit"),
        "torch_adamw_fused_bf16": torch_row,
    }
    for name, make in makers.items():
        if only and name not in only:
            continue
        try:
            fn = make()
            ms = _time(fn, iters, warmup, cuda)
            floor = bytes_needed[name] / (COPY_GBPS * 1e9) * 1e3
            rows[name] = dict(ms=ms, bytes=bytes_needed[name], bytes_per_param=bytes_needed[name] / n,
                              floor_ms=floor, fraction_of_copy_bw=floor / ms)
        except Exception as e:  # a missing peer must not hide the other rows
            rows[name] = dict(error=f"{type(e).__name__}: {e}")
        print(name, rows[name], flush=True)
        if cuda:
            torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name() if cuda else "cpu", params=n, params_8bit=n8,
               tensors=len(shapes), small=args.small, rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
