"""Offline sm_90 compile of the whole-chain passes (``pgs.func.kernels.chain8bit``): that they
build for the GPU, their registers and static SASS instructions per element.

    python bench/experiments/chain8bit_sass.py

No GPU needed (``triton.compile`` for GPUTarget("cuda", 90, 32), ``cuobjdump`` from Triton's
bundle; same machinery as ``sass_count.py``).  The kernels are compiled whole (unmasked and
masked bodies both), so the count is of the larger, SPLIT=True program; per element =
count / (ROWS·BLOCK / threads) elements per thread, an upper bound of what a full program runs.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import sass_count as sc  # noqa: E402

from pgs.func.kernels import chain8bit as kc  # noqa: E402

TYPES = {
    "g_ptr": "*bf16", "p_ptr": "*bf16", "out_ptr": "*bf16", "prev_ptr": "*bf16", "acc_ptr": "*bf16",
    "prev_out_ptr": "*bf16", "acc_out_ptr": "*bf16", "seg_ptr": "*i64", "u_ptr": "*i8", "seed_ptr": "*i64",
    "x_ptr": "*bf16", "n": "i32",
}


_ORIG = sc._type


def typ(name, const):
    if name in TYPES:
        return TYPES[name]
    if name in ("m_ptr", "m_out_ptr"):
        return "*fp32"
    return _ORIG(name, const)


def main():
    sc._type = typ
    cases = [
        ("pass A sumsq", kc.sumsq_kernel, dict(BLOCK=256, ROWS=4), 4 * 256 // 128),
        ("pass B, 8-bit m, constrained", kc.chain_b_kernel,
         dict(BLOCK=256, ROWS=4, GDT=1, PDT=1, ADT=1, Q8=True, PROJ=True, SR=False, DEQ_TABLE=True, ENC=2, RNG=1,
              SPLIT=True, TABLE=0), 8),
        ("pass B, 8-bit m, free (θ applied)", kc.chain_b_kernel,
         dict(BLOCK=256, ROWS=4, GDT=1, PDT=1, ADT=1, Q8=True, PROJ=False, SR=False, DEQ_TABLE=True, ENC=2, RNG=1,
              SPLIT=True, TABLE=0), 8),
        ("pass B, fp32 m, free", kc.chain_b_kernel,
         dict(BLOCK=256, ROWS=4, GDT=1, PDT=1, ADT=1, Q8=False, PROJ=False, SR=False, DEQ_TABLE=True, ENC=2, RNG=1,
              SPLIT=True, TABLE=0), 8),
        ("pass B, 8-bit m, constrained, PACK", kc.chain_b_kernel,
         dict(BLOCK=256, ROWS=4, GDT=1, PDT=1, ADT=1, Q8=True, PROJ=True, SR=False, DEQ_TABLE=True, ENC=2, RNG=1,
              SPLIT=True, TABLE=0, PACK=True), 8),
        ("pass C, PACK", kc.chain_c_kernel, dict(BLOCK=256, ROWS=8, GDT=1, PDT=1, SR=False, RNG=1, SPLIT=True, PACK=True),
         16),
        ("pass C", kc.chain_c_kernel, dict(BLOCK=256, ROWS=8, GDT=1, PDT=1, SR=False, RNG=1, SPLIT=True), 16),
        ("pass C + SR", kc.chain_c_kernel, dict(BLOCK=256, ROWS=8, GDT=1, PDT=1, SR=True, RNG=1, SPLIT=True), 16),
    ]
    print(f"{'kernel':40s} {'regs':>5s} {'SASS':>6s} {'per elem':>9s} {'shared ld/st, bar':>18s}")
    for name, fn, const, per_thread in cases:
        sass, regs = sc.compile_sass(fn, const, 4)
        total, ops = sc.count(sass)
        shared = f"{ops.get('LDS', 0)}/{ops.get('STS', 0)}, {ops.get('BAR', 0)}"
        print(f"{name:40s} {regs:5d} {total:6d} {total / per_thread:9.1f} {shared:>18s}")


if __name__ == "__main__":
    main()
