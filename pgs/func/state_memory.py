"""How many bytes an optimizer state holds, per parameter (for memory budgets and tests)."""

from __future__ import annotations

import torch

from pgs.func import tree as T


def state_bytes(state) -> int:
    """Total bytes of every tensor in a state tree (each storage counted once).

    Works for any state (per-parameter or flat layout, 8-bit or not): it walks the tree's
    tensor leaves and sums ``numel · element_size``, counting tensors that share one storage
    (views of a flat buffer) by that storage.
    """
    seen: dict[tuple, int] = {}
    loose = 0
    for x in T.leaves(state):
        if not isinstance(x, torch.Tensor):
            continue
        if x.is_meta:
            loose += x.numel() * x.element_size()
            continue
        st = x.untyped_storage()
        key = (st.data_ptr(), str(x.device))
        if st.data_ptr() == 0:
            loose += x.numel() * x.element_size()
            continue
        seen[key] = max(seen.get(key, 0), st.nbytes())
    return loose + sum(seen.values())


def num_params(params) -> int:
    """Elements in a parameter tree (``None`` leaves skipped)."""
    return sum(x.numel() for x in T.leaves(params) if isinstance(x, torch.Tensor))


def state_bytes_per_param(state, params) -> float:
    """``state_bytes(state) / num_params(params)``.

    Example::

        opt = pf.lion8bit(1e-4)
        state = opt.init(params)
        pf.state_bytes_per_param(state, params)   # ≈ 1.016 at Qwen3-1.7B shapes
    """
    n = num_params(params)
    return state_bytes(state) / max(n, 1)
