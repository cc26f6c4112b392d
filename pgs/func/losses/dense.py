"""Dense reference backend: full [N, V] logits and autograd (the test oracle).

Memory is O(N·V) (fp32 logits plus softmax): use it for tests and small vocabularies, and
``chunked`` for training.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pgs.func.losses.head import check_options, flatten_inputs, head_logits
from pgs.func.losses.objectives import CE, TokenObjective, resolve_objective
from pgs.func.losses.result import TokenLossResult


def dense_token_loss(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    objective: str | TokenObjective = "ce",
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    p_bar: Tensor | float | None = None,
    ref_logprobs: Tensor | None = None,
    doc_ids: Tensor | None = None,
    compat: Tensor | None = None,
) -> TokenLossResult:
    """Σ_{i∈M} ℓ_i for any objective, from full logits; gradients by autograd.

    z_i = softcap(W h_i + b) in fp32, log p_{i,y} = z_{i,y} − LSE(z_i), ℓ_i = ψ_i(log p_{i,y})
    (see ``objectives``) plus ``z_loss · LSE(z_i)²``.  Arguments as ``token_loss``.
    """
    check_options(softcap, z_loss)
    obj = resolve_objective(objective)
    h, labels, extra = flatten_inputs(
        h, W, labels, bias, ref_logprobs=ref_logprobs, doc_ids=doc_ids, compat=compat
    )
    valid = labels != ignore_index
    z = head_logits(h, W, bias, softcap)[valid]
    y = labels[valid]
    lse = torch.logsumexp(z, dim=-1)
    logp_y = z.gather(1, y[:, None]).squeeze(1) - lse
    with torch.no_grad():
        p = torch.softmax(z, dim=-1)
        entropy = lse - (p * z).sum(-1)
        collision = (p * p).sum(-1) if obj.needs_collision else None

    def valid_logprobs() -> Tensor:
        full = torch.zeros(labels.shape, dtype=logp_y.dtype, device=logp_y.device)
        return full.masked_scatter(valid, logp_y.detach())

    inputs = obj.prepare(
        valid_logprobs, valid, p_bar=p_bar, ref_logprobs=extra["ref_logprobs"],
        doc_ids=extra["doc_ids"], compat=extra["compat"],
    )
    loss, _ = obj.terms(logp_y, collision, inputs.rows(valid.nonzero().squeeze(1)))
    if z_loss:
        loss = loss + z_loss * lse.square()
    return TokenLossResult(
        loss_sum=loss.sum(),
        num_valid=valid.sum(),
        entropy_sum=entropy.sum().float(),
        target_prob_sum=logp_y.detach().exp().sum().float(),
        z_loss_sum=lse.detach().square().sum().float(),
    )


def cross_entropy(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> TokenLossResult:
    """Dense reference cross-entropy, summed over valid tokens.

    ℓ_i = LSE(z_i) − z_{i,y},  z_i = s·tanh((W h_i + b)/s) in fp32; loss_sum = Σ_{i∈M} ℓ_i
    (+ z_loss · Σ LSE²).  Same maths as HF's loss with ``reduction="sum"``.

    Example:
        >>> h, W = torch.randn(6, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([1, 2, -100, 4, 5, -100])
        >>> r = cross_entropy(h, W, labels)
        >>> int(r.num_valid)
        4
    """
    return dense_token_loss(
        h, W, labels, objective=CE(), bias=bias, softcap=softcap,
        ignore_index=ignore_index, z_loss=z_loss,
    )
