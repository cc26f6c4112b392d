"""Triton kernels: dequantize → optimizer update → requantize, in one pass over memory.

One program owns ``ROWS`` whole quantization blocks (``BLOCK`` elements each), so the new
per-block absmax is a reduction inside the program and nothing is written twice.  Each
element's bytes move once: read the gradient, the codes (and, when applying, the
parameter), write the codes (and the parameter or the direction).

Quantization (``ENC``, see ``pgs.func.kernels``) is a table lookup per element (the codes'
count below the value's bucket, one integer compare against the one midpoint inside it) or
gather-free arithmetic with bnb's exact rounding (``_encode``); every encoder gives the
reference's codes bit for bit.  Dequantization gathers the map entry (``DEQ_TABLE``) or
rebuilds it from the code by the map's own construction (two fmas, an add, a multiply).
Table gathers are inline-PTX loads (``_gather``) so that Triton keeps the streaming layout;
``TABLE`` (``pgs.func.kernels.TABLE``, "gather") instead loads the tables once per program
into registers and picks entries with ``tl.gather`` (``_reg_table``).

The maths mirrors the torch reference (``pgs.func.quant8``, ``pgs.func.lion8bit``,
``pgs.func.adam8bit``) operation for operation; on a GPU the compiler may contract a
multiply-add into an FMA, so results agree to the last bit only up to that (the tests
bound the difference; ``FP_FUSION=False`` in ``pgs.func.kernels`` turns contraction off).

Hyperparameters arrive as a small fp32 tensor on the device (``hp``), never as Python
numbers: a schedule's value or an injected tensor is read in the kernel with no host sync
and no recompilation.  The stochastic-rounding seed is read from a device tensor too.

Importing this module needs Triton; ``pgs.func.kernels`` imports it lazily.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from pgs.func.quant8 import MIN_SCALE as _MIN_SCALE
from pgs.func.quant8 import dynamic_map as _dynamic_map

MIN_SCALE = tl.constexpr(_MIN_SCALE)

# ----------------------------------------------------------------------------------------
# The dynamic map in closed form (no table lookups in the hot path)
#
# Level L = 0..6 of the map holds F codes Q = RN(c_j · p_L), p_L = fp32(10^(L−6)),
# c_j = RN(e_j + e_{j+1})/2, e = torch.linspace(0.1, 1, F+1) in fp32 (F = 2^L signed,
# 2^(L+1) unsigned).  torch's linspace is e_j = fma(step, j, 0.1f) for j < (F+1)//2 and
# fma(step, j − F, 1) above, step = RN(1 − 0.1f)/F (exact: F is a power of two); an fma
# rounds once on every device (the interpreter emulates it exactly), so ``_decode`` repeats
# those roundings and rebuilds every entry bit for bit.  Q = RN(RN(e_j + e_{j+1}) · K_L)
# with K_L = p_L/2.
_STEP1 = 0.8999999761581421  # RN(1 − fp32(0.1)): the linspace step for F = 1


def _k_consts() -> list[float]:
    import numpy as np

    return [float(np.float32(10.0 ** (lev - 6))) / 2 for lev in range(7)]


K0, K1, K2, K3, K4, K5, K6 = (tl.constexpr(k) for k in _k_consts())
STEP1 = tl.constexpr(_STEP1)


def _y_first_mid(signed: bool) -> float:
    # Position, in level-0 bin units y = (x·10^6 − 0.1)·F/0.9, of the midpoint between the
    # code of 0 and the first level-0 code (every other level's lower midpoint sits at 0.2).
    q = _dynamic_map(signed).double()
    first = float(q[q > 0][0])
    f = 1 if signed else 2
    return (first / 2 * 1e6 - 0.1) * f / 0.9


Y0_S = tl.constexpr(_y_first_mid(True))
Y0_U = tl.constexpr(_y_first_mid(False))
#: Half-width (in bin units) of the window around a midpoint inside which the code is
#: decided against the exact fp32 midpoint (one predicated load, ~0.1% of elements).  The
#: arithmetic position y is good to < 1e-4 bins (approximate exp2 ≤ 2^-21 relative plus a
#: few fp32 roundings, times ≤ 142 bins per unit), and the fp32 midpoints sit within 7e-6
#: bins of their ideal positions (a test checks it), so 2^-11 ≈ 4.9e-4 leaves a 5× margin.
NEAR = tl.constexpr(2.0**-11)
_LOG10_2 = 0.30102999566398120
#: floor(MITCHELL_A·bits(t) + MITCHELL_B) = floor(log10(t) + 7) or one less (bits(t)·2^-23 − 127
#: is a lower bound of log2 t, exact at powers of two).
MITCHELL_A = tl.constexpr(_LOG10_2 * 2.0**-23)
MITCHELL_B = tl.constexpr(7.0 - 127.0 * _LOG10_2)
LOG2_10 = tl.constexpr(3.3219280948873623)
#: x + 2^23 for a small integer-valued float x has the bits 0x4B000000 + x.
MAGIC_I = tl.constexpr(8388608.0)
MAGIC_I_BITS = tl.constexpr(0x4B000000)
MAGIC_F_S = tl.constexpr(8388608.0 + 127.0)  # (bits << 23) is then the fp32 2^L
MAGIC_F_U = tl.constexpr(8388608.0 + 128.0)  # 2^(L+1)


from pgs.func.quant8 import BUCKET_MANTISSA_BITS as _MB  # noqa: E402

#: Bucket-table encoder (``_encode_bucket``): mantissa bits per bucket, per map (see
#: ``pgs.func.quant8.bucket_table``).
MB_S = tl.constexpr(_MB[True])
MB_U = tl.constexpr(_MB[False])
SHIFT_S = tl.constexpr(23 - _MB[True])
SHIFT_U = tl.constexpr(23 - _MB[False])
LOWMASK_S = tl.constexpr((1 << (23 - _MB[True])) - 1)
LOWMASK_U = tl.constexpr((1 << (23 - _MB[False])) - 1)

def _midp_len(signed: bool) -> int:
    from pgs.func.quant8 import midpoints

    m = midpoints(_dynamic_map(signed))
    return int((m > 0).sum()) + 1  # positive midpoints + inf (``bucket_table``)


#: Lengths of the positive-midpoint tables (bounds of ``_encode_bucket``'s second lookup).
MIDP_S = tl.constexpr(_midp_len(True))
MIDP_U = tl.constexpr(_midp_len(False))


def _gather_window(signed: bool) -> tuple[int, int]:
    """(first bucket, power-of-two length) of the slice of ``bucket_table`` that ``TABLE``
    gather mode holds in registers: it ends at the bucket of 1.0 and starts at or below the
    last bucket without a midpoint that precedes the first positive midpoint.  Every entry
    before the slice equals its first entry (c = 0, no midpoint), every entry after it its
    last one (c = all positive midpoints, no midpoint; values > 1 and NaN buckets: the clamp
    and the NaN select decide those), so clamping the bucket index into the slice gives the
    full table's entry for every fp32 word (``tests/test_kernels_interpret.py`` checks it)."""
    import torch

    from pgs.func.quant8 import _positive_midpoints

    shift = 23 - _MB[signed]
    first = int(_positive_midpoints(signed)[:1].view(torch.int32)) >> shift  # its bucket
    hi = 0x3F800000 >> shift
    size = 1 << (hi - first + 1).bit_length()  # > hi − first + 1: room for one empty bucket below
    return hi - size + 1, size


