"""Triton kernels: dequantize → optimizer update → requantize, in one pass over memory.

One program owns ``ROWS`` whole quantization blocks (``BLOCK`` elements each), so the new
per-block absmax is a reduction inside the program and nothing is written twice.  Each
element's bytes move once: read the gradient, the codes (and, when applying, the
parameter), write the codes (and the parameter or the direction).

Quantization is gather-free arithmetic with bnb's exact rounding: the code of a normalised
value comes from its decade (fp32 exponent bits) and its linear bin coordinate inside the
decade; only values within 2^-11 bins of a midpoint (~0.1%) load that one fp32 midpoint
(a predicated load) to break the tie exactly.  Dequantization rebuilds the map entry from
the code by the map's own construction (two fmas, an add, a multiply), bit for bit;
``DEQ_TABLE=True`` instead gathers it from the 256-entry table (same values).

The maths mirrors the torch reference (``pgs.func.quant8``, ``pgs.func.lion8bit``,
``pgs.func.adam8bit``) operation for operation; on a GPU the compiler may contract a
multiply-add into an FMA, so results agree to the last bit only up to that (the tests
bound the difference).

Hyperparameters arrive as a small fp32 tensor on the device (``hp``), never as Python
numbers: a schedule's value or an injected tensor is read in the kernel with no host sync
and no recompilation.  The stochastic-rounding seed is read from a device tensor too.

Importing this module needs Triton; ``pgs.func.kernels`` imports it lazily.
"""

from __future__ import annotations

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
        mid = tl.load(mids_ptr + 127 + k, mask=near, other=0.0)
    else:
        mid = tl.load(mids_ptr + k, mask=near, other=0.0)
    # s < 0: the mirrored midpoint −mid is below s iff t < mid, so ties go to t ≥ mid.
    above = tl.where(near, tl.where(neg, t >= mid, t > mid), above)
    cnt = k + above.to(tl.int32)
    if SIGNED:
        code = tl.where(neg, 127 - tl.minimum(cnt, 127), 127 + cnt)
    else:
        code = tl.where(neg, 0, cnt)
    return tl.where(nan, 255, code)


@triton.jit
def _quantize_rows(x, mids_ptr, SIGNED: tl.constexpr):
    """Codes and absmax of each row of ``x`` (rows are quantization blocks)."""
    # max over |x| as integer bit patterns: exact, and a NaN (above +inf) propagates.
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    absmax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32),
                         tl.maximum(absmax, tl.full(absmax.shape, MIN_SCALE, tl.float32)))
    inv = tl.where(absmax != absmax, absmax, inv)  # NaN block → NaN codes (255), as the reference
    codes = _encode(x * inv[:, None], mids_ptr, SIGNED)
    return codes.to(tl.uint8), absmax


