"""Fused Triton kernels for the 8-bit optimizers, and when to use them.

The composition layer (``pgs.func.lion8bit``, ``pgs.func.adam8bit``) never needs this
package: every kernel here replaces a torch reference function with the same results, and
the transforms pick it by ``backend``:

- ``"auto"``: Triton on CUDA tensors, the torch reference elsewhere;
- ``"torch"``: always the reference;
- ``"triton"``: always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set before this
  package first compiles a kernel; the tests do that at tiny sizes).

Launchers take and return plain tensors; hyperparameters go in as one fp32 device tensor.
"""

from __future__ import annotations

import functools
import os

import torch

from pgs.func.quant8 import Quantized8bit, dynamic_map, midpoints

#: Quantization blocks per program, and warps per program: one warp per 256-element block,
#: so each block's absmax is a warp-shuffle reduction (no shared memory, no barrier), and
#: each thread owns 8 contiguous elements (16-byte bf16 loads, 8-byte code loads/stores).
#: 4 blocks per program: small enough for many resident programs (latency hiding for a
#: memory-bound kernel), large enough to amortise the per-program scalar loads.
ROWS = 4
NUM_WARPS = 4
#: Dequantize by one gather per element from the 256-entry map instead of the exact
#: arithmetic decode (``blockwise8._decode``); both give identical values.  An A/B knob for
#: device benchmarks (the arithmetic decode costs ~40 ALU instructions, the gather an L1
#: wavefront per distinct 128-byte line a warp touches).
DEQ_TABLE = os.environ.get("PGS_DEQ_TABLE", "1") == "1"
BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if not triton_importable():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def use_triton(backend: str, x: torch.Tensor, block_size: int) -> bool:
    """Whether the fused kernel serves tensor ``x`` under ``backend``."""
    if backend == "torch" or block_size & (block_size - 1) or block_size > 4096:
        return False  # tl.arange needs a power of two
    if backend == "auto":
        return x.is_cuda and triton_importable()
    return True  # "triton": the caller asked for it (CPU needs the interpreter)


def _module():
    from pgs.func.kernels import blockwise8

    return blockwise8


@functools.lru_cache(maxsize=16)
def _maps(signed: bool, device: torch.device):
    code = dynamic_map(signed, device)
    mids = midpoints(code).contiguous()
    return code, mids


def _grid(n: int, block_size: int):
    nb = max(1, -(-n // block_size))
    return (-(-nb // ROWS),)


def _flat(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("fused 8-bit kernels need contiguous tensors")
    return x.view(-1)


def _no_seed(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def lion8bit(g, m: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None, m_out=None,
             seed: torch.Tensor | None = None):
    """One Lion step on a block-quantized momentum.

    Without ``p``: returns ``(sign direction shaped like g, new Quantized8bit)``; ``hp`` =
    ``[1−β1, 1−β2]``.  With ``p``: writes ``p − η(sign + λp)`` into ``out`` (which may be
    ``p`` itself) and the new momentum into ``m_out`` (which may be ``m``); ``hp`` =
    ``[1−β1, 1−β2, η, λ]``; ``seed`` (an int64 device tensor) turns on stochastic rounding
    of a bf16 ``out``.
    """
    k = _module()
    dev = g.device
    code, mids = _maps(True, dev)
    apply = p is not None
    if out is None:
        out = torch.empty_like(p if apply else g)
    if m_out is None:
        m_out = Quantized8bit(torch.empty_like(m.codes), torch.empty_like(m.absmax))
    n = g.numel()
    k.lion8bit_kernel[_grid(n, block_size)](
        _flat(g), _flat(p) if apply else _flat(g), _flat(out),
        _flat(m.codes), m.absmax, _flat(m_out.codes), m_out.absmax,
        code, mids, hp, seed if seed is not None else _no_seed(dev), n,
        BLOCK=block_size, ROWS=ROWS, APPLY=apply, SR=seed is not None, DEQ_TABLE=DEQ_TABLE,
        num_warps=NUM_WARPS,
    )
    return out, m_out


def adam8bit(g, m: Quantized8bit, v: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None,
             m_out=None, v_out=None, seed: torch.Tensor | None = None):
    """One Adam step on block-quantized moments (signed map for m, unsigned for v).

    ``hp`` = ``[1−β1, β2, 1−β2, ε, ε_root, 1−β1^t, 1−β2^t]`` (+ ``[η, λ]`` with ``p``).
    Returns ``(direction or new parameter, new m, new v)``; see ``lion8bit`` for ``out``.
    """
    k = _module()
    dev = g.device
    code_m, mids_m = _maps(True, dev)
    code_v, mids_v = _maps(False, dev)
    apply = p is not None
    if out is None:
        out = torch.empty_like(p if apply else g)
    if m_out is None:
        m_out = Quantized8bit(torch.empty_like(m.codes), torch.empty_like(m.absmax))
    if v_out is None:
        v_out = Quantized8bit(torch.empty_like(v.codes), torch.empty_like(v.absmax))
    n = g.numel()
    k.adam8bit_kernel[_grid(n, block_size)](
        _flat(g), _flat(p) if apply else _flat(g), _flat(out),
        _flat(m.codes), m.absmax, _flat(m_out.codes), m_out.absmax,
        _flat(v.codes), v.absmax, _flat(v_out.codes), v_out.absmax,
        code_m, mids_m, code_v, mids_v, hp, seed if seed is not None else _no_seed(dev), n,
        BLOCK=block_size, ROWS=ROWS, APPLY=apply, SR=seed is not None, DEQ_TABLE=DEQ_TABLE,
        num_warps=NUM_WARPS,
    )
    return out, m_out, v_out


def quantize(x: torch.Tensor, signed: bool, block_size: int) -> Quantized8bit:
    """``quantize_blockwise(x, dynamic_map(signed), block_size)`` in one Triton kernel."""
    k = _module()
    code, mids = _maps(bool(signed), x.device)
    x = x.contiguous()
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(max(1, -(-n // block_size)), dtype=torch.float32, device=x.device)
    k.quantize_kernel[_grid(n, block_size)](
        _flat(x), _flat(codes), absmax, mids, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed), num_warps=NUM_WARPS,
    )
    return Quantized8bit(codes, absmax)


def dequantize(q: Quantized8bit, signed: bool, block_size: int, *, table: bool | None = None) -> torch.Tensor:
    """``dequantize_blockwise(q, dynamic_map(signed), block_size)`` in one Triton kernel (fp32)."""
    k = _module()
    codes = q.codes.contiguous()
    code, _ = _maps(bool(signed), codes.device)
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    k.dequantize_kernel[_grid(n, block_size)](
        _flat(codes), q.absmax, _flat(out), code, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed),
        DEQ_TABLE=DEQ_TABLE if table is None else bool(table), num_warps=NUM_WARPS,
    )
    return out
