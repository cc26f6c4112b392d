"""Triton kernels: dequantize → optimizer update → requantize, in one pass over memory.

One program owns ``ROWS`` whole quantization blocks (``BLOCK`` elements each), so the new
per-block absmax is a reduction inside the program and nothing is written twice.  Each
element's bytes move once: read the gradient, the codes (and, when applying, the
parameter), write the codes (and the parameter or the direction).

Quantization is one 32-bit table gather per element from ``quant8.bucket_table`` plus one
integer compare (``_encode_bucket``): the reference's codes bit for bit.  Dequantization
gathers the map entry.  Table gathers are inline-PTX loads (``_gather``) so that Triton
keeps the streaming layout (a ``tl.load`` of a gather gets a one-element-per-thread layout
and conversions through shared memory).

The maths mirrors the torch reference (``pgs.func.quant8``, ``pgs.func.lion8bit_direction``,
``pgs.func.adam8bit``) operation for operation; on a GPU the compiler may contract a
multiply-add into an FMA, so results agree to the last bit only up to that (the tests
bound the difference; ``KernelConfig.fp_fusion=False`` turns contraction off).

Hyperparameters arrive as a small fp32 tensor on the device (``hp``), never as Python
numbers: a schedule's value or an injected tensor is read in the kernel with no host sync
and no recompilation.  The stochastic-rounding seed is read from a device tensor too.

Papers: block-wise 8-bit optimizer state, Dettmers et al. arXiv 2110.02861; Lion, Chen et
al. arXiv 2302.06675; Adam, Kingma & Ba arXiv 1412.6980.

Importing this module needs Triton; ``pgs.func.kernels`` imports it lazily.
"""

from __future__ import annotations


import triton
import triton.language as tl

from pgs.func.kernels.kernel_config import interpret_requested
from pgs.func.quant8 import BUCKET_MANTISSA_BITS as _MB
from pgs.func.quant8 import MIN_SCALE as _MIN_SCALE

MIN_SCALE = tl.constexpr(_MIN_SCALE)
#: Bucket-table encoder (``_encode_bucket``): 23 − mantissa bits per bucket, per map (see
#: ``pgs.func.quant8.bucket_table``).
SHIFT_S = tl.constexpr(23 - _MB[True])
SHIFT_U = tl.constexpr(23 - _MB[False])
LOWMASK_S = tl.constexpr((1 << (23 - _MB[True])) - 1)
LOWMASK_U = tl.constexpr((1 << (23 - _MB[False])) - 1)


