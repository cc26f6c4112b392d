"""Optimizer-step benchmark at Qwen3-1.7B shapes: pgs 8-bit vs bitsandbytes vs torch fused AdamW.

    python -m bench optim-8bit              # H200: full shapes, bf16 params + grads
    python -m bench optim-8bit --small      # CPU smoke: 2 layers, tiny dims
    python bench/optim_8bit.py OUT.json     # the script alone (its JSON path comes first)

Reports per optimizer: median ms, bytes that must move per step, the byte floor
(bytes / 4284 GB/s, the H200 copy bandwidth of docs/performance.md, "Peers and ceilings") and the fraction of copy bandwidth reached
(floor / median).  All rows come from the same run, so compare them as ratios.

``pgs_lion8bit_sr`` adds stochastic rounding of the bf16 parameters.  ``pgs_chain`` is the design
stack ``adagc → mona → lion8bit direction → hyperball`` through ``pf.compile(jit=True)``;
its floor counts one read of g, one read+write of θ, MONA's two bf16 buffers and the 8-bit
momentum (a single pass; the per-tensor norms make ≥ 2 passes necessary, see
docs/techniques/8bit.md).

The pgs rows bind the gradients as the runtime's ``bind()`` does (views of one flat buffer,
so the step reads them in place); ``*_unbound`` rows pass separate gradient tensors, which the
step first copies into a zero-filled flat buffer (how pgs rows were timed before they were bound).

The JSON is rewritten after every row, and the rows in ``--isolate`` (default: the chain
rows) run in a subprocess each, so a CUDA fault loses only its own row (recorded with the
log tail).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import pgs.func as pf
from pgs.func import kernels as K

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


def _time_back_to_back(fn, iters: int) -> tuple[float, float]:
    """(device ms per step, host ms per step) with ``iters`` steps issued back to back, as a
    training loop issues them: the host runs ahead, so the device time excludes launch gaps
    that a queue of earlier work would hide; the host time is what issuing one step costs."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # ~25 ms of queued device work: the host issues unobstructed
    t = time.perf_counter()
    a.record()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) * 1e3 / iters
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, host


