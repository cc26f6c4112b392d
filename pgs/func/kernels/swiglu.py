"""SwiGLU gating in one pass, forward and backward, in place (used by the sequence-tiled MLP).

With g = x W_gᵀ, u = x W_uᵀ and a = SiLU(g) = g·σ(g) (Shazeer, "GLU Variants Improve
Transformer", arXiv 2002.05202; SiLU: Elfwing et al., arXiv 1702.03118):

    forward:   h = a · u                                   (written over g)
    backward:  given dh = dy W_d:
               h  = a · u                                  (written over dh: dW_d needs it)
               du = dh · a                                 (written over u)
               dg = dh · u · σ(g) · (1 + g · (1 − σ(g)))   (written over g)

Every element is computed in fp32 (fp64 for fp64 inputs) from the stored inputs and rounded
once to their dtype.
Each output overwrites an input of the same element, so no [tokens, I] buffer is allocated.
``swiglu_forward_`` / ``swiglu_backward_`` run a Triton kernel on CUDA (and in Triton's
interpreter on the CPU when ``KernelConfig.triton_on_cpu``, for the tests) and the same formulas in
torch ops elsewhere.
"""

from __future__ import annotations


import torch
from torch import Tensor

from pgs.func.kernels.elementwise import HAVE_TRITON  # triton is optional on CPU installs

BLOCK = 2048

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(g_ptr + offs, (g * s * u).to(g_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, dh_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        a = g * s
        tl.store(dh_ptr + offs, (a * u).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(u_ptr + offs, (dh * a).to(u_ptr.dtype.element_ty), mask=mask)
        tl.store(g_ptr + offs, (dh * u * s * (1.0 + g * (1.0 - s))).to(g_ptr.dtype.element_ty), mask=mask)


def _use_triton(x: Tensor) -> bool:
    if not HAVE_TRITON or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.is_cuda:
        return True
    from pgs.func import kernels as K

    return K.triton_on_cpu()


def _check(*ts: Tensor) -> None:
    first = ts[0]
    for t in ts:
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError("swiglu: the tensors must be contiguous, of one shape and one dtype")


def swiglu_forward_(g: Tensor, u: Tensor) -> Tensor:
    """``g ← SiLU(g)·u`` in place; returns ``g``."""
    _check(g, u)
    n = g.numel()
    if _use_triton(g):
        if n:
            _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, n, BLOCK=BLOCK)
        return g
    cd = torch.promote_types(g.dtype, torch.float32)
    g32 = g.to(cd)
    g.copy_(g32 * torch.sigmoid(g32) * u.to(cd))
    return g


def swiglu_backward_(g: Tensor, u: Tensor, dh: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """In place: ``dh ← h = SiLU(g)·u``, ``u ← du = dh·SiLU(g)``, ``g ← dg``; returns (h, du, dg)."""
    _check(g, u, dh)
    n = g.numel()
    if _use_triton(g):
        if n:
            _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, dh, n, BLOCK=BLOCK)
        return dh, u, g
    cd = torch.promote_types(g.dtype, torch.float32)
    g32, u32, dh32 = (t.to(cd, copy=True) for t in (g, u, dh))  # copies: the outputs overwrite them
    s = torch.sigmoid(g32)
    a = g32 * s
    dh.copy_(a * u32)
    u.copy_(dh32 * a)
    g.copy_(dh32 * u32 * s * (1.0 + g32 * (1.0 - s)))
    return dh, u, g
