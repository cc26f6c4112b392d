"""Static SASS instructions per element of the 8-bit kernels, compiled offline for sm_90.

    python bench/experiments/sass_count.py            # table of variants
    python bench/experiments/sass_count.py --dump DIR # also write each variant's SASS

No GPU needed: ``triton.compile`` targets sm_90 and the cubin is disassembled with the
``cuobjdump`` Triton bundles.  Counts are static (each instruction once, NOPs excluded),
over the path up to the last EXIT (the slow-path subroutines of ``div_rn`` that follow it
are left out); per element = count / elements per thread.  The kernel *bodies* are compiled
directly, so a variant is either the unmasked copy (what every full program runs) or the
masked one (the tail program).  A static count is a proxy: it ignores issue stalls and the
L1 cost of gathers (reported as a separate column: gathers per element).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from pgs.func.kernels import blockwise8 as bw  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTR = {"g_ptr": "*bf16", "p_ptr": "*bf16", "out_ptr": "*bf16", "hp_ptr": "*fp32", "seed_ptr": "*i64",
       "n": "i32", "pid": "i32"}


def _type(name: str, const: dict) -> str:
    if name in PTR:
        return PTR[name]
    if "codes" in name:
        return "*u8"
    if "btab" in name:
        enc = const.get("ENC_V" if "_v_" in name else "ENC")
        return "*i32" if enc in (2, 3) else "*i16"
    if name.endswith("_ptr"):
        return "*fp32"
    return "constexpr"


def compile_sass(fn, const: dict, num_warps: int) -> str:
    sig = {a: _type(a, const) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and a not in ("pid",)}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    return sass, regs


def count(sass: str):
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ins.append(m.group(2))
    last_exit = max(i for i, op in enumerate(ins) if op.startswith("EXIT"))
    main = [op for op in ins[: last_exit + 1] if not op.startswith("NOP")]
    ops = collections.Counter(op.split(".")[0] for op in main)
    return len(main), ops


L0 = dict(DEQ_TABLE=True, ENC=2, RNG=1, MASKED=False)  # Lion defaults
A0 = dict(DEQ_TABLE=True, ENC=2, ENC_V=0, RNG=1, FAST_DIV=True, MASKED=False)  # AdamW defaults
VARIANTS = {
    # name: (kernel body, constexprs)
    "lion  before: philox, arith enc, masked": ("lion", dict(DEQ_TABLE=True, ENC=0, RNG=0, MASKED=True)),
    "lion  + hash rng": ("lion", dict(DEQ_TABLE=True, ENC=0, RNG=1, MASKED=True)),
    "lion  + hash rng + unmasked": ("lion", dict(DEQ_TABLE=True, ENC=0, RNG=1, MASKED=False)),
    "lion  + ... + ENC=1 (int16 |s| table)": ("lion", {**L0, "ENC": 1}),
    "lion  + ... + ENC=2 (int32 |s| table) [default]": ("lion", L0),
    "lion  + ... + ENC=3 (whole-word table)": ("lion", {**L0, "ENC": 3}),
    "lion  default, masked copy (tail program)": ("lion", {**L0, "MASKED": True}),
    "lion  default, arithmetic decode": ("lion", {**L0, "DEQ_TABLE": False}),
    "lion  default, no SR": ("lion", {**L0, "SR": False}),
    "lion  default, ROWS=8 (16 elem/thread)": ("lion", {**L0, "ROWS": 8}),
    "adam  before: philox, arith enc, div_rn, masked":
        ("adam", dict(DEQ_TABLE=True, ENC=0, ENC_V=0, RNG=0, FAST_DIV=False, MASKED=True)),
    "adam  + hash + unmasked + fast div": ("adam", {**A0, "ENC": 0}),
    "adam  + ... + ENC=2 m / ENC_V=0 v [default]": ("adam", A0),
    "adam  + ... + ENC=2 m / ENC_V=2 v": ("adam", {**A0, "ENC_V": 2}),
    "adam  + ... + ENC=3 m / ENC_V=3 v": ("adam", {**A0, "ENC": 3, "ENC_V": 3}),
    "adam  + ... + ENC=1 m / ENC_V=1 v": ("adam", {**A0, "ENC": 1, "ENC_V": 1}),
    "adam  default, div_rn": ("adam", {**A0, "FAST_DIV": False}),
    "adam  default, ROWS=8 (16 elem/thread)": ("adam", {**A0, "ROWS": 8}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, bf16 params+grads, APPLY, block 256, 4 warps")
    print(f"{'variant':54s} {'instr':>6s} {'/elem':>6s} {'LDG/elem':>8s} {'IMAD/elem':>9s} {'regs':>5s}")
    for name, (which, c) in VARIANTS.items():
        if args.only and args.only not in name:
            continue
        const = dict(BLOCK=256, ROWS=4, APPLY=True, SR=True)
        const.update(c)
        fn = bw._lion8bit_body if which == "lion" else bw._adam8bit_body
        warps = 4
        sass, regs = compile_sass(fn, const, warps)
        per = const["ROWS"] * const["BLOCK"] / (32 * warps)
        n, ops = count(sass)
        print(f"{name:54s} {n:6d} {n / per:6.1f} {ops['LDG'] / per:8.2f} {ops['IMAD'] / per:9.1f} {regs:5d}",
              flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name).strip("_") + ".sass"), "w") as f:
                f.write(sass)


if __name__ == "__main__":
    main()
