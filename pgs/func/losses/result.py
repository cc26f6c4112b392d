"""The value every token loss returns: sums, never means.

A loss reports the *sum* of its token losses and the number of valid tokens.  The runtime
adds these over micro-batches and data-parallel ranks and divides once by the global
valid-token count, so gradient accumulation cannot average per micro-batch (the 2024
gradient-accumulation bug) and an all-masked micro-batch contributes ``0`` and ``0``
instead of ``0/0``.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class TokenLossResult(NamedTuple):
    """Summed statistics of one micro-batch of token losses.

    Attributes:
        loss_sum: 0-d, differentiable: Σ_{i∈M} ℓ_i (plus ``z_loss · Σ LSE_i²`` when on).
        num_valid: 0-d int64: |M|, the tokens whose label is not the ignore index.
        entropy_sum: 0-d fp32, detached: Σ_{i∈M} H(p_i) in nats, or None when not computed.
        target_prob_sum: 0-d fp32, detached: Σ_{i∈M} p_{i,y}, or None when not computed.
        z_loss_sum: 0-d fp32, detached: Σ_{i∈M} LSE_i² (before the coefficient), or None.
        head_grad: the chunked loss's ``DeferredHeadGrad`` when asked to defer the head's
            gradient (``memory.defer_head_grad``), else None.
    """

    loss_sum: Tensor
    num_valid: Tensor
    entropy_sum: Tensor | None = None
    target_prob_sum: Tensor | None = None
    z_loss_sum: Tensor | None = None
    head_grad: object | None = None

    def mean_loss(self) -> Tensor:
        """``loss_sum / max(num_valid, 1)``: the token-mean for one micro-batch on its own.

        Only for a single micro-batch; with accumulation divide the summed ``loss_sum`` by the
        global ``num_valid`` instead.
        """
        return self.loss_sum / self.num_valid.clamp(min=1).to(self.loss_sum.dtype)

    def merge(self, other: TokenLossResult) -> TokenLossResult:
        """Field-wise sum with another micro-batch's result (a ``None`` field stays ``None``)."""

        def add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
            return None if a is None or b is None else a + b

        merged = [add(a, b) for a, b in zip(self[:5], other[:5])]
        return TokenLossResult(*merged)