@triton.jit
def _encode_bucket(xs, btab_ptr, SIGNED: tl.constexpr):
    """Codes of ``xs = x·(1/absmax)`` (unclamped; NaN → 255): ``#{midpoints < clamp(xs, −1, 1)}``,
    by one 32-bit table gather and one integer compare per element.

    T = bits of |xs|; its bucket is T's exponent and top ``MB`` mantissa bits (the table
    spans every non-negative fp32, values above 1 reading as 1: the reference's clamp).
    ``bucket_table`` holds per bucket c = #{positive midpoints < bucket start} (top byte) and
    the low bits of the one midpoint M inside the bucket, if any (2^S if none): t and M share
    every bit above, so t is above M iff its low bits are larger (ties go to t ≥ M for s < 0,
    the mirrored midpoint).  The same codes as the reference's ``bucketize`` bit for bit.
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
    e = _gather(btab_ptr, idx, (0x7FFFFFFF >> shift) + 1).to(tl.int32)
    c = (e >> 24) & 0xFF
    low = (tb & lowmask) + (bits >> 31 & 1)
    cnt = c + (low > (e & 0xFFFFFF)).to(tl.int32)
    if SIGNED:
        code = tl.where(neg, 127 - tl.minimum(cnt, 127), 127 + cnt)
    else:
        code = tl.where(neg, 0, cnt)
    return tl.where(nan, 255, code)


@triton.jit
def quantize_rows(x, btab_ptr, SIGNED: tl.constexpr):
    """Codes and absmax of each row of ``x`` (rows are quantization blocks)."""
    # max over |x| as integer bit patterns: exact, and a NaN (above +inf) propagates.
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    absmax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32),
                         tl.maximum(absmax, tl.full(absmax.shape, MIN_SCALE, tl.float32)))
    inv = tl.where(absmax != absmax, absmax, inv)  # NaN block → NaN codes (255), as the reference
    codes = _encode_bucket(x * inv[:, None], btab_ptr, SIGNED)
    return codes.to(tl.uint8), absmax


#: Triton's CPU interpreter runs no inline PTX: kernels take a plain-Triton twin there.
INTERP = tl.constexpr(interpret_requested())
#: Bounds assertions on every table index and on the unmasked bodies' offsets (the
#: interpreter raises; on a GPU they need ``TRITON_DEBUG=1``).  Off; the tests switch it on
#: by replacing this constant.
CHECK = tl.constexpr(False)


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
def _hash32(x):
    """A 32-bit integer mixer (xorshift-multiply, constants from Wellons' hash prospector):
    a bijection on uint32 whose high bits depend on every input bit."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def sr_noise(seed_ptr, offs):
    """16 uniform random bits per element, a function of (seed, offset) only.

    The stream key is ``_hash32`` of the seed (once per program), the noise the high 16 bits
    of ``_hash32(offset ^ key)`` (~8 integer instructions per element, against Philox's ~40).
    For a fixed seed the map offset → hash is a bijection (distinct inputs, distinct words);
    for a fixed offset it is a bijection of the key, so over seeds every 16-bit value is
    equally likely: the rounding stays unbiased.
    """
    seed = tl.load(seed_ptr)
    lo = seed.to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    key = _hash32(lo ^ _hash32(hi ^ 0x9E3779B9))
    x = offs.to(tl.uint32) ^ key
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x >> 16


@triton.jit
def bf16_bits(x, add):
    """fp32 ``x`` rounded to a value bf16 holds, kept in fp32 (the cast to bf16 is then exact):
    bf16 keeps the top 16 bits of the word, so ``add`` goes below them and the rest is cut.
    ``add`` is uniform noise for stochastic rounding, ``rne_add(x)`` for round to nearest
    even (Triton's CPU interpreter truncates in the cast itself).  ±inf and NaN stay."""
    bits = x.to(tl.uint32, bitcast=True)
    up = ((bits + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), up, x)


@triton.jit
def rne_add(x):
    """What ``bf16_bits`` adds to round to nearest, ties to even: 0x7FFF plus bit 16."""
    return 0x7FFF + ((x.to(tl.uint32, bitcast=True) >> 16) & 1)


@triton.jit
def store_param(p_out_ptr, offs, mask, x, seed_ptr, SR: tl.constexpr, MASKED: tl.constexpr):
    if SR:
        x = bf16_bits(x, sr_noise(seed_ptr, offs))
    st(p_out_ptr, offs, x.to(p_out_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def ld(ptr, offs, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=other)
    else:
        if CHECK:
            _check(mask, "pgs 8-bit: unmasked load past the end")
        return tl.load(ptr + offs)


@triton.jit
def st(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        if CHECK:
            _check(mask, "pgs 8-bit: unmasked store past the end")
        tl.store(ptr + offs, x)


@triton.jit
def tile(pid, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, offs, offs < n, rows < tl.cdiv(n, BLOCK)


@triton.jit
def is_full(pid, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Whether program ``pid`` owns ROWS whole blocks (no masks needed): all but the last."""
    return (pid + 1) * (ROWS * BLOCK) <= n


@triton.jit
def load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, SIGNED: tl.constexpr,
                 MASKED: tl.constexpr):
    """A block-quantized moment in fp32: one gather per element from the 256-entry map, times
    the block's absmax."""
    # Masked lanes read the code of 0.0 (127 signed, 0 unsigned) and an absmax of 0, so both
    # bodies compute the same expression ``q * absmax`` with no select after it.  That alone
    # does not make them agree bit for bit on a GPU: LLVM still picks which product of an
    # ``a·b + c·d`` to contract per element position and per body (sm_90 PTX); only
    # ``KernelConfig.fp_fusion=False`` does.
    if SIGNED:
        codes = ld(codes_ptr, offs, mask, 127, MASKED).to(tl.int32)
    else:
        codes = ld(codes_ptr, offs, mask, 0, MASKED).to(tl.int32)
    absmax = ld(absmax_ptr, rows, rmask, 0.0, MASKED)
    q = _gather(qmap_ptr, codes, 256)
    return q * absmax[:, None]


@triton.jit
def _write_step(out_ptr, p, u, lr_ptr, offs, mask, seed_ptr, APPLY: tl.constexpr, SR: tl.constexpr,
                MASKED: tl.constexpr):
    """The step kernels' output.  APPLY: out = p − η(u + λ·p), η and λ at ``lr_ptr[0]``,
    ``lr_ptr[1]``, stochastically rounded into a bf16 ``out`` with SR.  Otherwise out = u,
    the direction."""
    if APPLY:
        lr = tl.load(lr_ptr)
        wd = tl.load(lr_ptr + 1)
        p = p.to(tl.float32)
        store_param(out_ptr, offs, mask, p - lr * (u + wd * p), seed_ptr, SR, MASKED)
    else:
        st(out_ptr, offs, u.to(out_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _param(p_ptr, offs, mask, MASKED: tl.constexpr, APPLY: tl.constexpr):
    """The parameter (APPLY), loaded with the program's first loads: the kernels store the new
    codes before they write the parameter, and the compiler does not move a load above a store
    that may alias it (with ``donate`` the outputs are the inputs), so a load after the
    requantization would wait for memory a second time."""
    if APPLY:
        return ld(p_ptr, offs, mask, 0.0, MASKED)
    else:
        return 0.0


@triton.jit
def _lion8bit_body(
    pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr, MASKED: tl.constexpr,
):
    rows, offs, mask, rmask = tile(pid, n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    w2 = tl.load(hp_ptr + 1)
    g = ld(g_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    p = _param(p_ptr, offs, mask, MASKED, APPLY)
    m = load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, True, MASKED)
    d = g - m
    c = m + w1 * d
    u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    m = m + w2 * d
    if MASKED:
        m = tl.where(mask, m, 0.0)
    codes, absmax = quantize_rows(m, btab_ptr, True)
    st(codes_out_ptr, offs, codes, mask, MASKED)
    st(absmax_out_ptr, rows, absmax, rmask, MASKED)
    _write_step(out_ptr, p, u, hp_ptr + 2, offs, mask, seed_ptr, APPLY, SR, MASKED)


@triton.jit
def lion8bit_kernel(
    g_ptr, p_ptr, out_ptr,  # out: the direction (APPLY=False) or the new parameter (APPLY=True)
    codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
    qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr, SPLIT: tl.constexpr = True,
):
    """hp = [1−β1, 1−β2, η, λ]: c = m + (1−β1)(g − m); m ← m + (1−β2)(g − m); u = sign(c).

    SPLIT: full programs run an unmasked copy of the body, the last one the masked copy
    (False: the masked copy everywhere, which the tests compare against)."""
    pid = tl.program_id(0)
    if SPLIT:
        if is_full(pid, n, BLOCK, ROWS):
            _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                           qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n, BLOCK, ROWS, APPLY, SR, False)
        else:
            _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                           qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n, BLOCK, ROWS, APPLY, SR, True)
    else:
        _lion8bit_body(pid, g_ptr, p_ptr, out_ptr, codes_ptr, absmax_ptr, codes_out_ptr, absmax_out_ptr,
                       qmap_ptr, btab_ptr, hp_ptr, seed_ptr, n, BLOCK, ROWS, APPLY, SR, True)


@triton.jit
def _adam8bit_body(
    pid, g_ptr, p_ptr, out_ptr,
    mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
    vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
    qmap_m_ptr, btab_m_ptr, qmap_v_ptr, btab_v_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr, MASKED: tl.constexpr,
):
    rows, offs, mask, rmask = tile(pid, n, BLOCK, ROWS)
    w1 = tl.load(hp_ptr + 0)
    b2 = tl.load(hp_ptr + 1)
    w2 = tl.load(hp_ptr + 2)
    eps = tl.load(hp_ptr + 3)
    eps_root = tl.load(hp_ptr + 4)
    bc1 = tl.load(hp_ptr + 5)
    bc2 = tl.load(hp_ptr + 6)
    g = ld(g_ptr, offs, mask, 0.0, MASKED).to(tl.float32)
    p = _param(p_ptr, offs, mask, MASKED, APPLY)
    m = load_moment(mcodes_ptr, mabsmax_ptr, qmap_m_ptr, rows, offs, mask, rmask, True, MASKED)
    v = load_moment(vcodes_ptr, vabsmax_ptr, qmap_v_ptr, rows, offs, mask, rmask, False, MASKED)
    m = m + w1 * (g - m)
    v = v * b2 + w2 * (g * g)
    if MASKED:
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
    # per-step reciprocals once per program; an approximate sqrt and one approximate division
    # per element (a few ulp from the div_rn/sqrt_rn of the reference, within the tests' bound)
    r1 = 1.0 / bc1
    r2 = 1.0 / bc2
    u = _fast_div(m * r1, tl.sqrt(v * r2 + eps_root) + eps)
    codes, absmax = quantize_rows(m, btab_m_ptr, True)
    st(mcodes_out_ptr, offs, codes, mask, MASKED)
    st(mabsmax_out_ptr, rows, absmax, rmask, MASKED)
    codes, absmax = quantize_rows(v, btab_v_ptr, False)
    st(vcodes_out_ptr, offs, codes, mask, MASKED)
    st(vabsmax_out_ptr, rows, absmax, rmask, MASKED)
    _write_step(out_ptr, p, u, hp_ptr + 7, offs, mask, seed_ptr, APPLY, SR, MASKED)


@triton.jit
def adam8bit_kernel(
    g_ptr, p_ptr, out_ptr,
    mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
    vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
    qmap_m_ptr, btab_m_ptr, qmap_v_ptr, btab_v_ptr, hp_ptr, seed_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, APPLY: tl.constexpr, SR: tl.constexpr, SPLIT: tl.constexpr = True,
):
    """hp = [1−β1, β2, 1−β2, ε, ε_root, 1−β1^t, 1−β2^t, η, λ]; u = (m/bc1)/(sqrt(v/bc2 + ε_root) + ε).

    m uses the signed map, v the unsigned one; SPLIT as in ``lion8bit_kernel``."""
    pid = tl.program_id(0)
    if SPLIT:
        if is_full(pid, n, BLOCK, ROWS):
            _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                           vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                           qmap_m_ptr, btab_m_ptr, qmap_v_ptr, btab_v_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, False)
        else:
            _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                           vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                           qmap_m_ptr, btab_m_ptr, qmap_v_ptr, btab_v_ptr, hp_ptr, seed_ptr, n,
                           BLOCK, ROWS, APPLY, SR, True)
    else:
        _adam8bit_body(pid, g_ptr, p_ptr, out_ptr, mcodes_ptr, mabsmax_ptr, mcodes_out_ptr, mabsmax_out_ptr,
                       vcodes_ptr, vabsmax_ptr, vcodes_out_ptr, vabsmax_out_ptr,
                       qmap_m_ptr, btab_m_ptr, qmap_v_ptr, btab_v_ptr, hp_ptr, seed_ptr, n,
                       BLOCK, ROWS, APPLY, SR, True)


@triton.jit
def quantize_kernel(x_ptr, codes_ptr, absmax_ptr, btab_ptr, n,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr):
    """Block-wise quantization alone (``pgs.func.quant8.quantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = tile(tl.program_id(0), n, BLOCK, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, absmax = quantize_rows(x, btab_ptr, SIGNED)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(absmax_ptr + rows, absmax, mask=rmask)


@triton.jit
def dequantize_kernel(codes_ptr, absmax_ptr, out_ptr, qmap_ptr, n,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr):
    """Block-wise dequantization alone (``dequantize_blockwise`` on the device)."""
    rows, offs, mask, rmask = tile(tl.program_id(0), n, BLOCK, ROWS)
    x = load_moment(codes_ptr, absmax_ptr, qmap_ptr, rows, offs, mask, rmask, SIGNED, True)
    tl.store(out_ptr + offs, x, mask=mask)
