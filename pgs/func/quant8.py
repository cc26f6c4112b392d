"""Block-wise 8-bit quantization of optimizer state (docs/techniques/8bit.md), in plain torch.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.

A state tensor ``T`` is flattened and cut into blocks of ``B`` elements.  Each block ``b``
keeps one fp32 scale ``N_b = max_i |T_{b,i}|`` (``absmax``) and one uint8 code per element:

    T^Q_{b,i} = argmin_j |Q_j − T_{b,i}/N_b|          (nearest entry of the 256-entry map Q)
    T^D_{b,i} = Q[T^Q_{b,i}] · N_b

Semantics follow bitsandbytes' reference kernels, so codes and absmax equal theirs:

- ``Q`` is the dynamic (tree) map: base-10 exponent levels with linear fractions; signed for
  first moments, unsigned for second moments (``dynamic_map``).
- The normalised value is ``clamp(T · (1/max(N_b, 1e-38)), −1, 1)`` (a multiply by the
  reciprocal, not a division), and the code is the nearest entry with ties going to the
  lower code: the number of map midpoints strictly below the value.
- ``absmax`` of an all-zero block is stored as 0; its codes are those of 0, so it
  dequantizes to exact zeros.

This module is the reference (and the CPU path); ``pgs.func.kernels`` runs the same maths
fused with the optimizer update in one Triton kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument, TreeMismatch

#: Codes per map (8 bits).
NUM_CODES = 256
#: The smallest scale a block is divided by (bitsandbytes' clamp); keeps zero blocks finite.
MIN_SCALE = 1e-38


class Quantized8bit(NamedTuple):
    """A block-wise quantized tensor: one uint8 code per element, one fp32 scale per block.

    ``codes`` has the shape of the tensor it stands for; ``absmax`` is ``[ceil(numel / B)]``.
    """

    codes: torch.Tensor  # uint8
    absmax: torch.Tensor  # float32


def _build_dynamic_map(signed: bool) -> torch.Tensor:
    # Exponent level i = 0..6 covers (10^(i−7), 10^(i−6)); inside it the codes are the centres
    # of equal bins over [0.1, 1].  A signed map spends one sign bit, so it has half as many
    # fraction bins per level as an unsigned one; both end up with 256 sorted entries.
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        bins = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0
        level = (centres * (10.0 ** (i - 6))).tolist()
        values += level
        if signed:
            values += [-v for v in level]
    if len(values) != NUM_CODES:  # pragma: no cover - a construction invariant
        raise AssertionError(f"dynamic map has {len(values)} entries")
    return torch.tensor(sorted(values), dtype=torch.float32)


#: Both maps, built once at import (a plain table, not ``lru_cache``: compiled chains call
#: ``dynamic_map``, and dynamo warns at every ``lru_cache``-wrapped call it traces).
_DYNAMIC_MAPS = {signed: _build_dynamic_map(signed) for signed in (True, False)}


def dynamic_map(signed: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256-entry dynamic quantization map, sorted ascending (fp32).

    Signed: 127 negative codes (down to −0.99296875), 0, 128 positive codes up to 1.0.
    Unsigned: 0, 255 positive codes up to 1.0.  Equal to bitsandbytes'
    ``create_dynamic_map(signed)``.
    """
    m = _DYNAMIC_MAPS[bool(signed)]
    return m if device is None else m.to(device)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The 255 decision boundaries between neighbouring codes of a sorted map."""
    return (code[:-1] + code[1:]) / 2


#: Mantissa bits per bucket of ``bucket_table``: the fewest that leave at most one midpoint
#: in every bucket (the top level's midpoints are ~1.05% apart in the signed map, ~0.53% in
#: the unsigned one; a bucket spans 2^-MB of its binade).
BUCKET_MANTISSA_BITS = {True: 6, False: 7}


def _positive_midpoints(signed: bool) -> torch.Tensor:
    mids = midpoints(dynamic_map(signed))
    return mids[mids > 0]


@functools.lru_cache(maxsize=None)
def bucket_table(signed: bool) -> torch.Tensor:
    """Lookup table of the device encoder ``blockwise8._encode_bucket`` (a CPU tensor).

    A value t ≥ 0 (any fp32 bit pattern with the sign bit clear) falls in bucket
    ``bits(t) >> S``, S = 23 − MB; the table covers all of them (values above 1 count as 1,
    the clamp; the lines a kernel never touches cost no cache).  Per bucket, c = #{positive
    midpoints < the bucket's first value}, and the one midpoint M inside the bucket, if any,
    as int32 entries ``c << 24 | (bits(M) mod 2^S)`` (2^S if no midpoint): the whole
    decision is one integer compare.
    """
    signed = bool(signed)
    mb = BUCKET_MANTISSA_BITS[signed]
    shift = 23 - mb
    pos = _positive_midpoints(signed)
    pbits = pos.view(torch.int32).long()
    size = (0x7FFFFFFF >> shift) + 1
    starts = torch.arange(size, dtype=torch.long) << shift
    c = torch.searchsorted(pbits, starts)  # midpoints strictly below the bucket start
    bucket = pbits >> shift
    if bool((bucket[1:] == bucket[:-1]).any()):  # pragma: no cover - a construction invariant
        raise AssertionError("bucket_table: a bucket holds two midpoints")
    low = torch.full((size,), 1 << shift, dtype=torch.long)
    low[bucket] = pbits & ((1 << shift) - 1)
    word = c << 24 | low
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # as uint32 bits


def _check_block_size(block_size: int, who: str) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidArgument(f"{who}: block_size must be a positive int, got {block_size!r}")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    return max(1, -(-numel // block_size))


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to whole blocks, viewed ``[num_blocks, block_size]``."""
    flat = x.reshape(-1)
    nb = num_blocks(flat.numel(), block_size)
    pad = nb * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(nb, block_size)


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, block_size: int = 256) -> Quantized8bit:
    """Quantize ``x`` block-wise against the sorted map ``code``.

    Args:
        x: any floating tensor (computed in fp32).
        code: a sorted 256-entry fp32 map (``dynamic_map``).
        block_size: elements per block; the last block may be partial.

    Returns:
        ``Quantized8bit(codes uint8 shaped like x, absmax fp32 [num_blocks])``.

    Example::

        q = quantize_blockwise(torch.randn(1000), dynamic_map(signed=True), 256)
        x_hat = dequantize_blockwise(q, dynamic_map(signed=True), 256)
    """
    _check_block_size(block_size, "quantize_blockwise")
    code = code.to(device=x.device, dtype=torch.float32)
    xb = _blocks(x.float(), block_size)
    absmax = xb.abs().amax(dim=1)
    scaled = (xb * (1.0 / absmax.clamp(min=MIN_SCALE)).unsqueeze(1)).clamp_(-1.0, 1.0)
    idx = torch.bucketize(scaled, midpoints(code), out_int32=True)
    codes = idx.to(torch.uint8).reshape(-1)[: x.numel()].view(x.shape)
    return Quantized8bit(codes, absmax)