#: Gather mode's bucket-table slice per map: first bucket (``GLO``), length (``GSIZE``,
#: 2048 signed / 4096 unsigned entries) and last bucket (``GHI``, the bucket of 1.0).
GLO_S, GSIZE_S = (tl.constexpr(v) for v in _gather_window(True))
GLO_U, GSIZE_U = (tl.constexpr(v) for v in _gather_window(False))
GHI_S = tl.constexpr(0x3F800000 >> (23 - _MB[True]))
GHI_U = tl.constexpr(0x3F800000 >> (23 - _MB[False]))


@triton.jit
def _level_const(L, C0, C1, C2, C3, C4, C5, C6):
    # A per-level constant by a 3-bit select tree on the level L (an int32 in 0..6).
    b0 = (L & 1) != 0
    b1 = (L & 2) != 0
    lo = tl.where(b1, tl.where(b0, C3, C2), tl.where(b0, C1, C0))
    hi = tl.where(b1, C6, tl.where(b0, C5, C4))
    return tl.where((L & 4) != 0, hi, lo)


@triton.jit
def _linspace(jf, Ff, step):
    # fp32 torch.linspace(0.1, 1, F+1)[j] (see the module notes); jf, Ff exact small floats.
    first = jf < tl.maximum(Ff * 0.5, 1.0)  # j < (F+1)//2
    return tl.math.fma(step, tl.where(first, jf, jf - Ff), tl.where(first, 0.1, 1.0))


