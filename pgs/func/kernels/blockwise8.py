"""Triton kernels: dequantize → optimizer update → requantize, in one pass over memory.

One program owns ``ROWS`` whole quantization blocks (``BLOCK`` elements each), so the new
per-block absmax is a reduction inside the program and nothing is written twice.  Each
element's bytes move once: read the gradient, the codes (and, when applying, the
parameter), write the codes (and the parameter or the direction).

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

MIN_SCALE = tl.constexpr(_MIN_SCALE)


@triton.jit
def _search(pos, s, mids_ptr, STEP: tl.constexpr):
    # One step of the branch-free binary search: pos counts the midpoints strictly below s.
    cand = pos + STEP
    mid = tl.load(mids_ptr + cand - 1)
    return tl.where(mid < s, cand, pos)


@triton.jit
def _quantize_rows(x, mids_ptr):
    """Codes and absmax of each row of ``x`` (rows are quantization blocks)."""
    absmax = tl.max(tl.abs(x), axis=1)
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.maximum(absmax, MIN_SCALE))
    s = tl.minimum(tl.maximum(x * inv[:, None], -1.0), 1.0)
    pos = tl.zeros(x.shape, dtype=tl.int32)
    pos = _search(pos, s, mids_ptr, 128)
    pos = _search(pos, s, mids_ptr, 64)
    pos = _search(pos, s, mids_ptr, 32)
    pos = _search(pos, s, mids_ptr, 16)
    pos = _search(pos, s, mids_ptr, 8)
    pos = _search(pos, s, mids_ptr, 4)
    pos = _search(pos, s, mids_ptr, 2)
    pos = _search(pos, s, mids_ptr, 1)
    return pos.to(tl.uint8), absmax


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
def _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask):
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + rows, mask=rmask, other=0.0)
    return tl.where(mask, tl.load(qmap_ptr + codes) * absmax[:, None], 0.0)


@triton.jit
def lion8bit_kernel(
    g_ptr, p_ptr, out_ptr,  # out: the direction (APPLY=False) or the new parameter (APPLY=True)
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, mids_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr,
):
    """hp = [1−β1, 1−β2, η, λ]: c = m + (1−β1)(g − m); m ← m + (1−β2)(g − m); u = sign(c)."""
    rows, offs, mask, rmask = _tile(n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    w2 = tl.load(hp_ptr + 1)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask)
    c = m + w1 * (g - m)
    u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    m = tl.where(mask, m + w2 * (g - m), 0.0)
    codes, absmax = _quantize_rows(m, mids_ptr)
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
    m = _load_moment(mcodes_ptr, mabsmax_ptr, qmap_m_ptr, rows, offs, mask, rmask)
    v = _load_moment(vcodes_ptr, vabsmax_ptr, qmap_v_ptr, rows, offs, mask, rmask)
    m = tl.where(mask, m + w1 * (g - m), 0.0)
    v = tl.where(mask, v * b2 + w2 * (g * g), 0.0)
    u = tl.math.div_rn(tl.math.div_rn(m, bc1), tl.sqrt_rn(tl.math.div_rn(v, bc2) + eps_root) + eps)
    codes, absmax = _quantize_rows(m, mids_m_ptr)
    tl.store(mcodes_out_ptr + offs, codes, mask=mask)
    tl.store(mabsmax_out_ptr + rows, absmax, mask=rmask)
    codes, absmax = _quantize_rows(v, mids_v_ptr)
    tl.store(vcodes_out_ptr + offs, codes, mask=mask)
    tl.store(vabsmax_out_ptr + rows, absmax, mask=rmask)
    if APPLY:
        lr = tl.load(hp_ptr + 7)
        wd = tl.load(hp_ptr + 8)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _store_param(out_ptr, offs, mask, p - lr * (u + wd * p), seed_ptr, SR)
    else:
        tl.store(out_ptr + offs, u.to(out_ptr.dtype.element_ty), mask=mask)
