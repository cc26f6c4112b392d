"""Triton kernels for batched Muon (arXiv 2502.16982; docs/techniques/muon.md): symmetric products and fused
elementwise.

Newton–Schulz (NS5) spends its FLOPs on three products per iteration on the wide
orientation X ∈ R^{m×n} (m ≤ n):

    A = X Xᵀ            2m²n   (symmetric)
    B = b·A + c·A·A     2m³    (A symmetric, so A·A = A·Aᵀ is symmetric too)
    X ← a·X + B·X       2m²n

``sym_mm`` computes ``out = α·P Pᵀ + β·C + δ·I`` for a batch ``P ∈ [B, M, K]`` (any strides) and
an optional symmetric ``C ∈ [B, M, M]``: only the tiles on and above the diagonal are
computed, each is written to its place and, transposed, to its mirror.  That halves the first
two products (NS5 needs ≈0.7× the FLOPs of three full products).  ``β·C + δ·I`` is the
epilogue of the same kernel, so B' = b·A + c·A·A + a·I is one launch, and the update
X ← aX + BX becomes one plain product B'X (no copy of X into the output buffer, which
``baddbmm`` with ``out=`` makes).  Accumulation is fp32, the output is rounded once to
``out``'s dtype (as ``torch.baddbmm`` does).

``muon_pre`` / ``muon_post`` are the one-pass elementwise stages around the iteration (see
``pgs.func.muon_direction.muon_fused_step``).

Tile configurations are named in ``CONFIGS`` so that one benchmark run can try each
(``bench/muon_bench.py``).
"""

from __future__ import annotations

import functools

import torch

from pgs.func.kernels.kernel_config import interpret_requested

try:  # triton is optional on CPU installs
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

#: name -> (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps).  An output tile is BLOCK_M rows
#: × BLOCK_N columns (BLOCK_N a multiple of BLOCK_M); the triangle is kept at BLOCK_M
#: granularity (a tile straddling the diagonal computes a little below it and stores only the
#: blocks on and above it; their mirrors go below).
CONFIGS = {
    "m128n128k64s4w8": (128, 128, 64, 4, 8),
    "m128n128k64s3w8": (128, 128, 64, 3, 8),
    "m128n256k64s3w8": (128, 256, 64, 3, 8),
    "m128n256k64s4w8": (128, 256, 64, 4, 8),
    "m128n128k64s4w4": (128, 128, 64, 4, 4),
    "m64n64k64s4w4": (64, 64, 64, 4, 4),
}
DEFAULT_CONFIG = "m128n128k64s4w8"

#: ``ns_kernel="auto"`` on compute capability 9.0: the fastest config per (rows, cols) of the
#: batch as it is iterated (a tall batch stays tall), for bf16 Qwen3-1.7B shapes
#: (docs/performance.md, "Muon"); any other shape gets DEFAULT_CONFIG, close to the best
#: in every group measured there.
TUNED = {
    (2048, 2048): "m128n256k64s3w8",
    (1024, 2048): "m128n128k64s4w8",
    (6144, 2048): "m128n128k64s4w4",
    (2048, 6144): "m128n128k64s4w8",
}
#: compute capabilities where "auto" picks the symmetric kernel (those it was tuned on; the
#: 128-wide tiles' pipelines need more than 100 KB of shared memory: not every GPU has it)
TUNED_CAPABILITIES = ((9, 0),)
ELEMENTWISE_BLOCK = 4096

