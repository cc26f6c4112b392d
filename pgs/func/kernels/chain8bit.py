"""Triton passes for the whole chain ``adagc → mona → scale_by_lion8bit → hyperball``.

The host side (matching the chain, the per-tensor scalars, the state) is
``pgs.func.fused_chain8bit``; this module holds the three kernels and their launchers.  Every
program owns ``ROWS`` whole blocks of ``BLOCK`` elements (the quantization blocks, which are
also the flat layout's blocks: each belongs to exactly one tensor, ``block_seg``), so every
per-tensor quantity is a per-block partial here and a segment sum on the host.

- ``sumsq_kernel`` (pass A): per-block Σg² (AdaGC's per-tensor norms).  Reads g: 2 B/param.
- ``chain_b_kernel`` (pass B): ĝ = h[seg]·g (AdaGC, rounded to g's dtype) → MONA
  (Δ = ĝ − prev, A ← βA + (1−β)Δ, G̃ = ĝ + αA; prev ← ĝ) → Lion (c = m + (1−β1)(G̃ − m),
  u = sign(c), m ← m + (1−β2)(G̃ − m), m dequantized / requantized in registers, same
  helpers and codes as ``blockwise8.lion8bit_kernel``).  Constrained (hyperball) tensors:
  u stored in 2 bits per element (``PACK``; int8 for a block size not a multiple of 4),
  plus per-block Σu², Σθu, Σθ².  Other tensors: θ ← θ + rnd(−η u)
  written here (no pass C).
- ``chain_c_kernel`` (pass C): θ̃ = θ − coef[seg]·u, θ ← θ + rnd(shrink[seg]·θ̃ − θ).

``rnd`` is the rounding to the gradient's dtype that the generic path's intermediate
``updates`` make; every cast of the generic path is reproduced so that the fused step
equals it up to floating-point contraction and the order of the norms' sums.

Papers (docs/techniques/): AdaGC arXiv 2502.11034; MONA's difference EMA (Adan arXiv 2208.06677 for
the defaults); Lion arXiv 2302.06675; block-wise 8-bit state arXiv 2110.02861;
Hyperball arXiv 2606.16899.  Equations in ``pgs.func.fused_chain8bit``.

Importing this module needs Triton (``pgs.func.fused_chain8bit`` imports it lazily).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pgs.func.kernels.blockwise8 import (INTERP, bf16_bits, is_full, ld, load_moment, quantize_rows, rne_add,
                                        st, store_param, tile)


@triton.jit
def _rnd(x, DT: tl.constexpr):
    """``x`` (fp32) rounded to dtype ``DT`` (0 fp32, 1 bf16) and back, round-to-nearest-even.

    On the GPU a ``cvt.rn.bf16.f32``; Triton's CPU interpreter truncates in ``.to(bfloat16)``,
    so there the rounding is done on the bits (carry into bit 16 when the low half exceeds
    0x8000, or equals it and bit 16 is odd; ±inf stay, NaN keeps its quiet bit)."""
    if DT == 1:
        if INTERP:
            return bf16_bits(x, rne_add(x))
        else:
            return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x


@triton.jit
def _final(x, PDT: tl.constexpr, SR: tl.constexpr):
    """The new parameter before ``store_param``: rounded to nearest here (so that the
    interpreter's truncating cast is exact), left in fp32 for stochastic rounding."""
    if SR:
        return x
    else:
        return _rnd(x, PDT)


@triton.jit
def _store_dir(u_ptr, rows, offs, u, mask, rmask, BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr,
               MASKED: tl.constexpr):
    """The direction u ∈ {−1, 0, 1} of whole blocks: one int8 per element, or (PACK) 2 bits
    per element, u + 1 at bit 2j of byte i for element 4i + j of the block."""
    if PACK:
        q = tl.reshape((u + 1.0).to(tl.int32), (ROWS, BLOCK // 4, 4))
        sh = tl.arange(0, 4) * 2
        packed = tl.sum(q << sh[None, None, :], axis=2).to(tl.uint8)
        poffs = rows[:, None] * (BLOCK // 4) + tl.arange(0, BLOCK // 4)[None, :]
        pmask = rmask[:, None] & (tl.arange(0, BLOCK // 4) < BLOCK // 4)[None, :]
        st(u_ptr, poffs, packed, pmask, MASKED)
    else:
        st(u_ptr, offs, u.to(tl.int8), mask, MASKED)


@triton.jit
def _load_dir(u_ptr, rows, offs, mask, rmask, BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr,
              MASKED: tl.constexpr):
    if PACK:
        poffs = rows[:, None] * (BLOCK // 4) + tl.arange(0, BLOCK // 4)[None, :]
        pmask = rmask[:, None] & (tl.arange(0, BLOCK // 4) < BLOCK // 4)[None, :]
        packed = ld(u_ptr, poffs, pmask, 0x55, MASKED).to(tl.int32)
        sh = tl.arange(0, 4) * 2
        q = (packed[:, :, None] >> sh[None, None, :]) & 3
        return tl.reshape(q, (ROWS, BLOCK)).to(tl.float32) - 1.0
    else:
        return ld(u_ptr, offs, mask, 0, MASKED).to(tl.float32)


@triton.jit
def sumsq_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """out[b] = Σ x² over block b (fp32)."""
    rows, offs, mask, rmask = tile(tl.program_id(0), n, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(x * x, axis=1), mask=rmask)


@triton.jit
def _chain_b_body(
    pid, g_ptr, p_ptr, out_ptr, seg_ptr, clip_ptr,
    prev_ptr, acc_ptr, prev_out_ptr, acc_out_ptr,
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr, m_ptr, m_out_ptr,
    u_ptr, uu_ptr, pu_ptr, pp_ptr,
    qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, GDT: tl.constexpr, PDT: tl.constexpr, ADT: tl.constexpr,
    Q8: tl.constexpr, PROJ: tl.constexpr,
    SR: tl.constexpr, MASKED: tl.constexpr, PACK: tl.constexpr,
):
    rows, offs, mask, rmask = tile(pid, n, BLOCK, ROWS)
    first = tl.load(hp_ptr + 0)  # 1.0 at MONA's first step (Δ = 0)
    alpha = tl.load(hp_ptr + 1)
    bm = tl.load(hp_ptr + 2)
    ombm = tl.load(hp_ptr + 3)
    w1 = tl.load(hp_ptr + 4)
    w2 = tl.load(hp_ptr + 5)
    # AdaGC: ĝ = h[seg]·g in fp32, rounded to g's dtype (the generic path's ``updates``)
    seg = ld(seg_ptr, rows, rmask, 0, MASKED)
    h = tl.load(clip_ptr + seg)
    g = ld(g_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    g = _rnd(g * h[:, None], GDT)
    # every load before the first store: the compiler keeps loads below stores that may alias
    # them (donated buffers do), so loads after a store wait one more DRAM round trip
    prev = ld(prev_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    acc = ld(acc_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    if Q8:
        m = load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, True, MASKED)
    else:
        m = ld(m_ptr, offs, mask, 0.0, MASKED)
    p = ld(p_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    # MONA
    delta = tl.where(first != 0.0, 0.0, g - prev)
    acc = acc * bm + ombm * delta
    st(prev_out_ptr, offs, _rnd(g, ADT).to(prev_out_ptr.dtype.element_ty), mask, MASKED)
    st(acc_out_ptr, offs, _rnd(acc, ADT).to(acc_out_ptr.dtype.element_ty), mask, MASKED)
    x = _rnd(g + alpha * acc, GDT)
    # Lion on the 8-bit (or, for small tensors, fp32) momentum
    d = x - m
    c = m + w1 * d
    u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    m = m + w2 * d
    if Q8:
        if MASKED:
            m = tl.where(mask, m, 0.0)
        codes, absmax = quantize_rows(m, btab_ptr, True)
        st(codes_out_ptr, offs, codes, mask, MASKED)
        st(absmax_out_ptr, rows, absmax, rmask, MASKED)
    else:
        st(m_out_ptr, offs, m, mask, MASKED)
    if PROJ:  # hyperball: the direction (int8 or 2 bits) and the per-block partials of its norms
        _store_dir(u_ptr, rows, offs, u, mask, rmask, BLOCK, ROWS, PACK, MASKED)
        st(uu_ptr, rows, tl.sum(u * u, axis=1), rmask, MASKED)
        st(pu_ptr, rows, tl.sum(p * u, axis=1), rmask, MASKED)
        st(pp_ptr, rows, tl.sum(p * p, axis=1), rmask, MASKED)
    else:  # not on a sphere: θ + rnd(−η u)
        neg_lr = tl.load(hp_ptr + 6)
        store_param(out_ptr, offs, mask, _final(p + _rnd(u * neg_lr, GDT), PDT, SR), seed_ptr, SR, MASKED)


@triton.jit
def chain_b_kernel(
    g_ptr, p_ptr, out_ptr, seg_ptr, clip_ptr,
    prev_ptr, acc_ptr, prev_out_ptr, acc_out_ptr,
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr, m_ptr, m_out_ptr,
    u_ptr, uu_ptr, pu_ptr, pp_ptr,
    qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, GDT: tl.constexpr, PDT: tl.constexpr, ADT: tl.constexpr,
    Q8: tl.constexpr, PROJ: tl.constexpr,
    SR: tl.constexpr, SPLIT: tl.constexpr = True, PACK: tl.constexpr = True,
):
    """hp = [first, α, β_mona, 1−β_mona, 1−β1, 1−β2, −η]; see the module docstring.

    Q8: the momentum is ``Quantized8bit`` (codes, absmax), else an fp32 buffer (``m_ptr``).
    PROJ: the group is constrained by hyperball (write u and partials; θ in pass C).
    SPLIT: full programs run an unmasked copy of the body (as ``lion8bit_kernel``).
    """
    pid = tl.program_id(0)
    if SPLIT:
        if is_full(pid, n, BLOCK, ROWS):
            _chain_b_body(pid, g_ptr, p_ptr, out_ptr, seg_ptr, clip_ptr, prev_ptr, acc_ptr, prev_out_ptr,
                          acc_out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr, m_ptr, m_out_ptr,
                          u_ptr, uu_ptr, pu_ptr, pp_ptr, qmap_ptr, btab_ptr, hp_ptr, seed_ptr,
                          n, BLOCK, ROWS, GDT, PDT, ADT, Q8, PROJ, SR, False, PACK)
        else:
            _chain_b_body(pid, g_ptr, p_ptr, out_ptr, seg_ptr, clip_ptr, prev_ptr, acc_ptr, prev_out_ptr,
                          acc_out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr, m_ptr, m_out_ptr,
                          u_ptr, uu_ptr, pu_ptr, pp_ptr, qmap_ptr, btab_ptr, hp_ptr, seed_ptr,
                          n, BLOCK, ROWS, GDT, PDT, ADT, Q8, PROJ, SR, True, PACK)
    else:
        _chain_b_body(pid, g_ptr, p_ptr, out_ptr, seg_ptr, clip_ptr, prev_ptr, acc_ptr, prev_out_ptr,
                      acc_out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr, m_ptr, m_out_ptr,
                      u_ptr, uu_ptr, pu_ptr, pp_ptr, qmap_ptr, btab_ptr, hp_ptr, seed_ptr,
                      n, BLOCK, ROWS, GDT, PDT, ADT, Q8, PROJ, SR, True, PACK)


@triton.jit
def _chain_c_body(pid, p_ptr, u_ptr, out_ptr, seg_ptr, coef_ptr, shrink_ptr, seed_ptr, n,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, GDT: tl.constexpr, PDT: tl.constexpr, SR: tl.constexpr,
                  MASKED: tl.constexpr, PACK: tl.constexpr):
    rows, offs, mask, rmask = tile(pid, n, BLOCK, ROWS)
    seg = ld(seg_ptr, rows, rmask, 0, MASKED)
    coef = tl.load(coef_ptr + seg)
    shrink = tl.load(shrink_ptr + seg)
    u = _load_dir(u_ptr, rows, offs, mask, rmask, BLOCK, ROWS, PACK, MASKED)
    p = ld(p_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    tilde = p - u * coef[:, None]
    store_param(out_ptr, offs, mask, _final(p + _rnd(tilde * shrink[:, None] - p, GDT), PDT, SR), seed_ptr, SR,
                 MASKED)


@triton.jit
def chain_c_kernel(p_ptr, u_ptr, out_ptr, seg_ptr, coef_ptr, shrink_ptr, seed_ptr, n,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, GDT: tl.constexpr, PDT: tl.constexpr, SR: tl.constexpr,
                   SPLIT: tl.constexpr = True, PACK: tl.constexpr = True):
    """θ̃ = θ − coef[seg]·u ;  θ ← θ + rnd(shrink[seg]·θ̃ − θ)  (hyperball's projection, applied)."""
    pid = tl.program_id(0)
    if SPLIT:
        if is_full(pid, n, BLOCK, ROWS):
            _chain_c_body(pid, p_ptr, u_ptr, out_ptr, seg_ptr, coef_ptr, shrink_ptr, seed_ptr, n,
                          BLOCK, ROWS, GDT, PDT, SR, False, PACK)
        else:
            _chain_c_body(pid, p_ptr, u_ptr, out_ptr, seg_ptr, coef_ptr, shrink_ptr, seed_ptr, n,
                          BLOCK, ROWS, GDT, PDT, SR, True, PACK)
    else:
        _chain_c_body(pid, p_ptr, u_ptr, out_ptr, seg_ptr, coef_ptr, shrink_ptr, seed_ptr, n,
                      BLOCK, ROWS, GDT, PDT, SR, True, PACK)