def _kernel_trace(fn, steps: int = 3) -> dict:
    """GPU time per step by kernel name (torch.profiler), and the launches per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by, calls = {}, {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        key = e.name[:80]
        by[key] = by.get(key, 0.0) + e.device_time / 1e3 / steps
        calls[key] = calls.get(key, 0) + 1 / steps
    top = sorted(by.items(), key=lambda kv: -kv[1])[:12]
    return dict(gpu_ms_per_step=sum(by.values()), launches_per_step=sum(calls.values()),
                kernels=[dict(name=k, ms=round(v, 4), calls=round(calls[k], 2)) for k, v in top])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds; rows not started by then are skipped (the whole run must stay < 4 min)")
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--isolate", default="pgs_chain,pgs_chain_eager",
                    help="comma-separated rows run in a subprocess each (a CUDA fault there loses only that row)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per isolated row")
    ap.add_argument("--trace", default="pgs_lion8bit,pgs_adamw8bit",
                    help="comma-separated rows whose kernels are also listed (torch.profiler, CUDA only)")
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
    lion_bytes = n * 6 + n8 * 2 + 2 * blocks + (n - n8) * 8
    adam_bytes = n * 6 + n8 * 4 + 4 * blocks + (n - n8) * 16
    bytes_needed = {
        "pgs_lion8bit": lion_bytes,
        "pgs_adamw8bit": adam_bytes,
        "pgs_chain": lion_bytes + n * 8,  # + MONA's two bf16 buffers, read and written
        "bnb_lion8bit": lion_bytes,
        "bnb_adamw8bit": adam_bytes,
        "torch_adamw_fused_bf16": n * 14,
    }
    rows = {}
    only = set(filter(None, args.only.split(",")))
    iters, warmup = (args.iters, 3) if cuda else (2, 1)

    def pgs_row(name, opt, jit=False, sr=False, bound_grads=True, fused=True):
        fast = pf.compile(opt, jit=jit, donate=True, memory=pf.MemoryOptions(stochastic_rounding=sr), fused=fused)
        p = {k: v.clone() for k, v in params.items()}
        fast.bind_buffers(p)
        g = {k: v.clone() for k, v in grads.items()}
        if bound_grads:  # as the runtime's bind() keeps them: views of one flat buffer, no copy per step
            fast.bind_buffers(g)
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

    def lion(**kw):
        return lambda: pgs_row("lion8bit", pf.lion8bit(1e-5, weight_decay=0.1), **kw)

    def adam(**kw):
        return lambda: pgs_row("adamw8bit", pf.adamw8bit(1e-5, weight_decay=0.1), **kw)

    def chain(jit=True, fused=False):  # fused=False: the generic path (one torch.compile graph with jit)
        opt = pf.chain(pf.adagc(), pf.mona(), pf.scale_by_lion8bit(), pf.hyperball(1e-5))
        return lambda: pgs_row("chain", opt, jit=jit and not fused, fused=fused)

    # name: (maker, bytes key)
    makers = {
        "pgs_lion8bit": (lion(), "pgs_lion8bit"),
        "pgs_adamw8bit": (adam(), "pgs_adamw8bit"),
        "pgs_lion8bit_sr": (lion(sr=True), "pgs_lion8bit"),
        # the gradients as separate tensors, copied into a flat buffer every step (+1 zero-fill and
        # +1 copy of the gradient per step)
        "pgs_lion8bit_unbound": (lion(bound_grads=False), "pgs_lion8bit"),
        "pgs_adamw8bit_unbound": (adam(bound_grads=False), "pgs_adamw8bit"),
        "pgs_chain": (chain(), "pgs_chain"),
        "pgs_chain_eager": (chain(jit=False), "pgs_chain"),
        # the same chain through its hand-written passes (pgs.func.fused_chain8bit; jit is not used)
        "pgs_chain_fused": (chain(fused=True), "pgs_chain"),
        "bnb_lion8bit": (lambda: bnb_row("Lion8bit"), "bnb_lion8bit"),
        "bnb_adamw8bit": (lambda: bnb_row("AdamW8bit"), "bnb_adamw8bit"),
        "torch_adamw_fused_bf16": (torch_row, "torch_adamw_fused_bf16"),
    }
    # the headline rows, then the chain (a subprocess), then the rest
    first = ["pgs_lion8bit", "pgs_adamw8bit", "torch_adamw_fused_bf16", "bnb_lion8bit", "bnb_adamw8bit", "pgs_chain"]
    last = ["pgs_chain_eager"]
    order = first + [k for k in makers if k not in first and k not in last] + last
    isolate = set(filter(None, args.isolate.split(","))) - ({next(iter(only))} if len(only) == 1 else set())
    t_start = time.perf_counter()

    def dump():  # after every row: a crash later loses nothing already measured
        out = dict(device=torch.cuda.get_device_name() if cuda else "cpu", params=n, params_8bit=n8,
                   seconds=time.perf_counter() - t_start,
                   tensors=len(shapes), small=args.small, kernel_config=str(K.CONFIG), rows=rows)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)

    for name in order:
        make, key = makers[name]
        if only and name not in only:
            continue
        if time.perf_counter() - t_start > args.budget:
            rows[name] = dict(skipped="time budget")
            dump()
            continue
        if name in isolate:
            rows[name] = _isolated(name, args)
            print(name, rows[name], flush=True)
            dump()
            continue
        try:
            fn = make()
            ms = _time(fn, iters, warmup, cuda)
            floor = bytes_needed[key] / (COPY_GBPS * 1e9) * 1e3
            rows[name] = dict(ms=ms, bytes=bytes_needed[key], bytes_per_param=bytes_needed[key] / n,
                              floor_ms=floor, fraction_of_copy_bw=floor / ms, ratio_to_floor=ms / floor,
)
            if cuda:  # the same step issued back to back (host ahead), and its kernels
                dev_ms, host_ms = _time_back_to_back(fn, iters)
                rows[name].update(back_to_back_ms=dev_ms, host_ms_per_step=host_ms,
                                  back_to_back_fraction_of_copy_bw=floor / dev_ms)
                if name in set(filter(None, args.trace.split(","))):
                    rows[name]["trace"] = _kernel_trace(fn)
        except Exception as e:  # a missing peer must not hide the other rows
            rows[name] = dict(error=f"{type(e).__name__}: {e}")
        finally:
            fn = None
        print(name, rows[name], flush=True)
        dump()
        if cuda:
            torch.cuda.empty_cache()
    dump()


def _isolated(name: str, args) -> dict:
    """Row ``name`` in a fresh process (its own CUDA context): its result, or how it died."""
    tmp = f"{args.out}.{name}.tmp"
    cmd = [sys.executable, os.path.abspath(__file__), tmp, "--only", name, "--iters", str(args.iters),
           "--isolate", "", "--trace", args.trace]
    if args.small:
        cmd.append("--small")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {args.timeout:.0f} s (isolated)")
    try:
        with open(tmp) as f:
            row = json.load(f)["rows"].get(name)
        os.remove(tmp)
    except (OSError, ValueError, KeyError):
        row = None
    if r.returncode != 0 or row is None:
        tail = (r.stdout + r.stderr)[-1500:]
        return dict(error=f"isolated run exited {r.returncode}", log_tail=tail, **(row or {}))
    return row


if __name__ == "__main__":
    main()