@triton.jit
def _decode(codes, SIGNED: tl.constexpr):
    """Exact map values Q[codes] (``codes`` int32 in 0..255), by arithmetic only."""
    if SIGNED:
        p = codes - 127
        a = tl.abs(p)  # 0 → 0.0; 2^L + j → level L, code j; 128 → 1.0
    else:
        a = codes + 1  # 1 → 0.0; 2^(L+1) + j → level L, code j; 256 → 1.0
    af = a.to(tl.float32)
    m = ((af.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a) = log2 F
    m = tl.minimum(tl.maximum(m, 0), 7)
    Ff = ((m + 127) << 23).to(tl.float32, bitcast=True)  # 2^m
    step = ((127 - m) << 23).to(tl.float32, bitcast=True) * STEP1  # 0.9f / F, exact
    jf = af - Ff
    c2 = _linspace(jf, Ff, step) + _linspace(jf + 1.0, Ff, step)
    if SIGNED:
        v = c2 * _level_const(m, K0, K1, K2, K3, K4, K5, K6)
        v = tl.where(a == 0, 0.0, tl.where(a == 128, 1.0, v))
        v = tl.where(p < 0, -v, v)
    else:
        v = c2 * _level_const(tl.maximum(m - 1, 0), K0, K1, K2, K3, K4, K5, K6)
        v = tl.where(a == 1, 0.0, tl.where(a == 256, 1.0, v))
    return v


@triton.jit
def _encode(xs, mids_ptr, SIGNED: tl.constexpr):
    """Codes of ``xs = x·(1/absmax)`` (unclamped; NaN → 255): ``#{midpoints < clamp(xs, −1, 1)}``.

    Arithmetic: the decade L from the exponent bits, the linear bin coordinate y inside it, the nearest
    midpoint k from y; the code is k or k+1 by ``y > y_k``.  Only where y lies within
    ``NEAR`` of y_k (values at or next to a midpoint) is the exact fp32 midpoint loaded and
    compared (one predicated load; idle lanes issue no memory traffic).
    """
    nan = xs != xs
    t = tl.where(nan, 0.0, tl.minimum(tl.abs(xs), 1.0))
    neg = xs < 0
    # Decade from the fp32 bits read as a (Mitchell) log2: never above log2 t (plus 2^-17),
    # so the estimate is the true decade or one below; one compare of x = t·10^(6−L) ≥ 1
    # moves it up.  Off by one only within ~1e-7 of a power of ten, where either level's
    # coordinates give the same code (the boundary midpoints sit 0.2 bins inside a level).
    tb = t.to(tl.int32, bitcast=True).to(tl.float32)
    L = tl.minimum(tl.maximum(tl.floor(tb * MITCHELL_A + MITCHELL_B), 0.0), 6.0)
    x = t * tl.exp2((6.0 - L) * LOG2_10)  # ≈ 10^(6−L); only y's accuracy depends on it
    up = (x >= 1.0) & (L < 6.0)
    L = tl.where(up, L + 1.0, L)
    x = tl.where(up, x * 0.1, x)
    # F = 2^L (2^(L+1) unsigned) and later k, as float↔int by the 2^23 magic number: one
    # add and one shift/subtract instead of the slow conversion pipe.
    if SIGNED:
        Ff = ((L + MAGIC_F_S).to(tl.int32, bitcast=True) << 23).to(tl.float32, bitcast=True)
    else:
        Ff = ((L + MAGIC_F_U).to(tl.int32, bitcast=True) << 23).to(tl.float32, bitcast=True)
    y = (x - 0.1) * (Ff * (1.0 / 0.9))
    # Midpoints in bin units: the one below the level's first code at 0.2 (Y0 for level 0),
    # the interior ones at 1..F−1; above them level L<6 continues at the next level's 0.2
    # (never nearest: r stops at F−1) and level 6 at F − 0.25 (between its last code and 1).
    rmax = Ff - 1.0 + tl.maximum(L - 5.0, 0.0)
    r = tl.minimum(tl.maximum(tl.floor(y + 0.4), 0.0), rmax)
    if SIGNED:
        ylo = tl.where(L == 0.0, Y0_S, 0.2)
        kf = Ff + r - 1.0  # index of that midpoint among the positive ones
    else:
        ylo = tl.where(L == 0.0, Y0_U, 0.2)
        kf = Ff + r - 2.0
    k = (kf + MAGIC_I).to(tl.int32, bitcast=True) - MAGIC_I_BITS
    yk = tl.minimum(tl.maximum(r, ylo), Ff - 0.25)  # r=0 → ylo; r=F (level 6 only) → F − 0.25
    above = y > yk
    near = tl.abs(y - yk) < NEAR
    if SIGNED:
        mid = _gather_if(mids_ptr, 127 + k, near, 255)
    else:
        mid = _gather_if(mids_ptr, k, near, 255)
    # s < 0: the mirrored midpoint −mid is below s iff t < mid, so ties go to t ≥ mid.
    above = tl.where(near, tl.where(neg, t >= mid, t > mid), above)
    cnt = k + above.to(tl.int32)
    if SIGNED:
        code = tl.where(neg, 127 - tl.minimum(cnt, 127), 127 + cnt)
    else:
        code = tl.where(neg, 0, cnt)
    return tl.where(nan, 255, code)


@triton.jit
def _encode_bucket(xs, btab_ptr, midp_ptr, SIGNED: tl.constexpr, MB: tl.constexpr, WIDE: tl.constexpr,
                   GATHER: tl.constexpr = False):
    """``_encode`` by one 16-bit table gather: the same codes, ~half the ALU work.

    T = bits of |xs|; its bucket is T's exponent and top ``MB`` mantissa bits (the table
    spans every non-negative fp32, values above 1 reading as 1: the reference's clamp).
    ``bucket_table`` holds per bucket c = #{positive midpoints < bucket start} (high byte)
    and the next 8 bits of the one midpoint inside the bucket, if any (low byte; 0xFF if
    none).  t and that midpoint share every bit above, so t is above it iff its next 8
    bits are larger, or equal and the exact fp32 midpoint ``midp[c]`` (a predicated load,
    ~1/256 of the elements in a bucket with a midpoint) is below t (ties by the sign, as
    in ``_encode``).

    GATHER (``TABLE`` gather mode): the program loads the table's slice from the first empty
    bucket below the smallest midpoint to the bucket of 1.0 once into registers
    (``_gather_window``) and indexes it with ``tl.gather``; the bucket index is clamped into
    the slice, whose end entries equal every entry beyond them: the same entries.
    """
    bits = xs.to(tl.int32, bitcast=True)
    tb = bits & 0x7FFFFFFF
    nan = tb > 0x7F800000
    neg = bits < 0
    if SIGNED:
        shift = SHIFT_S
        lowmask = LOWMASK_S
    else:
        shift = SHIFT_U
        lowmask = LOWMASK_U
    idx = tb >> shift  # the table spans every non-negative fp32: > 1 reads as the clamp to 1
    if GATHER:
        if SIGNED:
            e = _reg_table(btab_ptr, GLO_S, GSIZE_S, tl.minimum(tl.maximum(idx, GLO_S), GHI_S) - GLO_S)
        else:
            e = _reg_table(btab_ptr, GLO_U, GSIZE_U, tl.minimum(tl.maximum(idx, GLO_U), GHI_U) - GLO_U)
        e = e.to(tl.int32)
    else:
        e = _gather(btab_ptr, idx, (0x7FFFFFFF >> shift) + 1).to(tl.int32)
    if WIDE:
        # one compare of t's bits below the bucket with M's (+1 for s < 0: ties go to t ≥ M)
        c = (e >> 24) & 0xFF
        low = (tb & lowmask) + (bits >> 31 & 1)
        cnt = c + (low > (e & 0xFFFFFF)).to(tl.int32)
    else:
        c = (e >> 8) & 0xFF
        mhi = e & 0xFF
        th = (tb >> (shift - 8)) & 0xFF
        eq = th == mhi
        if SIGNED:
            mid = _gather_if(midp_ptr, c, eq, MIDP_S)
        else:
            mid = _gather_if(midp_ptr, c, eq, MIDP_U)
        t = tb.to(tl.float32, bitcast=True)
        exact = tl.where(neg, t >= mid, t > mid)
        above = tl.where(eq, exact, th > mhi)
        cnt = c + above.to(tl.int32)
    if SIGNED:
        code = tl.where(neg, 127 - tl.minimum(cnt, 127), 127 + cnt)
    else:
        code = tl.where(neg, 0, cnt)
    return tl.where(nan, 255, code)


@triton.jit
def _encode_word(xs, btab_ptr, SIGNED: tl.constexpr, MB: tl.constexpr):
    """``_encode`` by one gather indexed by the whole fp32 word (``bucket_table(word=True)``):
    the entry holds the final code up to one integer compare; sign and NaN are in the table."""
    if SIGNED:
        shift = SHIFT_S
        lowmask = LOWMASK_S
    else:
        shift = SHIFT_U
        lowmask = LOWMASK_U
    e = _gather(btab_ptr, (xs.to(tl.uint32, bitcast=True) >> shift).to(tl.int32), 1 << (32 - shift)).to(tl.int32)
    bits = xs.to(tl.int32, bitcast=True)
    if SIGNED:
        low = (bits ^ (bits >> 31)) & lowmask  # s < 0: the complement (mirrored compare)
    else:
        low = bits & lowmask  # s < 0 never adds (K = never in that half)
    return ((e >> 24) & 0xFF) + (low >= (e & 0xFFFFFF)).to(tl.int32)


@triton.jit
def _quantize_rows(x, mids_ptr, btab_ptr, midp_ptr, SIGNED: tl.constexpr, ENC: tl.constexpr,
                   TABLE: tl.constexpr = 0):
    """Codes and absmax of each row of ``x`` (rows are quantization blocks).

    ENC 0: the arithmetic encoder (``_encode``); 1: the bucket-table encoder with 16-bit
    entries (``_encode_bucket``); 2: with 32-bit entries (no second lookup); 3: a table over
    the whole fp32 word, sign included (``_encode_word``).  TABLE 1 (``pgs.func.kernels.TABLE``
    = "gather"): ENC 1 and 2 read their table from registers by ``tl.gather`` (ENC 0 and 3
    keep their global loads).
    """
    # max over |x| as integer bit patterns: exact, and a NaN (above +inf) propagates.
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    absmax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32),
                         tl.maximum(absmax, tl.full(absmax.shape, MIN_SCALE, tl.float32)))
    inv = tl.where(absmax != absmax, absmax, inv)  # NaN block → NaN codes (255), as the reference
    if ENC == 3:
        if SIGNED:
            codes = _encode_word(x * inv[:, None], btab_ptr, SIGNED, MB_S)
        else:
            codes = _encode_word(x * inv[:, None], btab_ptr, SIGNED, MB_U)
    elif ENC != 0:
        if SIGNED:
            codes = _encode_bucket(x * inv[:, None], btab_ptr, midp_ptr, SIGNED, MB_S, ENC == 2, TABLE == 1)
        else:
            codes = _encode_bucket(x * inv[:, None], btab_ptr, midp_ptr, SIGNED, MB_U, ENC == 2, TABLE == 1)
    else:
        codes = _encode(x * inv[:, None], mids_ptr, SIGNED)
    return codes.to(tl.uint8), absmax


