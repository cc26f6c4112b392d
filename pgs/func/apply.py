"""Applying updates to parameters, with optional stochastic rounding into bf16.

Stochastic rounding keeps small updates to low-precision weights unbiased in expectation
(Gupta et al., "Deep Learning with Limited Numerical Precision", arXiv 1502.02551).
"""

from __future__ import annotations

import torch

from pgs.func import tree as T


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down at random, unbiased: E[round(x)] = x.

    bf16 keeps the top 16 bits of an fp32 word.  Adding a uniform random integer in
    [0, 2^16) to the word and truncating the low 16 bits rounds up with probability equal to
    the discarded fraction.  Non-finite values are rounded to nearest.
    """
    return stochastic_round_fp32(x, generator).to(torch.bfloat16)


def stochastic_round_fp32(x: torch.Tensor, generator: torch.Generator | None = None, *,
                          inplace: bool = False) -> torch.Tensor:
    """``stochastic_round_to_bf16(x)`` before its final cast: fp32 values that bf16 holds
    exactly (non-finite ones unchanged, for the cast to round to nearest), so that a copy into
    a bf16 tensor (``copy_``, ``torch._foreach_copy_``) is the cast, with no kernel of its own.
    The same random draw as ``stochastic_round_to_bf16``.  ``inplace``: write the result into
    ``x`` (an fp32 tensor) and return it."""
    x = x.float()
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    # round to nearest where x is not finite: ±inf come through the noise unchanged (their low
    # 16 bits are zero, and the carry-free truncation gives the same word back), so only NaN
    # (whose payload the noise could carry into an inf or wrap to −0) must be kept: x == x,
    # one kernel (isfinite takes four)
    if inplace:
        return torch.where(x == x, rounded, x, out=x)
    return torch.where(x == x, rounded, x)


def apply_updates(params, updates, *, stochastic_rounding: bool = False, generator: torch.Generator | None = None):
    """θ ← θ + u, computed in fp32 and cast back to each parameter's dtype.

    With ``stochastic_rounding=True``, bf16 parameters are rounded stochastically (unbiased
    in expectation), which lets bf16 weights accumulate updates smaller than their ulp without
    an fp32 master copy.  Returns a new tree; ``params`` is untouched.
    """
    T.check_same_structure(params, updates, "params", "updates")

    def one(p, u):
        cd = torch.promote_types(p.dtype, torch.float32)
        new = p.to(cd) + u.to(cd)
        if stochastic_rounding and p.dtype == torch.bfloat16:
            return stochastic_round_to_bf16(new, generator)
        return new.to(p.dtype)

    return T.tree_map(one, params, updates)