def dequantize_blockwise(q: Quantized8bit, code: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """``Q[codes] · absmax`` per block, in fp32, shaped like ``q.codes``."""
    _check_block_size(block_size, "dequantize_blockwise")
    codes, absmax = q
    if absmax.numel() != num_blocks(codes.numel(), block_size):
        raise InvalidArgument(
            f"dequantize_blockwise: {codes.numel()} codes need {num_blocks(codes.numel(), block_size)} "
            f"absmax entries for block_size={block_size}, got {absmax.numel()}"
        )
    code = code.to(device=codes.device, dtype=torch.float32)
    vals = _blocks(code[codes.reshape(-1).long()], block_size) * absmax.unsqueeze(1)
    return vals.reshape(-1)[: codes.numel()].view(codes.shape)


def zeros_quantized(like: torch.Tensor, block_size: int, signed: bool) -> Quantized8bit:
    """The quantized form of ``zeros_like(like)``: codes of 0, absmax 0."""
    zero_code = int(torch.searchsorted(dynamic_map(signed), torch.tensor(0.0)))
    codes = torch.full(like.shape, zero_code, dtype=torch.uint8, device=like.device)
    absmax = torch.zeros(num_blocks(like.numel(), block_size), dtype=torch.float32, device=like.device)
    return Quantized8bit(codes, absmax)


def quantization_error_bound(code: torch.Tensor) -> torch.Tensor:
    """Per code: half the gap to its farther neighbour (the worst error of a value rounded to it).

    A value ``x`` in a block with scale ``N`` that rounds to code ``j`` satisfies
    ``|x − Q_j·N| ≤ bound_j · N`` (A5 invariant 5).
    """
    gaps = code[1:] - code[:-1]
    left = torch.cat([gaps[:1], gaps])
    right = torch.cat([gaps, gaps[-1:]])
    return torch.maximum(left, right) / 2


# ----------------------------------------------------------------------------------------
# moments as stored by the 8-bit transforms: Quantized8bit for large tensors, fp32 otherwise


def is_8bit_eligible(min_8bit_size: int):
    """``(path, param) -> bool``: tensors of at least ``min_8bit_size`` elements get 8-bit state.

    Used as the transforms' ``group_by``, so on the flat layout every group is all-8-bit or
    all-fp32 and its label says which.
    """

    def eligible(path, p) -> bool:
        return p.numel() >= min_8bit_size

    eligible.__qualname__ = f"is_8bit_eligible({min_8bit_size})"
    return eligible


def init_moment(x: torch.Tensor, quantized: bool, block_size: int, signed: bool):
    """A zero moment for leaf ``x``: ``Quantized8bit`` when ``quantized``, else fp32 zeros."""
    if quantized:
        return zeros_quantized(x, block_size, signed)
    return torch.zeros_like(x, dtype=torch.float32)


def load_moment(m, block_size: int, signed: bool) -> torch.Tensor:
    """A stored moment as fp32 (dequantized when it is ``Quantized8bit``)."""
    if isinstance(m, Quantized8bit):
        return dequantize_blockwise(m, dynamic_map(signed), block_size)
    return m.float()


def store_moment(x: torch.Tensor, like, block_size: int, signed: bool):
    """``x`` stored the way ``like`` is: requantized, or as fp32."""
    if isinstance(like, Quantized8bit):
        return quantize_blockwise(x, dynamic_map(signed), block_size)
    return x.to(torch.float32)


def moment_leaves(updates, moments, who: str) -> list:
    """The moments' leaves (``Quantized8bit`` counted as one leaf), aligned with ``updates``'."""
    import torch.utils._pytree as _pt

    u_leaves, u_spec = _pt.tree_flatten(updates, is_leaf=lambda x: x is None)
    m_leaves, m_spec = _pt.tree_flatten(moments, is_leaf=lambda x: x is None or isinstance(x, Quantized8bit))
    if u_spec != m_spec:
        raise TreeMismatch(f"{who}: updates do not have the tree structure of the optimizer state")
    for u, m in zip(u_leaves, m_leaves):
        if (u is None) != (m is None):
            raise TreeMismatch(f"{who}: an updates leaf and its state leaf disagree on being absent")
    return m_leaves
