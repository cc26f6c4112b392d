"""Optimizer-step benchmark: pgs compiled chains vs torch.optim, same run, same shapes.

    python -m bench optim-step              # H200; bench/results/<date>-optim-step.json
    python -m bench optim-step --small      # CPU smoke

Reports median ms per step, the byte floor (bytes that must move / measured copy
bandwidth) and the fraction of copy bandwidth each optimizer reaches.  Not a test: tests
assert correctness, never wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import qwen3_shapes, small_shapes  # noqa: E402

import pgs.func as pf  # noqa: E402
from pgs.runtime import bind  # noqa: E402


def timer(device):
    if device.type == "cuda":
        def run(fn, iters, warmup):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            return statistics.median(times)
    else:
        def run(fn, iters, warmup):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)
    return run


def copy_bandwidth(device, numel, run):
    a = torch.empty(numel, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms = run(lambda: b.copy_(a), 20, 5)
    del a, b
    return 2 * numel * 2 / (ms / 1e3)  # bytes read + written per second


def make_model(shapes, device, dtype):
    params = torch.nn.ParameterDict()
    for name, shape in shapes.items():
        key = name.replace(".", "_")
        p = torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype) * 0.02)
        params[key] = p
    return params


def fill_grads(params, seed=0):
    g = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    for p in params.values():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(generator=g).mul_(1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", default="", help="comma list of variants")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shapes = small_shapes() if args.small else qwen3_shapes()
    n = sum(int(torch.Size(s).numel()) for s in shapes.values())
    run = timer(device)
    bw = copy_bandwidth(device, min(n, 1 << 28), run)
    iters = 5 if args.small else args.iters
    warm = 2 if args.small else 5
    dtype = torch.bfloat16
    bf16 = torch.bfloat16

    def pgs_variant(chain, jit=True, fused=True):
        def build():
            params = make_model(shapes, device, dtype)
            opt = bind(chain, dict(params), compile=True, jit=jit, donate=True, fused=fused)
            fill_grads(params)
            return params, opt
        return build

    def torch_variant(kind, **kw):
        def build():
            params = make_model(shapes, device, dtype)
            if kind == "fused" and device.type != "cuda":
                kw2 = dict(kw, foreach=True)
            elif kind == "fused":
                kw2 = dict(kw, fused=True)
            else:
                kw2 = dict(kw, foreach=True)
            opt = torch.optim.AdamW(params.values(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **kw2)
            fill_grads(params)
            return params, opt
        return build

    # bytes per parameter that must move (grad read + param r/w + each state r/w)
    variants = {
        "torch_adamw_fused_bf16": (torch_variant("fused"), 14),
        "torch_adamw_foreach_bf16": (torch_variant("foreach"), 14),
        "pgs_adamw_bf16_state": (pgs_variant(pf.adamw(1e-4, 0.9, 0.95, 1e-8, 0.1, mu_dtype=bf16, nu_dtype=bf16)), 14),
        "pgs_adamw_fp32_state": (pgs_variant(pf.adamw(1e-4, 0.9, 0.95, 1e-8, 0.1, mu_dtype=torch.float32, nu_dtype=torch.float32)), 22),
        "pgs_lion_bf16_state": (pgs_variant(pf.lion(1e-5, 0.9, 0.99, 0.1, mu_dtype=bf16)), 10),
        "pgs_adamw_bf16_generic_compile": (pgs_variant(pf.adamw(1e-4, 0.9, 0.95, 1e-8, 0.1, mu_dtype=bf16, nu_dtype=bf16), fused=False), 14),
        "pgs_lion_bf16_generic_compile": (pgs_variant(pf.lion(1e-5, 0.9, 0.99, 0.1, mu_dtype=bf16), fused=False), 10),
        "pgs_adamw_clip_cosine": (pgs_variant(pf.chain(pf.clip_by_global_norm(1.0), pf.scale_by_adam(0.9, 0.95, mu_dtype=bf16, nu_dtype=bf16), pf.add_decayed_weights(0.1, mask=lambda p, x: x.ndim >= 2), pf.scale_by_learning_rate(pf.cosine_schedule(1e-4, 100, 10_000)))), 16),
    }
    only = [v for v in args.only.split(",") if v]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "params": n, "tensors": len(shapes),
               "copy_bandwidth_GBps": bw / 1e9, "variants": {}}
    print(f"{results['device']}  params={n/1e9:.3f}B tensors={len(shapes)}  copy bw={bw/1e9:.0f} GB/s", flush=True)
    for name, (build, bpp) in variants.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        params, opt = build()
        opt.step()  # compile / first step
        compile_s = time.perf_counter() - t0
        ms = run(opt.step, iters, warm)
        floor_ms = n * bpp / bw * 1e3
        fusedk = bool(getattr(getattr(opt, "flat", None), "uses_fused_kernel", lambda: False)())
        r = {"fused_kernel": fusedk, "median_ms": ms, "bytes_per_param": bpp, "floor_ms": floor_ms, "fraction_of_copy_bw": floor_ms / ms,
             "first_step_s": compile_s}
        results["variants"][name] = r
        print(f"{name:32s} {ms:8.2f} ms  floor {floor_ms:6.2f} ms  frac {floor_ms/ms:5.2f}  first {compile_s:6.1f}s", flush=True)
        del params, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
