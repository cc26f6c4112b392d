"""Batched Muon (pgs) vs torch.optim.Muon at Qwen3-1.7B hidden-matrix shapes.

Not a test.  Times one optimizer step over the 28 layers' hidden matrices
(q 2048×2048, k/v 1024×2048, o 2048×2048, gate/up 6144×2048, down 2048×6144) for:

- ``pgs``: ``pf.muon``'s Muon branch (momentum, one batched bf16 Newton–Schulz per oriented
  shape, decoupled decay, lr), update + apply;
- ``torch``: ``torch.optim.Muon.step()`` (one matrix at a time);

and reports milliseconds and the ratio to the Newton–Schulz matmul floor:
FLOPs(NS5 over all matrices) / peak (789 TFLOP/s dense bf16 by default, ``--peak-tflops``).

    python bench/muon_bench.py out.json            # on the GPU
    python bench/muon_bench.py out.json --small    # CPU smoke: 2 layers, shapes / 16
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import pgs.func as pf

QWEN3_1_7B = {"q": (2048, 2048), "k": (1024, 2048), "v": (1024, 2048), "o": (2048, 2048),
              "gate": (6144, 2048), "up": (6144, 2048), "down": (2048, 6144)}


def shapes(small: bool) -> dict[str, tuple[int, int]]:
    layers = 2 if small else 28
    div = 16 if small else 1
    return {f"layers.{i}.{k}": (r // div, c // div) for i in range(layers) for k, (r, c) in QWEN3_1_7B.items()}


def ns_flops(shape_map: dict, steps: int = 5) -> float:
    """Matmul FLOPs of NS_k: per iteration 2m²n (X Xᵀ) + 2m³ (A·A) + 2m²n (B X), m ≤ n."""
    total = 0.0
    for r, c in shape_map.values():
        m, n = min(r, c), max(r, c)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="path of the JSON report")
    ap.add_argument("--small", action="store_true", help="CPU smoke: 2 layers, shapes / 16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=789.0, help="dense bf16 peak used for the floor")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = getattr(torch, args.dtype)
    smap = shapes(args.small)
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(device=device, dtype=dtype) * 0.02 for k, s in smap.items()}
    grads = {k: torch.randn(s, generator=gen).to(device=device, dtype=dtype) for k, s in smap.items()}
    lr, wd = 0.02, 0.1

    # pgs: the Muon branch of pf.muon (all matrices route to Muon), update + apply
    opt = pf.chain(pf.scale_by_muon(), pf.add_decayed_weights(wd), pf.scale_by_learning_rate(lr))
    state = {"s": opt.init(params), "p": params}

    def pgs_step():
        u, state["s"] = opt.update(grads, state["s"], state["p"])
        state["p"] = pf.apply_updates(state["p"], u)

    tparams = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for tp, g in zip(tparams, grads.values()):
        tp.grad = g.clone()
    topt = torch.optim.Muon(tparams, lr=lr, weight_decay=wd)

    ms_pgs = timed(pgs_step, device, args.warmup, args.iters)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms_torch = timed(topt.step, device, args.warmup, args.iters)

    flops = ns_flops(smap)
    floor_ms = flops / (args.peak_tflops * 1e12) * 1e3
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "small": args.small,
        "param_dtype": args.dtype,
        "num_matrices": len(smap),
        "ns_flops": flops,
        "peak_tflops": args.peak_tflops,
        "floor_ms": floor_ms,
        "pgs_ms": ms_pgs,
        "torch_ms": ms_torch,
        "pgs_over_floor": ms_pgs / floor_ms,
        "torch_over_floor": ms_torch / floor_ms,
        "speedup_vs_torch": ms_torch / ms_pgs,
        "iters": args.iters,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