if HAVE_TRITON:

    @triton.jit
    def _sym_mm_kernel(p_ptr, c_ptr, out_ptr, tiles_ptr, M, K,
                       s_pb, s_pm, s_pk, s_cb, s_cm, s_cn, s_ob, s_om, s_on, alpha, beta, diag,
                       HAS_C: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        ti = tl.load(tiles_ptr + 2 * t)  # row block (BLOCK_M rows)
        tj = tl.load(tiles_ptr + 2 * t + 1)  # column block (BLOCK_N columns)
        rm = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tj * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        base = p_ptr + b * s_pb
        a_ptrs = base + rm[:, None] * s_pm + rk[None, :] * s_pk  # P[rm, k]      [BLOCK_M, BLOCK_K]
        b_ptrs = base + rk[:, None] * s_pk + rn[None, :] * s_pm  # Pᵀ[k, rn]     [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN:
                a = tl.load(a_ptrs)
                bt = tl.load(b_ptrs)
            else:
                kk = k * BLOCK_K + rk
                a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                bt = tl.load(b_ptrs, mask=(kk[:, None] < K) & (rn[None, :] < M), other=0.0)
            if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly: use fp32 there
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            if IEEE:  # fp32 inputs: full fp32 products, not tf32
                acc = tl.dot(a, bt, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, bt, acc)
            a_ptrs += BLOCK_K * s_pk
            b_ptrs += BLOCK_K * s_pk
        acc = acc * alpha
        row0 = ti * BLOCK_M
        inside = (rm[:, None] < M) & (rn[None, :] < M)
        if HAS_C:
            c = tl.load(c_ptr + b * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=inside, other=0.0)
            acc = acc + beta * c.to(tl.float32)
        # + diag·I (NS folds aX + BX into (B + aI)X: no copy of X into the output)
        acc = acc + tl.where(rm[:, None] == rn[None, :], diag, 0.0)
        res = acc.to(out_ptr.dtype.element_ty)
        obase = out_ptr + b * s_ob
        # blocks on and above the diagonal go to their place, those strictly above also mirrored
        tl.store(obase + rm[:, None] * s_om + rn[None, :] * s_on, res, mask=inside & (rn[None, :] >= row0))
        if (tj + 1) * BLOCK_N > row0 + BLOCK_M:
            mirror = (rn[:, None] < M) & (rm[None, :] < M) & (rn[:, None] >= row0 + BLOCK_M)
            tl.store(obase + rn[:, None] * s_om + rm[None, :] * s_on, tl.trans(res), mask=mirror)

    @triton.jit
    def _lerp(a, b, w):
        # torch.lerp's formula (ATen): |w| < 0.5 ? a + w(b − a) : b − (b − a)(1 − w)
        d = b - a
        return tl.where(tl.abs(w) < 0.5, a + w * d, b - d * (1.0 - w))

    @triton.jit
    def _muon_pre_kernel(g_ptr, m_ptr, x_ptr, sq_ptr, hp_ptr, n,
                         NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        mom = tl.load(hp_ptr + 0)
        w = tl.load(hp_ptr + 1)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = _lerp(m, g, w)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            u = _lerp(g, m, mom)
        else:
            u = m
        x = u.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + offs, x, mask=mask)
        xf = tl.where(mask, x.to(tl.float32), 0.0)
        tl.store(sq_ptr + pid, tl.sum(xf * xf, axis=0))

    @triton.jit
    def _muon_post_kernel(p_ptr, o_ptr, out_ptr, hp_ptr, seed_ptr, n, ratio, salt,
                          SR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(hp_ptr + 2)
        wd = tl.load(hp_ptr + 3)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = o * ratio + wd * p
        x = p + v * (-lr)
        if SR:
            seed = tl.load(seed_ptr) + salt  # one stream per tensor of the group
            noise = tl.randint(seed, offs).to(tl.uint32) & 0xFFFF
            bits = x.to(tl.uint32, bitcast=True)
            up = ((bits + noise) & 0xFFFF0000).to(tl.float32, bitcast=True)
            x = tl.where(tl.abs(x) < float("inf"), up, x)
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreting() -> bool:
    return interpret_requested()


def tuned_config(rows: int, cols: int) -> str:
    """The symmetric-kernel config ``ns_kernel="auto"`` uses for a [B, rows, cols] batch."""
    return TUNED.get((rows, cols), DEFAULT_CONFIG)


@functools.lru_cache(maxsize=16)
def auto_symmetric(device: torch.device) -> bool:
    """Whether ``ns_kernel="auto"`` uses the symmetric kernel on ``device`` (CUDA, sm_90)."""
    if not HAVE_TRITON or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) in TUNED_CAPABILITIES


@functools.lru_cache(maxsize=64)
def _tiles(nm: int, bm: int, bn: int, device: torch.device) -> torch.Tensor:
    """(row block, column block) of every tile that holds a BLOCK_M block on/above the diagonal."""
    ncol = -(-nm * bm // bn)
    pairs = [(i, j) for i in range(nm) for j in range(ncol) if (j + 1) * bn > i * bm]
    return torch.tensor(pairs, dtype=torch.int32).reshape(-1).to(device)


def sym_mm(p: torch.Tensor, c: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
           out: torch.Tensor | None = None, config: str = DEFAULT_CONFIG, diag: float = 0.0) -> torch.Tensor:
    """``out[b] = α·p[b] p[b]ᵀ + β·c[b] + diag·I`` for ``p ∈ [B, M, K]``; ``c`` (if given) must be symmetric.

    Only the tiles holding blocks on or above the diagonal are computed; the blocks below are
    their mirrors.  fp32 accumulation (full fp32 products for fp32 inputs); ``out`` defaults to
    ``p``'s dtype and is rounded once.
    """
    if not HAVE_TRITON:
        raise RuntimeError("sym_mm needs triton")
    if p.ndim != 3:
        raise ValueError(f"sym_mm: expected a [B, M, K] batch, got shape {tuple(p.shape)}")
    bm, bn, bk, stages, warps = CONFIGS[config]
    nb, m, k = p.shape
    if out is None:
        out = torch.empty((nb, m, m), dtype=p.dtype, device=p.device)
    cc = c if c is not None else out
    tiles = _tiles(-(-m // bm), bm, bn, p.device)
    even = (m % bn == 0) and (k % bk == 0)
    grid = (tiles.numel() // 2, nb)
    _sym_mm_kernel[grid](p, cc, out, tiles, m, k, *p.stride(), *cc.stride(), *out.stride(),
                         float(alpha), float(beta), float(diag), HAS_C=c is not None, EVEN=even,
                         UPCAST=_interpreting(), IEEE=p.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=bk, num_stages=stages, num_warps=warps)
    return out


def muon_pre(g: torch.Tensor, m: torch.Tensor, x: torch.Tensor, sq: torch.Tensor, hp: torch.Tensor,
             nesterov: bool) -> None:
    """One pass: m ← lerp(m, g, 1−μ) in place; x ← (lerp(g, m, μ) if nesterov else m) in x's dtype.

    ``g``, ``m``, ``x`` are contiguous with the same number of elements; ``hp`` = fp32
    [μ, 1−μ, ...].  ``sq`` (fp32, ``num_blocks(n)`` entries) receives per-block sums of
    squares of the stored ``x``: their sum is ‖x‖²_F, computed deterministically.
    """
    n = g.numel()
    _muon_pre_kernel[(num_blocks(n),)](g, m, x, sq, hp, n, NESTEROV=bool(nesterov), BLOCK=ELEMENTWISE_BLOCK)


def num_blocks(n: int) -> int:
    return max(1, -(-n // ELEMENTWISE_BLOCK))


def muon_post(p: torch.Tensor, o: torch.Tensor, out: torch.Tensor, hp: torch.Tensor, ratio: float,
              seed: torch.Tensor | None = None, salt: int = 0) -> torch.Tensor:
    """One pass: out ← p + (r·o + λp)·(−η) in fp32 (hp = [μ, 1−μ, η, λ]), cast or SR-rounded.

    With ``seed`` (an int64 device tensor) bf16 rounding is stochastic, Philox seeded with
    ``seed + salt`` (give each tensor of a group its own ``salt``).
    """
    n = p.numel()
    sr = seed is not None
    _muon_post_kernel[(num_blocks(n),)](
        p, o, out, hp, seed if sr else hp, n, float(ratio), int(salt) * 7919, SR=sr, BLOCK=ELEMENTWISE_BLOCK)
    return out
