"""Conformance entries for the 8-bit optimizers (issue 4).

Generated leaves are small (at most ``max_dim`` per side), so these entries quantize
everything with at least 16 elements in blocks of 16: the 8-bit path is what gets
exercised, next to the fp32 path of the smaller leaves.
"""

from __future__ import annotations

import pgs.func as pf
from registry import Entry, Inject

_Q = dict(block_size=16, min_8bit_size=16)


def _is_matrix(path, p):
    return p.ndim >= 2


ENTRIES = [
    Entry(
        "scale_by_lion8bit",
        lambda: pf.scale_by_lion8bit(b1=0.9, b2=0.99, **_Q),
        inject=Inject(pf.scale_by_lion8bit, dict(b1=0.9, b2=0.99, **_Q), static_args=("block_size", "min_8bit_size")),
        notes="8-bit momentum: requantization is deterministic, so paths agree bit for bit",
    ),
    Entry(
        "scale_by_adam8bit",
        lambda: pf.scale_by_adam8bit(b1=0.9, b2=0.99, eps=1e-8, **_Q),
        tol=1e-6,
        notes="torch's lerp with a 0-d tensor weight (injected b1) can round 1 ulp differently "
              "from lerp with a float weight",
        inject=Inject(pf.scale_by_adam8bit, dict(b1=0.9, b2=0.99, eps=1e-8, **_Q),
                      static_args=("block_size", "min_8bit_size")),
    ),
    Entry(
        "lion8bit",
        lambda: pf.lion8bit(1e-3, b1=0.95, b2=0.98, weight_decay=0.1, mask=_is_matrix, **_Q),
        needs_params=True,
        inject=Inject(pf.lion8bit, dict(learning_rate=1e-3, b1=0.95, b2=0.98, weight_decay=0.1, mask=_is_matrix, **_Q),
                      static_args=("block_size", "min_8bit_size")),
        jit_check=True,
        notes="FusedTransform: on CPU the fused step declines and the generic chain runs",
    ),
    Entry(
        "adamw8bit",
        lambda: pf.adamw8bit(1e-2, b1=0.9, b2=0.95, weight_decay=0.1, **_Q),
        needs_params=True,
        tol=1e-6,
        notes="as scale_by_adam8bit",
        inject=Inject(pf.adamw8bit, dict(learning_rate=1e-2, b1=0.9, b2=0.95, weight_decay=0.1, **_Q),
                      static_args=("block_size", "min_8bit_size")),
    ),
]
