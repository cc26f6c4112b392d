"""Distinct 128-byte lines per warp-wide gather (an L1 wavefront each) for the 8-bit kernels' tables.

    python bench/experiments/gather_lines.py

One warp owns one 256-element block, each lane 8 contiguous elements; a gather instruction
serves element j of every lane.  The moments are modelled as Gaussian blocks (m, signed) and
squares of Gaussians (v, unsigned), normalised by their absmax as the kernels do.  Reports
the mean distinct lines per warp instruction for each table the kernels gather from.
"""

from __future__ import annotations

import torch

from pgs.func.quant8 import BUCKET_MANTISSA_BITS, dynamic_map, quantize_blockwise


def lines(index: torch.Tensor, entry_bytes: int) -> float:
    """index: [blocks, 256] table indices -> mean distinct lines over (block, j) instructions."""
    line = (index * entry_bytes) // 128
    per = line.view(-1, 32, 8).permute(0, 2, 1)  # [blocks, j, lane]
    s = per.sort(dim=-1).values
    distinct = 1 + (s[..., 1:] != s[..., :-1]).sum(-1)
    return float(distinct.float().mean())


def main() -> None:
    g = torch.Generator().manual_seed(0)
    nb = 4096
    for name, signed, x in [("m (signed, Gaussian)", True, torch.randn(nb, 256, generator=g)),
                            ("v (unsigned, Gaussian²)", False, torch.randn(nb, 256, generator=g) ** 2)]:
        xs = x / x.abs().amax(1, keepdim=True)
        bits = xs.view(torch.int32).long()
        shift = 23 - BUCKET_MANTISSA_BITS[signed]
        codes = quantize_blockwise(x, dynamic_map(signed), 256).codes.long().view(nb, 256)
        print(name)
        print(f"  dequant map, fp32 [256]          {lines(codes, 4):5.2f}")
        print(f"  ENC=1 |s| table, int16           {lines((bits & 0x7FFFFFFF) >> shift, 2):5.2f}  (+ rare 2nd load)")
        print(f"  ENC=2 |s| table, int32           {lines((bits & 0x7FFFFFFF) >> shift, 4):5.2f}")
        print(f"  ENC=3 word table, int32          {lines((bits & 0xFFFFFFFF) >> shift, 4):5.2f}")


if __name__ == "__main__":
    main()
