"""PTX of the 8-bit step kernels for an H200 (sm_90), compiled on a machine without a GPU.

A refactor of ``pgs/func/kernels/blockwise8.py`` that should not change the generated code can
be checked without a device: capture the launches ``pgs.func.kernels`` makes for Lion8bit and
AdamW8bit (direction / apply, with and without stochastic rounding, bf16 and fp32 parameters;
nothing is launched), compile each for ``GPUTarget("cuda", 90, 32)`` with the same constexprs and
options, and print a SHA-256 of each PTX's code, debug information stripped (``--out DIR``
also writes that code).  Run it before and
after the change and compare the lines.

    python bench/experiments/kernel_ptx.py [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pgs.func.kernels as K
from pgs.func.quant8 import Quantized8bit

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
         torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")


def captured() -> list[tuple[str, object, tuple, dict]]:
    """(label, kernel, args, kw) of every step-kernel launch of the cases, none launched."""
    got: list = []
    launch = K._launch
    K._launch = lambda kernel, grid, args, kw: got.append((kernel, args, kw))
    out = []
    try:
        bs = 256
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.randn(4 * bs, dtype=dtype)
            p = torch.randn(4 * bs, dtype=dtype)
            m = Quantized8bit(torch.zeros(4 * bs, dtype=torch.uint8), torch.ones(4))
            v = Quantized8bit(torch.zeros(4 * bs, dtype=torch.uint8), torch.ones(4))
            seed = torch.tensor([7], dtype=torch.int64) if dtype == torch.bfloat16 else None
            cases = [
                ("lion direction", lambda: K._lion8bit(g, m, torch.ones(2), bs)),
                ("lion apply", lambda: K._lion8bit(g, m, torch.ones(4), bs, p=p, out=p, m_out=m, seed=seed)),
                ("adam direction", lambda: K._adam8bit(g, m, v, torch.ones(7), bs)),
                ("adam apply", lambda: K._adam8bit(g, m, v, torch.ones(9), bs, p=p, out=p, m_out=m, v_out=v,
                                                  seed=seed)),
            ]
            for label, call in cases:
                got.clear()
                call()
                for kernel, args, kw in got:
                    out.append((f"{label} {TYPES[dtype]}{' SR' if seed is not None and 'apply' in label else ''}",
                                kernel, args, kw))
    finally:
        K._launch = launch
    return out


def ptx(kernel, args: tuple, kw: dict) -> str:
    names = [p.name for p in kernel.params]
    sig, constexprs = {}, {}
    for name, a in zip(names, args):
        sig[name] = "*" + TYPES[a.dtype] if isinstance(a, torch.Tensor) else "i32"
    for p in kernel.params[len(args):]:
        value = kw.get(p.name, p.default)
        sig[p.name] = "constexpr"
        constexprs[(names.index(p.name),)] = value
    options = {k: v for k, v in kw.items() if k in OPTIONS}
    src = ASTSource(kernel, sig, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def code_only(text: str) -> str:
    """The PTX without its debug information (``.loc`` / ``.file`` lines, the ``.debug_*``
    sections, ``$L__tmp`` / ``$L__func`` labels that only mark source positions, ``//`` comments),
    so a change of source lines alone hashes the same."""
    import re

    text = text.split("\t.section\t.debug", 1)[0]
    kept = []
    for line in text.splitlines():
        line = line.split("//", 1)[0].rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith((".loc", ".file")) or re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d*:", stripped):
            continue
        kept.append(line)
    return "\n".join(kept)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    for label, kernel, args, kw in captured():
        text = code_only(ptx(kernel, args, kw))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{label:<28} {kernel.fn.__name__:<16} {digest}  {len(text.splitlines())} lines", flush=True)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, label.replace(" ", "_") + ".ptx"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