#: Triton's CPU interpreter runs no inline PTX: kernels take a plain-Triton twin there.
INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
#: ``PGS_8BIT_CHECK=1``: bounds assertions on every table index and on the unmasked bodies'
#: offsets (the interpreter raises; on a GPU they need ``TRITON_DEBUG=1``).  Debug only.
CHECK = tl.constexpr(os.environ.get("PGS_8BIT_CHECK", "0") == "1")


@triton.jit
def _check(cond, msg: tl.constexpr):
    """``CHECK`` mode: fail unless ``cond`` holds everywhere.  The interpreter ignores
    ``device_assert`` (its options never set debug), but evaluates ``assume`` as an assert."""
    if INTERP:
        tl.assume(tl.min(cond.to(tl.int32)) == 1)
    else:
        tl.device_assert(cond, msg)


@triton.jit
def _fast_div(a, b):
    """a / b by one MUFU reciprocal and a multiply (≤ 2 ulp; a denormal b flushes to 0)."""
    if INTERP:
        return a / b
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [b], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return a * r


@triton.jit
def _gather(base, idx, SIZE: tl.constexpr):
    """``tl.load(ptrs)`` of a 16- or 32-bit table entry per element, as inline PTX on the device.

    A ``tl.load`` of a gather has no contiguity, and Triton 3.6's coalescing pass then gives
    it (and everything computed from it) a layout of one element per thread, converted to
    and from the streaming layout through shared memory (5 conversions per Lion kernel);
    an inline-asm load keeps the layout of its operand.  ``.nc``: the tables are read-only.
    """
    if CHECK:
        _check((idx >= 0) & (idx < SIZE), "pgs 8-bit: table index out of range")
    ptrs = base + idx
    if INTERP:
        return tl.load(ptrs)
    elif ptrs.dtype.element_ty.primitive_bitwidth == 16:
        return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptrs],
                                         dtype=ptrs.dtype.element_ty, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=ptrs.dtype.element_ty, is_pure=True, pack=1)


