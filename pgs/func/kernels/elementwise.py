"""Fused Triton kernels for the common elementwise chains (AdamW, Lion) on flat buffers.

One pass over a flat group: read the gradient, the parameter and the moments, write the
parameter and the moments in place.  These replace the reference functions of
``scale_by_adam``/``scale_by_lion`` + ``add_decayed_weights`` + ``scale_by_learning_rate``
when ``pf.compile`` recognises that chain; the results equal the reference maths (fp32
arithmetic, stores rounded to each buffer's dtype).  Hyperparameters that change per step
(lr, bias corrections) are read from device scalars, so nothing recompiles and the host
never synchronises.

Constant hyperparameters reach the kernels as a cached fp32 device tensor (``_consts``),
with 1 − β computed in float64 on the host, exactly as the reference's ``hp_cache(1.0 - b1,
...)``.  They used to be plain float arguments with ``1.0 - b`` computed in the kernel: on a
GPU a float argument is fp32, so that gave 1 − fp32(β) (1 − fp32(0.999) is 1.3e-5 away from
fp32(0.001); 1.7e-4 for β2 = 0.9999), a systematic bias of the update that Triton's CPU
interpreter (which keeps float arguments as Python doubles) never showed.  A tensor is read
identically by the interpreter and the GPU.
"""

from __future__ import annotations

import functools

import torch

try:  # triton is optional on CPU installs
    import triton
    import triton.language as tl

    from pgs.func.kernels.blockwise8 import bf16_bits, sr_noise

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

BLOCK = 2048

if HAVE_TRITON:

    @triton.jit
    def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scal_ptr, hp_ptr, seed_ptr, n, HAS_WD: tl.constexpr,
                      SR: tl.constexpr, BLOCK: tl.constexpr):
        # scal = [η, 1−β1^t, 1−β2^t] (per step); hp = [1−β1, β2, 1−β2, ε, λ] (constant)
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(scal_ptr + 0)
        bc1 = tl.load(scal_ptr + 1)
        bc2 = tl.load(scal_ptr + 2)
        w1 = tl.load(hp_ptr + 0)
        b2 = tl.load(hp_ptr + 1)
        w2 = tl.load(hp_ptr + 2)
        eps = tl.load(hp_ptr + 3)
        wd = tl.load(hp_ptr + 4)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = m + w1 * (g - m)
        v = v * b2 + w2 * g * g
        u = (m / bc1) / (tl.sqrt(v / bc2) + eps)
        if HAS_WD:
            u = u + wd * p
        p = p - lr * u
        if SR:  # to a value bf16 holds, with the hash stream's noise (the cast below is then exact)
            p = bf16_bits(p, sr_noise(seed_ptr, offs))
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _lion_kernel(p_ptr, g_ptr, m_ptr, scal_ptr, hp_ptr, seed_ptr, n, HAS_WD: tl.constexpr, SR: tl.constexpr,
                     BLOCK: tl.constexpr):
        # scal = [η] (per step); hp = [1−β1, 1−β2, λ] (constant)
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(scal_ptr + 0)
        w1 = tl.load(hp_ptr + 0)
        w2 = tl.load(hp_ptr + 1)
        wd = tl.load(hp_ptr + 2)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        c = m + w1 * (g - m)
        u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        if HAS_WD:
            u = u + wd * p
        p = p - lr * u
        if SR:
            p = bf16_bits(p, sr_noise(seed_ptr, offs))
        m = m + w2 * (g - m)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=256)
def _consts(device: torch.device, values: tuple) -> torch.Tensor:
    """Constant hyperparameters (float64 on the host) as one cached fp32 tensor on ``device``."""
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)


def _sr(p: torch.Tensor, seed: torch.Tensor | None) -> bool:
    return seed is not None and p.dtype == torch.bfloat16


def adamw_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor,
                b1: float, b2: float, eps: float, wd: float, seed: torch.Tensor | None = None) -> None:
    """In place: one AdamW step over flat buffers. ``scalars`` = fp32 [lr, 1−β1^t, 1−β2^t] on the device.

    ``seed`` (an int64 device scalar, ``sr_seed``) rounds a bf16 ``p`` stochastically: element e
    with the 16 bits at offset e of the seed's hash stream, the noise ``pf.apply_updates`` draws
    for that seed (arXiv 1502.02551 for the rounding); without it, to nearest."""
    n = p.numel()
    grid = (triton.cdiv(n, BLOCK),)
    hp = _consts(p.device, (1.0 - float(b1), float(b2), 1.0 - float(b2), float(eps), float(wd)))
    sr = _sr(p, seed)
    _adamw_kernel[grid](p, g, m, v, scalars, hp, seed if sr else scalars, n, HAS_WD=wd != 0.0, SR=sr, BLOCK=BLOCK,
                        num_warps=8)


def lion_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, scalars: torch.Tensor,
               b1: float, b2: float, wd: float, seed: torch.Tensor | None = None) -> None:
    """In place: one Lion step over flat buffers. ``scalars`` = fp32 [lr] on the device; ``seed``
    as in :func:`adamw_step_`."""
    n = p.numel()
    grid = (triton.cdiv(n, BLOCK),)
    hp = _consts(p.device, (1.0 - float(b1), 1.0 - float(b2), float(wd)))
    sr = _sr(p, seed)
    _lion_kernel[grid](p, g, m, scalars, hp, seed if sr else scalars, n, HAS_WD=wd != 0.0, SR=sr, BLOCK=BLOCK,
                       num_warps=8)
