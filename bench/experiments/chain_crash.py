"""Issue #4 diagnostics: the design chain (adagc → mona → lion8bit direction → hyperball) on
the device, one configuration per process (a CUDA fault poisons the process).

    CUDA_LAUNCH_BLOCKING=1 PGS_8BIT_OPAQUE=0 python bench/experiments/chain_crash.py --size small --jit 1

Kernel switches come from the environment (``PGS_8BIT_*``, read by ``pgs.func.kernels`` at
import).  Prints one JSON line: ok / the error, the step it died in, and (``--time``) the
median step time.  Gradients carry whole zero blocks, denormals, −0, huge values, and one
tensor whose length is not a multiple of ROWS·BLOCK.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from optim_8bit import qwen3_shapes  # noqa: E402

import pgs.func as pf  # noqa: E402
from pgs.func import kernels as K  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the torch reference path (plumbing only)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def special(g: torch.Tensor) -> torch.Tensor:
    f = g.flatten()
    if f.numel() >= 1024:
        f[:256] = 0.0
        f[256:264] = -0.0
        f[264:272] = 1e-40
        f[272:280] = -3e-39
        f[512:516] = 1e4
        f[516:520] = -1e-30
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=["small", "full"])
    ap.add_argument("--jit", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time", type=int, default=0, help="timed steps after the checked ones")
    args = ap.parse_args()
    cfg = dict(size=args.size, jit=args.jit, **{k: getattr(K, k) for k in ("ENC", "ENC_V", "RNG", "SPLIT",
                                                                           "DEQ_TABLE", "ROWS", "LION_ROWS", "OPAQUE")},
               check=os.environ.get("PGS_8BIT_CHECK", "0"))
    step_i = -1
    t0 = time.perf_counter()
    try:
        shapes = qwen3_shapes(args.size == "small")
        shapes["odd.weight"] = (1000, 77)  # 77000: not a multiple of ROWS·BLOCK
        gen = torch.Generator(device=DEV).manual_seed(0)
        params = {k: (torch.randn(s, device=DEV, generator=gen) * 0.02).bfloat16() for k, s in shapes.items()}
        grads = {k: special((torch.randn(s, device=DEV, generator=gen) * 1e-3).bfloat16())
                 for k, s in shapes.items()}
        opt = pf.chain(pf.adagc(), pf.mona(), pf.scale_by_lion8bit(), pf.hyperball(1e-5))
        fast = pf.compile(opt, jit=bool(args.jit), donate=True)
        fast.bind_buffers(params)
        state = fast.init(params)
        for step_i in range(args.steps):
            _, state = fast.step(grads, state, params)
            sync()
        bad = [k for k, v in params.items() if not torch.isfinite(v).all()]
        times = []
        for _ in range(args.time if DEV == "cuda" else 0):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _, state = fast.step(grads, state, params)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        res = dict(ok=not bad, nonfinite=bad[:5], ms=statistics.median(times) if times else None)
    except BaseException as e:  # noqa: BLE001 - report whatever killed it
        res = dict(ok=False, step=step_i, error=f"{type(e).__name__}: {str(e)[:600]}",
                   where=traceback.format_exc()[-2500:])
    res.update(cfg, seconds=round(time.perf_counter() - t0, 1))
    print("CHAIN_RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