@triton.jit
def _gather_if(base, idx, pred, SIZE: tl.constexpr):
    """``tl.load(ptrs, mask=pred, other=0)`` of 32-bit entries (see ``_gather``); lanes with
    ``pred`` false issue no load."""
    if CHECK:
        _check(~pred | ((idx >= 0) & (idx < SIZE)), "pgs 8-bit: table index out of range")
    ptrs = base + idx
    if INTERP:
        return tl.load(ptrs, mask=pred, other=0)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
            "=r,l,r", [ptrs, pred.to(tl.int32)], dtype=ptrs.dtype.element_ty, is_pure=True, pack=1)


@triton.jit
def _reg_table(base, START: tl.constexpr, SIZE: tl.constexpr, idx):
    """``base[START + idx]`` for ``idx`` in [0, SIZE) of any shape, from a register copy of the
    table slice ``base[START : START + SIZE]`` (``TABLE`` gather mode).

    The program loads the slice once (each call site is reached once per program) and
    ``tl.gather`` picks the entries; ``tl.gather`` needs an index of the table's rank, so the
    index is flattened and the result reshaped back (element order kept: no data movement
    for the streaming layout).  On the GPU a gather whose axis spans several warps is lowered
    through shared memory: the table is stored there once and read with ``ld.shared`` (bank
    conflicts) instead of a global gather per element (an L1 wavefront per distinct 128-byte
    line a warp touches).
    """
    if CHECK:
        _check((idx >= 0) & (idx < SIZE), "pgs 8-bit: register-table index out of range")
    tab = tl.load(base + START + tl.arange(0, SIZE))
    flat = tl.reshape(idx, [idx.numel])
    return tl.reshape(tl.gather(tab, flat, 0), idx.shape)


