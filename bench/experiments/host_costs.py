"""Host (CPU) cost of the pieces of a gradient-release group step, on a GPU (issue #8).

    PYTHONPATH=. python bench/experiments/host_costs.py OUT.json

Each item is issued many times behind ~50 ms of queued device work (``torch.cuda._sleep``),
so the host never waits for the device: perf_counter over the loop / count is what issuing
one call costs the host.  Items: a tiny torch op, a Triton launch of the Lion8bit kernel on a
Qwen3-4B MLP weight (in place, stochastic rounding), ``fused_step`` of ``pf.lion8bit`` on a
whole Qwen3-4B decoder layer (11 tensors, as ``GradientRelease`` calls it), and the same for
``pf.adamw8bit``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import pgs.func as pf
from pgs.func import kernels as K


def host_us(fn, n: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def layer(dev):
    h, inter, q, kv, hd = 2560, 9728, 4096, 1024, 128
    shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h),
              "down": (h, inter), "q_norm": (hd,), "k_norm": (hd,), "ln1": (h,), "ln2": (h,)}
    gen = torch.Generator(device=dev).manual_seed(0)
    p = {k: (torch.randn(s, device=dev, generator=gen) * 0.02).bfloat16() for k, s in shapes.items()}
    g = {k: (torch.randn(s, device=dev, generator=gen) * 1e-3).bfloat16() for k, s in shapes.items()}
    return p, g


def fused_call(opt, p, g, sr: bool):
    state = [opt.init(p)]
    names = list(state[0]) if isinstance(state[0], dict) else None

    def call():
        out = opt.fused_step(g, state[0], p, layout=None, donate=True, stochastic_rounding=sr,
                             extra={"sr_offset": 0})
        state[0] = out[1]
    return call, names


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/host_costs.json"
    dev = torch.device("cuda")
    res = {}
    x = torch.zeros(16, device=dev)
    res["torch x.add_(1) (one tiny kernel)"] = host_us(lambda: x.add_(1), 2000)
    y = torch.zeros((), device=dev)
    res["torch 0-d int increment (clamp + add)"] = host_us(lambda: torch.clamp(y, max=1e9).add(1), 2000)
    p, g = layer(dev)
    w, gw = p["gate"], g["gate"]
    m = pf.scale_by_lion8bit().init({"w": w})
    mq = m.mu["w"]
    hp = torch.tensor([0.1, 0.01, 1e-5, 0.0], device=dev)
    seed = torch.tensor([1], dtype=torch.int64, device=dev)
    for fast in (False, True):
        K.FAST_LAUNCH = fast
        res[f"triton lion8bit launch (gate_proj, in place, SR), FAST_LAUNCH={fast}"] = host_us(
            lambda: K.lion8bit(gw, mq, hp, 256, p=w, out=w, m_out=mq, seed=seed), 500)
    for name, opt in [("lion8bit", pf.lion8bit(1e-5, weight_decay=0.1)), ("adamw8bit", pf.adamw8bit(1e-5, weight_decay=0.1))]:
        for sr in (True, False):
            for fast in (False, True):
                K.FAST_LAUNCH = fast
                call, _ = fused_call(opt, p, g, sr)
                res[f"fused_step {name}, one Qwen3-4B layer (11 tensors), SR={sr}, FAST_LAUNCH={fast}"] = \
                    host_us(call, 200)
    for k, v in res.items():
        print(f"{v:10.1f} us  {k}")
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "host_us": res}, f, indent=2)


if __name__ == "__main__":
    main()
