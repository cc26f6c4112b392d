"""A few fused Lion8bit steps over one large flat buffer: the launch that ncu profiles (issue #4).

    ncu --clock-control none -k regex:lion8bit --launch-skip 2 --launch-count 1 \\
        python bench/experiments/ncu_lion8bit.py --table gather
    python bench/experiments/ncu_lion8bit.py --n 8192 --steps 2     # CPU dry run (interpreter)

Each step is exactly one ``lion8bit_kernel`` launch (``pgs.func.kernels.lion8bit`` with a
parameter: the in-place apply path of the bench's fused step, bf16 params and grads, no
stochastic rounding unless ``--sr``); the momentum starts as the quantized Gaussian, so the
codes are spread like a trained state's.  ``--launch-skip 2`` therefore profiles the third
step (a warm one).  The momentum is quantized by ``quantize_kernel`` first, which a
``regex:lion8bit`` filter does not match.  Switches: ``--table`` (``TABLE``) and
``--set NAME=VALUE`` for any other ``pgs.func.kernels`` switch (ints where they parse).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be on before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from pgs.func import kernels as K  # noqa: E402

BLOCK = 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100 * 2**20, help="elements (default ~105M)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--table", default=None, help="pgs.func.kernels.TABLE: global | gather | gather_dec")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="another pgs.func.kernels switch, e.g. LION_ROWS=16 or NUM_WARPS=8")
    ap.add_argument("--sr", action="store_true", help="stochastic rounding of the bf16 parameters")
    args = ap.parse_args()
    if args.table is not None:
        K.TABLE = args.table
    for kv in args.set:
        name, val = kv.split("=", 1)
        if not hasattr(K, name):
            raise SystemExit(f"pgs.func.kernels has no switch {name!r}")
        try:
            val = int(val)
        except ValueError:
            pass
        setattr(K, name, val)
    K._table()  # refuse an unknown TABLE mode before allocating anything
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    n = args.n
    g = (torch.randn(n, device=dev, generator=gen) * 1e-3).bfloat16()
    p = (torch.randn(n, device=dev, generator=gen) * 0.02).bfloat16()
    m = K.quantize(torch.randn(n, device=dev, generator=gen) * 1e-4, True, BLOCK)
    hp = torch.tensor([0.1, 0.01, 1e-5, 0.1], dtype=torch.float32, device=dev)  # 1−β1, 1−β2, η, λ
    seed = torch.tensor([1234], dtype=torch.int64, device=dev) if args.sr else None
    switches = {k: getattr(K, k) for k in ("TABLE", "ENC", "DEQ_TABLE", "RNG", "SPLIT", "LION_ROWS", "NUM_WARPS",
                                           "FP_FUSION")}
    print(f"ncu_lion8bit: n={n} device={torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'} "
          f"sr={args.sr} {switches}", flush=True)
    floor_ms = (n * 8 + n // BLOCK * 8) / 4284e9 * 1e3  # grad 2 + param 2+2 + codes 1+1 + absmax, copy bw
    for i in range(args.steps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            K.lion8bit(g, m, hp, BLOCK, p=p, out=p, m_out=m, seed=seed)
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            K.lion8bit(g, m, hp, BLOCK, p=p, out=p, m_out=m, seed=seed)
            ms = (time.perf_counter() - t) * 1e3
        print(f"step {i}: {ms:.3f} ms (byte floor {floor_ms:.3f} ms, {floor_ms / ms:.2f} of copy bw)", flush=True)
    ok = bool(torch.isfinite(p.float()).all()) and int(m.codes.max()) <= 255
    print(f"ncu_lion8bit: done, params finite={ok}, codes mean={m.codes.float().mean().item():.2f}", flush=True)


if __name__ == "__main__":
    main()