@triton.jit
def _hash32(x):
    """A 32-bit integer mixer (xorshift-multiply, constants from Wellons' hash prospector):
    a bijection on uint32 whose high bits depend on every input bit."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sr_noise(seed_ptr, offs, RNG: tl.constexpr):
    """16 uniform random bits per element, a function of (seed, offset) only.

    RNG 0: Philox4x32-10 per element (``tl.randint``; 3/4 of its output unused).
    RNG 1: the stream key is ``_hash32`` of the seed (once per program), the noise the high
    16 bits of ``x·C2`` in ``_hash32(offset ^ key)`` (~8 integer instructions per element).
    For a fixed seed the map offset → hash is a bijection (distinct inputs, distinct words);
    for a fixed offset it is a bijection of the key, so over seeds every 16-bit value is
    equally likely: the rounding stays unbiased.
    """
    seed = tl.load(seed_ptr)
    if RNG == 1:
        lo = seed.to(tl.uint32)
        hi = (seed >> 32).to(tl.uint32)
        key = _hash32(lo ^ _hash32(hi ^ 0x9E3779B9))
        x = offs.to(tl.uint32) ^ key
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x >> 16
    else:
        return tl.randint(seed, offs).to(tl.uint32) & 0xFFFF


@triton.jit
def _bf16_bits(x, add):
    """fp32 ``x`` rounded to a value bf16 holds, kept in fp32 (the cast to bf16 is then exact):
    bf16 keeps the top 16 bits of the word, so ``add`` goes below them and the rest is cut.
    ``add`` is uniform noise for stochastic rounding, ``_rne_add(x)`` for round to nearest
    even (Triton's CPU interpreter truncates in the cast itself).  ±inf and NaN stay."""
    bits = x.to(tl.uint32, bitcast=True)
    up = ((bits + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), up, x)


@triton.jit
def _rne_add(x):
    """What ``_bf16_bits`` adds to round to nearest, ties to even: 0x7FFF plus bit 16."""
    return 0x7FFF + ((x.to(tl.uint32, bitcast=True) >> 16) & 1)


@triton.jit
def _store_param(p_out_ptr, offs, mask, x, seed_ptr, SR: tl.constexpr, RNG: tl.constexpr, MASKED: tl.constexpr):
    if SR:
        x = _bf16_bits(x, _sr_noise(seed_ptr, offs, RNG))
    _st(p_out_ptr, offs, x.to(p_out_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _ld(ptr, offs, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=other)
    else:
        if CHECK:
            _check(mask, "pgs 8-bit: unmasked load past the end")
        return tl.load(ptr + offs)


@triton.jit
def _st(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        if CHECK:
            _check(mask, "pgs 8-bit: unmasked store past the end")
        tl.store(ptr + offs, x)


@triton.jit
def _tile(pid, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, offs, offs < n, rows < tl.cdiv(n, BLOCK)


@triton.jit
def _is_full(pid, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Whether program ``pid`` owns ROWS whole blocks (no masks needed): all but the last."""
    return (pid + 1) * (ROWS * BLOCK) <= n


@triton.jit
def _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask,
                 SIGNED: tl.constexpr, DEQ_TABLE: tl.constexpr, MASKED: tl.constexpr, TABLE: tl.constexpr = 0):
    # Masked lanes read the code of 0.0 (127 signed, 0 unsigned) and an absmax of 0, so both
    # bodies compute the same expression ``q * absmax`` with no select after it.  That alone
    # does not make them agree bit for bit on a GPU: LLVM still picks which product of an
    # ``a·b + c·d`` to contract per element position and per body (sm_90 PTX); only
    # ``FP_FUSION=False`` (``pgs.func.kernels``) does.
    if SIGNED:
        codes = _ld(codes_ptr, offs, mask, 127, MASKED).to(tl.int32)
    else:
        codes = _ld(codes_ptr, offs, mask, 0, MASKED).to(tl.int32)
    absmax = _ld(absmax_ptr, rows, rmask, 0.0, MASKED)
    if DEQ_TABLE:  # one gather per element from the 256-entry map
        if TABLE == 1 or TABLE == 2:  # a register copy of the map (``TABLE`` "gather" / "gather_dec")
            q = _reg_table(qmap_ptr, 0, 256, codes)
        else:
            q = _gather(qmap_ptr, codes, 256)
    else:
        q = _decode(codes, SIGNED)
    return q * absmax[:, None]


@triton.jit
def _early_param(p_ptr, offs, mask, MASKED: tl.constexpr, APPLY: tl.constexpr, EARLY_P: tl.constexpr):
    """The parameter, loaded with the program's first loads when ``APPLY and EARLY_P`` (every load
    in flight at once, see ``pgs.func.kernels.EARLY_P``); otherwise a placeholder that
    ``_write_step`` replaces."""
    if APPLY and EARLY_P:
        return _ld(p_ptr, offs, mask, 0.0, MASKED)
    else:
        return 0.0


@triton.jit
def _write_step(out_ptr, p_ptr, p, u, lr_ptr, offs, mask, seed_ptr, APPLY: tl.constexpr, SR: tl.constexpr,
                RNG: tl.constexpr, MASKED: tl.constexpr, EARLY_P: tl.constexpr):
    """The step kernels' output.  APPLY: out = p − η(u + λ·p), η and λ at ``lr_ptr[0]``,
    ``lr_ptr[1]``, stochastically rounded into a bf16 ``out`` with SR (``p`` from
    ``_early_param``, loaded here without EARLY_P).  Otherwise out = u, the direction."""
    if APPLY:
        lr = tl.load(lr_ptr)
        wd = tl.load(lr_ptr + 1)
        if not EARLY_P:
            p = _ld(p_ptr, offs, mask, 0.0, MASKED)
        p = p.to(tl.float32)
        _store_param(out_ptr, offs, mask, p - lr * (u + wd * p), seed_ptr, SR, RNG, MASKED)
    else:
        _st(out_ptr, offs, u.to(out_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _lion8bit_body(
    pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, mids_ptr, btab_ptr, midp_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr, ENC: tl.constexpr, RNG: tl.constexpr, MASKED: tl.constexpr,
    TABLE: tl.constexpr = 0, EARLY_P: tl.constexpr = False,
):
    rows, offs, mask, rmask = _tile(pid, n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    w2 = tl.load(hp_ptr + 1)
    g = _ld(g_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    p = _early_param(p_ptr, offs, mask, MASKED, APPLY, EARLY_P)
    m = _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, True, DEQ_TABLE, MASKED, TABLE)
    d = g - m
    c = m + w1 * d
    u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    m = m + w2 * d
    if MASKED:
        m = tl.where(mask, m, 0.0)
    codes, absmax = _quantize_rows(m, mids_ptr, btab_ptr, midp_ptr, True, ENC, TABLE)
    _st(codes_out_ptr, offs, codes, mask, MASKED)
    _st(absmax_out_ptr, rows, absmax, rmask, MASKED)
    _write_step(out_ptr, p_ptr, p, u, hp_ptr + 2, offs, mask, seed_ptr, APPLY, SR, RNG, MASKED, EARLY_P)


@triton.jit
def lion8bit_kernel(
    g_ptr, p_ptr, out_ptr,  # out: the direction (APPLY=False) or the new parameter (APPLY=True)
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, mids_ptr, btab_ptr, midp_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr = False, ENC: tl.constexpr = 0, RNG: tl.constexpr = 0,
    SPLIT: tl.constexpr = True, TABLE: tl.constexpr = 0, EARLY_P: tl.constexpr = False,
):
    """hp = [1−β1, 1−β2, η, λ]: c = m + (1−β1)(g − m); m ← m + (1−β2)(g − m); u = sign(c).

    SPLIT: full programs run an unmasked copy of the body, the last one the masked copy.
    TABLE: 0 = table gathers from global memory per element; 1 = the decode map and the
    encoder's bucket table (ENC 1/2) from a register copy by ``tl.gather``; 2 = the decode
    map only (``pgs.func.kernels.TABLE``).
    """
    pid = tl.program_id(0)
    if SPLIT:
        if _is_full(pid, n, BLOCK, ROWS):
            _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                           qmap_ptr, mids_ptr, btab_ptr, midp_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, False, TABLE, EARLY_P)
        else:
            _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                           qmap_ptr, mids_ptr, btab_ptr, midp_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, True, TABLE, EARLY_P)
    else:
        _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                       qmap_ptr, mids_ptr, btab_ptr, midp_ptr, hp_ptr, seed_ptr, n,
                       BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, True, TABLE, EARLY_P)


@triton.jit
def _adam8bit_body(
    pid, g_ptr, p_ptr, out_ptr,
    mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
    vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
    qmap_m_ptr, mids_m_ptr, btab_m_ptr, midp_m_ptr, qmap_v_ptr, mids_v_ptr, btab_v_ptr, midp_v_ptr,
    hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr, ENC: tl.constexpr, RNG: tl.constexpr, FAST_DIV: tl.constexpr,
    MASKED: tl.constexpr, ENC_V: tl.constexpr, TABLE: tl.constexpr = 0, EARLY_P: tl.constexpr = False,
):
    rows, offs, mask, rmask = _tile(pid, n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    b2 = tl.load(hp_ptr + 1)
    w2 = tl.load(hp_ptr + 2)
    eps = tl.load(hp_ptr + 3)
    eps_root = tl.load(hp_ptr + 4)
    bc1 = tl.load(hp_ptr + 5)
    bc2 = tl.load(hp_ptr + 6)
    g = _ld(g_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    p = _early_param(p_ptr, offs, mask, MASKED, APPLY, EARLY_P)
    m = _load_moment(mcodes_ptr, mabsmax_ptr, qmap_m_ptr, rows, offs, mask, rmask, True, DEQ_TABLE, MASKED, TABLE)
    v = _load_moment(vcodes_ptr, vabsmax_ptr, qmap_v_ptr, rows, offs, mask, rmask, False, DEQ_TABLE, MASKED, TABLE)
    m = m + w1 * (g - m)
    v = v * b2 + w2 * (g * g)
    if MASKED:
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
    if FAST_DIV:
        # per-step reciprocals once per program; an approximate sqrt and one approximate
        # division per element (a few ulp from the div_rn/sqrt_rn path, within the tests' bound)
        r1 = 1.0 / bc1
        r2 = 1.0 / bc2
        u = _fast_div(m * r1, tl.sqrt(v * r2 + eps_root) + eps)
    else:
        u = tl.math.div_rn(tl.math.div_rn(m, bc1), tl.sqrt_rn(tl.math.div_rn(v, bc2) + eps_root) + eps)
    codes, absmax = _quantize_rows(m, mids_m_ptr, btab_m_ptr, midp_m_ptr, True, ENC, TABLE)
    _st(mcodes_out_ptr, offs, codes, mask, MASKED)
    _st(mabsmax_out_ptr, rows, absmax, rmask, MASKED)
    codes, absmax = _quantize_rows(v, mids_v_ptr, btab_v_ptr, midp_v_ptr, False, ENC_V, TABLE)
    _st(vcodes_out_ptr, offs, codes, mask, MASKED)
    _st(vabsmax_out_ptr, rows, absmax, rmask, MASKED)
    _write_step(out_ptr, p_ptr, p, u, hp_ptr + 7, offs, mask, seed_ptr, APPLY, SR, RNG, MASKED, EARLY_P)


@triton.jit
def adam8bit_kernel(
    g_ptr, p_ptr, out_ptr,
    mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
    vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
    qmap_m_ptr, mids_m_ptr, btab_m_ptr, midp_m_ptr, qmap_v_ptr, mids_v_ptr, btab_v_ptr, midp_v_ptr,
    hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr = False, ENC: tl.constexpr = 0, RNG: tl.constexpr = 0,
    FAST_DIV: tl.constexpr = False, SPLIT: tl.constexpr = True, ENC_V: tl.constexpr = 0,
    TABLE: tl.constexpr = 0, EARLY_P: tl.constexpr = False,
):
    """hp = [1−β1, β2, 1−β2, ε, ε_root, 1−β1^t, 1−β2^t, η, λ]; u = (m/bc1)/(sqrt(v/bc2 + ε_root) + ε).

    ENC encodes m (signed map), ENC_V encodes v (unsigned map); TABLE as in ``lion8bit_kernel``."""
    pid = tl.program_id(0)
    if SPLIT:
        if _is_full(pid, n, BLOCK, ROWS):
            _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                           vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                           qmap_m_ptr, mids_m_ptr, btab_m_ptr, midp_m_ptr, qmap_v_ptr, mids_v_ptr, btab_v_ptr,
                           midp_v_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, FAST_DIV, False, ENC_V, TABLE, EARLY_P)
        else:
            _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                           vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                           qmap_m_ptr, mids_m_ptr, btab_m_ptr, midp_m_ptr, qmap_v_ptr, mids_v_ptr, btab_v_ptr,
                           midp_v_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, FAST_DIV, True, ENC_V, TABLE, EARLY_P)
    else:
        _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                       vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                       qmap_m_ptr, mids_m_ptr, btab_m_ptr, midp_m_ptr, qmap_v_ptr, mids_v_ptr, btab_v_ptr,
                       midp_v_ptr, hp_ptr, seed_ptr, n,
                       BLOCK, ROWS, APPLY, SR, DEQ_TABLE, ENC, RNG, FAST_DIV, True, ENC_V, TABLE, EARLY_P)


@triton.jit
def quantize_kernel(x_ptr, codes_ptr, absmax_ptr, mids_ptr, btab_ptr, midp_ptr, n,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr, ENC: tl.constexpr = 0,
                    TABLE: tl.constexpr = 0):
    """Block-wise quantization alone (``pgs.func.quant8.quantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = _tile(tl.program_id(0), n, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, absmax = _quantize_rows(x, mids_ptr, btab_ptr, midp_ptr, SIGNED, ENC, TABLE)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rmask)


@triton.jit
def dequantize_kernel(codes_ptr, absmax_ptr, out_ptr, qmap_ptr, n,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr,
                      DEQ_TABLE: tl.constexpr = False, TABLE: tl.constexpr = 0):
    """Block-wise dequantization alone (``dequantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = _tile(tl.program_id(0), n, BLOCK, ROWS)
    x = _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, SIGNED, DEQ_TABLE, True, TABLE)
    tl.store(out_ptr + offs, x, mask=mask)