@triton.jit
def _store_param(p_out_ptr, offs, mask, x, seed_ptr, SR: tl.constexpr):
    if SR:
        # bf16 keeps the top 16 bits of an fp32 word: add uniform noise below them, truncate.
        seed = tl.load(seed_ptr)
        noise = tl.randint(seed, offs).to(tl.uint32) & 0xFFFF
        bits = x.to(tl.uint32, bitcast=True)
        up = ((bits + noise) & 0xFFFF0000).to(tl.float32, bitcast=True)
        finite = tl.abs(x) < float("inf")
        x = tl.where(finite, up, x)
    tl.store(p_out_ptr + offs, x.to(p_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, offs, offs < n, rows < tl.cdiv(n, BLOCK)


@triton.jit
def _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask,
                 SIGNED: tl.constexpr, DEQ_TABLE: tl.constexpr):
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    if DEQ_TABLE:  # one gather per element from the 256-entry map (kept for A/B benchmarks)
        q = tl.load(qmap_ptr + codes)
    else:
        q = _decode(codes, SIGNED)
    return tl.where(mask, q * absmax[:, None], 0.0)


@triton.jit
def lion8bit_kernel(
    g_ptr, p_ptr, out_ptr,  # out: the direction (APPLY=False) or the new parameter (APPLY=True)
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, mids_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr = False,
):
    """hp = [1−β1, 1−β2, η, λ]: c = m + (1−β1)(g − m); m ← m + (1−β2)(g − m); u = sign(c)."""
    rows, offs, mask, rmask = _tile(n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    w2 = tl.load(hp_ptr + 1)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, True, DEQ_TABLE)
    c = m + w1 * (g - m)
    u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    m = tl.where(mask, m + w2 * (g - m), 0.0)
    codes, absmax = _quantize_rows(m, mids_ptr, True)
    tl.store(codes_out_ptr + offs, codes, mask=mask)
    tl.store(absmax_out_ptr + rows, absmax, mask=rmask)
    if APPLY:
        lr = tl.load(hp_ptr + 2)
        wd = tl.load(hp_ptr + 3)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _store_param(out_ptr, offs, mask, p - lr * (u + wd * p), seed_ptr, SR)
    else:
        tl.store(out_ptr + offs, u.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def adam8bit_kernel(
    g_ptr, p_ptr, out_ptr,
    mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
    vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
    qmap_m_ptr, mids_m_ptr, qmap_v_ptr, mids_v_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
    DEQ_TABLE: tl.constexpr = False,
):
    """hp = [1−β1, β2, 1−β2, ε, ε_root, 1−β1^t, 1−β2^t, η, λ]; u = (m/bc1)/(sqrt(v/bc2 + ε_root) + ε)."""
    rows, offs, mask, rmask = _tile(n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    b2 = tl.load(hp_ptr + 1)
    w2 = tl.load(hp_ptr + 2)
    eps = tl.load(hp_ptr + 3)
    eps_root = tl.load(hp_ptr + 4)
    bc1 = tl.load(hp_ptr + 5)
    bc2 = tl.load(hp_ptr + 6)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(mcodes_ptr, mabsmax_ptr, qmap_m_ptr, rows, offs, mask, rmask, True, DEQ_TABLE)
    v = _load_moment(vcodes_ptr, vabsmax_ptr, qmap_v_ptr, rows, offs, mask, rmask, False, DEQ_TABLE)
    m = tl.where(mask, m + w1 * (g - m), 0.0)
    v = tl.where(mask, v * b2 + w2 * (g * g), 0.0)
    u = tl.math.div_rn(tl.math.div_rn(m, bc1), tl.sqrt_rn(tl.math.div_rn(v, bc2) + eps_root) + eps)
    codes, absmax = _quantize_rows(m, mids_m_ptr, True)
    tl.store(mcodes_out_ptr + offs, codes, mask=mask)
    tl.store(mabsmax_out_ptr + rows, absmax, mask=rmask)
    codes, absmax = _quantize_rows(v, mids_v_ptr, False)
    tl.store(vcodes_out_ptr + offs, codes, mask=mask)
    tl.store(vabsmax_out_ptr + rows, absmax, mask=rmask)
    if APPLY:
        lr = tl.load(hp_ptr + 7)
        wd = tl.load(hp_ptr + 8)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _store_param(out_ptr, offs, mask, p - lr * (u + wd * p), seed_ptr, SR)
    else:
        tl.store(out_ptr + offs, u.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_kernel(x_ptr, codes_ptr, absmax_ptr, mids_ptr, n,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr):
    """Block-wise quantization alone (``pgs.func.quant8.quantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = _tile(n, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, absmax = _quantize_rows(x, mids_ptr, SIGNED)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rmask)


@triton.jit
def dequantize_kernel(codes_ptr, absmax_ptr, out_ptr, qmap_ptr, n,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr,
                      DEQ_TABLE: tl.constexpr = False):
    """Block-wise dequantization alone (``dequantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = _tile(n, BLOCK, ROWS)
    x = _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, SIGNED, DEQ_TABLE)
    tl.store(out_ptr + offs, x, mask=mask)
