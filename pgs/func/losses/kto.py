"""KTO: preference optimization from unpaired, labelled completions (Ethayarajh et al., arXiv 2402.01306).

Each example is one prompt x, one completion y and a label: desirable (D) or undesirable (U).
With the implied reward r(x, y) = log π(y|x) − log π_ref(y|x) (summed log-probs of the
completion tokens) and a reference point z_ref, the per-example loss is

    desirable:    λ_D · (1 − σ(β·(r(x, y) − z_ref)))
    undesirable:  λ_U · (1 − σ(β·(z_ref − r(x, y))))

(the paper's λ_y − v(x, y), its eq. 8: the Kahneman–Tversky value v, a logistic here, is
concave in gains and convex in losses around z_ref).  The reference point is the KL divergence
between policy and reference, estimated over *mismatched* examples — the prompt x_i with the
completion y'_i of another example, so that y' is a sample of completions that do not answer x:

    z_ref = max(0, mean_i (log π(y'_i|x_i) − log π_ref(y'_i|x_i)))

detached (no gradient flows through it) and clamped at 0, as in the paper.
:func:`kto_reference_point` computes it; :func:`kto_loss` takes it as an argument, so a caller
decides over which examples it is estimated (a micro-batch, a held-out set) and the loss stays
per example.

The paper recommends weights with λ_D·n_D / (λ_U·n_U) ∈ [1, 4/3] for n_D desirable and n_U
undesirable examples (:func:`kto_weight_ratio`, :data:`RECOMMENDED_RATIO`).

Rewards (detached, for logging): β·r(x, y) per example.  Pure: no I/O, no process groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pgs.errors import InvalidArgument
from pgs.func.losses.preference import check_number

#: The paper's recommended range of λ_D·n_D / (λ_U·n_U) (arXiv 2402.01306).
RECOMMENDED_RATIO = (1.0, 4.0 / 3.0)


class KTOLoss(NamedTuple):
    """Per-example results of :func:`kto_loss` (all [N]).

    Attributes:
        loss: the per-example loss, differentiable; the caller reduces it (mean over examples).
        rewards: β·(log π(y|x) − log π_ref(y|x)), detached.
        desirable: the labels as a bool tensor.
        reference_point: z_ref (0-d, detached), as given.
    """

    loss: Tensor
    rewards: Tensor
    desirable: Tensor
    reference_point: Tensor


def kto_reference_point(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """z_ref = max(0, mean(log π(y'|x) − log π_ref(y'|x))) over the mismatched examples, detached (0-d).

    Args:
        kl_logps: [M] summed log π of each mismatched completion y'_i given the prompt x_i.
        ref_kl_logps: [M] the same under the reference.

    Returns:
        a 0-d tensor in kl_logps' dtype promoted to at least fp32; 0 for M = 0.
    """
    for name, t in (("kl_logps", kl_logps), ("ref_kl_logps", ref_kl_logps)):
        if not isinstance(t, Tensor) or t.dim() != 1:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise InvalidArgument(f"{name} must be a 1-D tensor [M], got {shape}")
    if kl_logps.shape != ref_kl_logps.shape:
        raise InvalidArgument(f"ref_kl_logps has shape {tuple(ref_kl_logps.shape)}, expected "
                              f"{tuple(kl_logps.shape)} (kl_logps' shape)")
    dtype = torch.promote_types(kl_logps.dtype, torch.float32)
    if kl_logps.numel() == 0:
        return kl_logps.new_zeros((), dtype=dtype)
    gap = kl_logps.detach().to(dtype) - ref_kl_logps.detach().to(dtype)
    return gap.mean().clamp(min=0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    reference_point: Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOLoss:
    """Per-example KTO loss (equation: the module docstring).

    Args:
        logps: [N] summed log π(y|x) over each example's completion tokens.
        ref_logps: [N] the same under the frozen reference; detached here.
        desirable: [N] bool, True for a desirable completion.
        reference_point: z_ref ≥ 0 (:func:`kto_reference_point`), a number or a 0-d tensor;
            detached here.
        beta: β > 0.
        desirable_weight, undesirable_weight: λ_D, λ_U > 0.

    Returns:
        ``KTOLoss(loss [N], rewards [N], desirable [N], reference_point [])`` in logps' dtype
        promoted to at least fp32.  ``kto_accuracy(out, beta)`` gives the per-example accuracy.

    Example:
        >>> out = kto_loss(torch.tensor([-10.0, -4.0]), torch.tensor([-11.0, -4.0]),
        ...                torch.tensor([True, False]), 0.0, beta=0.1)
        >>> out.loss.shape
        torch.Size([2])
    """
    check_number("beta", beta, beta > 0, "> 0")
    check_number("desirable_weight", desirable_weight, desirable_weight > 0, "> 0")
    check_number("undesirable_weight", undesirable_weight, undesirable_weight > 0, "> 0")
    if not isinstance(logps, Tensor) or logps.dim() != 1:
        shape = tuple(logps.shape) if isinstance(logps, Tensor) else type(logps).__name__
        raise InvalidArgument(f"logps must be a 1-D tensor [N] (one entry per example), got {shape}")
    for name, t in (("ref_logps", ref_logps), ("desirable", desirable)):
        if not isinstance(t, Tensor) or t.shape != logps.shape:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise InvalidArgument(f"{name} has shape {shape}, expected {tuple(logps.shape)} (logps' shape)")
    if desirable.dtype != torch.bool:
        raise InvalidArgument(f"desirable must be a bool tensor, got {desirable.dtype}")
    dtype = torch.promote_types(logps.dtype, torch.float32)
    z = torch.as_tensor(reference_point, dtype=dtype, device=logps.device).detach()
    if z.dim() != 0 or not bool(torch.isfinite(z)) or bool(z < 0):
        raise InvalidArgument(f"reference_point must be a finite number >= 0 (a 0-d tensor), got {reference_point!r}")
    r = logps.to(dtype) - ref_logps.detach().to(dtype)
    # the weights are made in the loss's dtype (a Python float in torch.where would be fp32)
    lam_d, lam_u = (torch.tensor(w, dtype=dtype, device=logps.device) for w in (desirable_weight, undesirable_weight))
    sign = torch.where(desirable, 1.0, -1.0).to(dtype)
    weight = torch.where(desirable, lam_d, lam_u)
    loss = weight * (1 - torch.sigmoid(beta * sign * (r - z)))
    return KTOLoss(loss, beta * r.detach(), desirable, z)


def kto_accuracy(out: KTOLoss, beta: float) -> Tensor:
    """Per example: 1.0 where the reward β·r is on the label's side of β·z_ref (above it for a
    desirable completion, below for an undesirable one), 0.5 on it, else 0.0 — the examples the
    loss already ranks the right way round."""
    sign = torch.where(out.desirable, 1.0, -1.0).to(out.rewards.dtype)
    gap = sign * (out.rewards - beta * out.reference_point.to(out.rewards.dtype))
    return (gap > 0).to(gap.dtype) + 0.5 * (gap == 0).to(gap.dtype)


def kto_weight_ratio(desirable: int, undesirable: int, desirable_weight: float = 1.0,
                     undesirable_weight: float = 1.0) -> float:
    """λ_D·n_D / (λ_U·n_U), the quantity the paper recommends keeping in [1, 4/3]
    (:data:`RECOMMENDED_RATIO`); ``inf`` without undesirable examples."""
    if undesirable == 0:
        return float("inf")
    return desirable_weight * desirable / (undesirable_weight * undesirable)
