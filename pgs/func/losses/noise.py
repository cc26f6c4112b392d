"""Embedding noise for instruction tuning: NEFTune and a symmetric (Rademacher) variant (docs/techniques/noise.md).

Pure functions of the embeddings and an explicit ``torch.Generator`` (on the embeddings'
device).  The runtime applies them to the input-embedding output in training mode only;
with ``training=False`` or ``alpha == 0`` they return the input unchanged (the same object).
The noise is additive and carries no gradient, so ∂Ẽ/∂E = I.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pgs.errors import InvalidArgument


def _scale(embeds: Tensor, alpha: float, lengths: Tensor | None) -> Tensor:
    """α/√(L·d) broadcastable to ``embeds``, zero at positions past each row's length."""
    if embeds.dim() < 2:
        raise InvalidArgument(f"embeds must be [..., L, d], got shape {tuple(embeds.shape)}")
    seq, d = embeds.shape[-2], embeds.shape[-1]
    if lengths is None:
        return torch.tensor(alpha / math.sqrt(seq * d), dtype=torch.float32, device=embeds.device)
    if lengths.shape != embeds.shape[:-2]:
        raise InvalidArgument(
            f"lengths has shape {tuple(lengths.shape)}, expected {tuple(embeds.shape[:-2])} (one per row)"
        )
    lengths = lengths.to(device=embeds.device)
    per_row = alpha / torch.sqrt(lengths.clamp(min=1).float() * d)
    inside = torch.arange(seq, device=embeds.device) < lengths[..., None]
    return (per_row[..., None] * inside)[..., None]


def _check(alpha: float) -> None:
    if not alpha >= 0:
        raise InvalidArgument(f"noise alpha must be >= 0, got {alpha}")


def neftune(
    embeds: Tensor,
    alpha: float,
    *,
    generator: torch.Generator | None,
    training: bool,
    lengths: Tensor | None = None,
) -> Tensor:
    """NEFTune, arXiv 2310.05914 (Jain et al., ICLR 2024): Ẽ = E + α/√(L·d) · ε, ε ~ U(−1, 1).

    Args:
        embeds: input embeddings [..., L, d].
        alpha: noise strength (the paper uses 5, 10, 15).
        generator: source of randomness (on ``embeds``' device); None uses torch's global one.
        training: False returns ``embeds`` itself (no noise in eval).
        lengths: true length of each row [...]; L is then that length and positions past it
            get no noise.  Without it L is the padded length, as HF/TRL's hook does.

    Returns:
        Noisy embeddings, ``embeds``' dtype; |Ẽ − E| ≤ α/√(L·d) elementwise.

    Example:
        >>> e = torch.zeros(2, 4, 8)
        >>> g = torch.Generator().manual_seed(0)
        >>> bool((neftune(e, 5.0, generator=g, training=True).abs() <= 5 / (4 * 8) ** 0.5).all())
        True
    """
    _check(alpha)
    if not training or alpha == 0:
        return embeds
    scale = _scale(embeds, alpha, lengths)
    eps = torch.rand(embeds.shape, generator=generator, device=embeds.device) * 2 - 1
    return embeds + (eps * scale).to(embeds.dtype)


def symnoise(
    embeds: Tensor,
    alpha: float,
    *,
    generator: torch.Generator | None,
    training: bool,
    lengths: Tensor | None = None,
) -> Tensor:
    """Symmetric embedding noise after SymNoise, arXiv 2312.01523: Ẽ = E + α/√(L·d) · r.

    r has independent Rademacher entries (±1 with probability ½ each), so the noise is
    symmetric about zero, has zero mean, and every entry has magnitude exactly NEFTune's bound
    α/√(L·d) (variance α²/(L·d), three times NEFTune's).  The paper's exact construction was
    not recovered; this is pgs's construction, not a reproduction.  Arguments as ``neftune``.
    """
    _check(alpha)
    if not training or alpha == 0:
        return embeds
    scale = _scale(embeds, alpha, lengths)
    bits = torch.randint(0, 2, embeds.shape, generator=generator, device=embeds.device)
    return embeds + ((bits.float() * 2 - 1) * scale).to(embeds.dtype)
