"""Triton kernels of the chunked loss: two passes over a chunk's logits instead of ~eight.

The torch path of ``chunked._forward_and_grads`` upcasts the chunk's [c, V] logits to fp32
and then makes separate passes for the log-sum-exp, the softmax, the entropy dot product, the
collision sum, the gradient and its downcast: about 50 bytes of memory traffic per logit, which
at V = 151,936 costs more than the two matmuls around it (docs/losses.md has the measured
times).  Here the logits stay in the
matmul's dtype (bf16) and are touched twice:

1. ``row_stats``: one program per row streams the row once with an online softmax (running
   max m, Σe, Σe·z, Σe² with e = exp(z − m)) and reads the target logit z_y; from these
   LSE = m + log Σe, entropy = LSE − Σe·z/Σe, collision Σp² = Σe²/(Σe)², log p_y = z_y − LSE.
2. ``grad``: the objective's per-row coefficients are known (torch, [c] vectors), so one pass
   writes ∂ℓ/∂z = coef·p − gate·e_y (times the softcap derivative 1 − (z/s)²) over the logits,
   in place, in their own dtype — the buffer the two gradient matmuls then read.

That is 6 bytes per bf16 logit.  The bias (if any) and the softcap s·tanh(z/s) are applied on
the fly in both passes, in fp32.  Results equal the torch path up to fp32 summation order
(the online softmax sums in another order) and the rounding of the gradient to the logits'
dtype, which the torch path also does before its matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Columns per tile.  A row of V = 151,936 bf16 logits is 297 KiB: 38 tiles of 4096.
BLOCK_V = 4096


@triton.jit
def _capped(z, softcap, SOFTCAP: tl.constexpr):
    # s·tanh(z/s) as s·(1 − 2/(exp(2z/s) + 1)): exact limits ±s, no NaN for large |z|.
    if SOFTCAP:
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return z


@triton.jit
def _row_stats_kernel(z_ptr, stride_z, bias_ptr, y_ptr, out_ptr, V, softcap,
                      HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = _capped(z, softcap, SOFTCAP)
        m_new = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
        q = q * (alpha * alpha) + tl.sum(e * e, axis=0)
        m = m_new
    y = tl.load(y_ptr + row)
    zy = tl.load(base + y).to(tl.float32)
    if HAS_BIAS:
        zy += tl.load(bias_ptr + y).to(tl.float32)
    zy = _capped(zy, softcap, SOFTCAP)
    o = out_ptr + row * 5
    tl.store(o + 0, m)
    tl.store(o + 1, s)
    tl.store(o + 2, t)
    tl.store(o + 3, q)
    tl.store(o + 4, zy)


@triton.jit
def _grad_kernel(z_ptr, stride_z, bias_ptr, y_ptr, lse_ptr, coef_ptr, gate_ptr, V, softcap,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    ptrs = z_ptr + row * stride_z + cols
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z = _capped(z, softcap, SOFTCAP)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    gate = tl.load(gate_ptr + row)
    y = tl.load(y_ptr + row)
    g = coef * tl.exp(z - lse) - tl.where(cols == y, gate, 0.0)
    if SOFTCAP:
        r = z / softcap
        g = g * (1.0 - r * r)
    tl.store(ptrs, g.to(z_ptr.dtype.element_ty), mask=mask)


def row_stats(z: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    """Per-row (LSE, entropy, collision Σp², log p_y) of the logits ``z`` [c, V], fp32."""
    c, V = z.shape
    out = torch.empty(c, 5, dtype=torch.float32, device=z.device)
    if c:
        _row_stats_kernel[(c,)](z, z.stride(0), bias if bias is not None else z, y, out, V,
                                float(softcap or 1.0), HAS_BIAS=bias is not None,
                                SOFTCAP=softcap is not None, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)),
                                num_warps=8)
    m, s, t, q, zy = out.unbind(1)
    lse = m + s.log()
    return lse, lse - t / s, q / (s * s), zy - lse


def grad_in_place(z: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
                  lse: torch.Tensor, coef: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Overwrite ``z`` with ∂ℓ/∂z_raw = (coef·p − gate·e_y)·(1 − (z/s)²) and return it."""
    c, V = z.shape
    if c:
        block = min(BLOCK_V, triton.next_power_of_2(V))
        f32 = dict(dtype=torch.float32)
        _grad_kernel[(c, triton.cdiv(V, block))](
            z, z.stride(0), bias if bias is not None else z, y, lse.to(**f32).contiguous(),
            coef.to(**f32).contiguous(), gate.to(**f32).contiguous(), V, float(softcap or 1.0),
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, BLOCK=block, num_warps=8)
    return z
