"""Chunked backend: token losses without ever holding the [N, V] logits (C6).

Forward walks the *valid* rows in chunks of ``chunk_size``.  For each chunk it builds the
fp32 logits z_k = softcap(H_k Wᵀ + b), the softmax, the token losses and statistics, and
at once the logit gradient

    ∂ℓ_i/∂z_i = g_i (p_i − e_{y_i}) + 2·z_loss·LSE_i·p_i        (g_i: the objective's gate)

times the softcap derivative 1 − (z/s)²; from it grad_h for the chunk's rows and the
chunk's share of grad_W = Σ_k Gₖᵀ H_k, added into one [V, D] buffer owned by the function.
Backward only scales those buffers by the incoming gradient, in place, and hands them to
autograd, so no second head-gradient buffer ever exists (a per-chunk
``torch.utils.checkpoint`` design holds two).  Peak extra memory: O(chunk · V) for the
chunk plus grad_h [N, D] and grad_W [V, D].

Masked rows are dropped before chunking (one host sync for the count), so prompt tokens cost
nothing and a fully masked chunk never exists.  Gradients equal the dense backend's up to
floating-point summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pgs.func.losses.head import check_options, compute_dtype, flatten_inputs
from pgs.func.losses.objectives import CE, TokenObjective, TokenInputs, resolve_objective
from pgs.func.losses.result import TokenLossResult


class _Plan:
    """Everything the autograd function needs besides the differentiable tensors."""

    def __init__(self, objective, inputs, ignore_index, softcap, z_loss, chunk_size,
                 accum_dtype, need_h, need_w, need_b, scale_in_place):
        self.objective = objective
        self.inputs = inputs
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.z_loss = z_loss
        self.chunk_size = int(chunk_size)
        self.accum_dtype = accum_dtype
        self.need_h, self.need_w, self.need_b = need_h, need_w, need_b
        self.scale_in_place = scale_in_place


class ChunkedTokenLoss(torch.autograd.Function):
    """Σ_{i∈M} ℓ_i with gradients computed chunk by chunk during the forward pass.

    ``apply(h [N,D], W [V,D], bias [V] | None, labels [N], plan)`` returns
    ``(loss_sum, entropy_sum, target_prob_sum, z_loss_sum)``; only ``loss_sum`` is
    differentiable.  With ``plan.scale_in_place`` (the default of the public functions)
    backward scales the stored gradients in place and may run only once per forward.
    """

    @staticmethod
    def forward(ctx, h, W, bias, labels, plan):
        stats, grads = _forward_and_grads(h, W, bias, labels, plan)
        ctx.grads = grads
        ctx.scale_in_place = plan.scale_in_place
        ctx.mark_non_differentiable(*stats[1:])
        return stats

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if ctx.grads is None:
            raise RuntimeError(
                "chunked loss: backward ran twice on one forward; its gradients are computed "
                "in the forward pass and scaled in place, so retain_graph is not supported"
            )
        grads = ctx.grads
        ctx.grads = None if ctx.scale_in_place else grads  # drop our reference: autograd may steal
        out = []
        for g in grads:
            if g is None:
                out.append(None)
            elif ctx.scale_in_place:
                out.append(g.mul_(grad_loss.to(g.dtype)))
            else:
                out.append(g * grad_loss.to(g.dtype))
        del grads
        return out[0], out[1], out[2], None, None


def _chunk_logits(hc: Tensor, W: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """``head_logits`` without its temporaries: the epilogue runs in place (no autograd here)."""
    z = (hc @ W.t()).to(compute_dtype(hc))
    if bias is not None:
        z.add_(bias)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _forward_and_grads(h, W, bias, labels, plan: _Plan):
    cdtype = compute_dtype(h)
    V, D = W.shape
    rows_all = (labels != plan.ignore_index).nonzero().squeeze(1)
    grad_h = torch.zeros_like(h) if plan.need_h else None
    grad_w = torch.zeros(V, D, dtype=plan.accum_dtype or W.dtype, device=W.device) if plan.need_w else None
    grad_b = torch.zeros(V, dtype=cdtype, device=W.device) if plan.need_b else None
    sums = torch.zeros(4, dtype=cdtype, device=h.device)  # loss, entropy, p_y, LSE²
    obj = plan.objective
    for start in range(0, rows_all.numel(), plan.chunk_size):
        rows = rows_all[start : start + plan.chunk_size]
        hc = h.index_select(0, rows)
        y = labels.index_select(0, rows)
        z = _chunk_logits(hc, W, bias, plan.softcap)
        lse = torch.logsumexp(z, dim=-1)
        logp_y = z.gather(1, y[:, None]).squeeze(1) - lse
        p = (z - lse[:, None]).exp_()
        entropy = lse - torch.linalg.vecdot(p, z)
        collision = torch.linalg.vecdot(p, p) if obj.needs_collision else None
        loss, gate = obj.terms(logp_y, collision, plan.inputs.rows(rows))
        if plan.z_loss:
            loss = loss + plan.z_loss * lse.square()
        sums += torch.stack([loss.sum(), entropy.sum(), logp_y.exp().sum(), lse.square().sum()])
        if not (plan.need_h or plan.need_w or plan.need_b):
            continue
        # G = (g + 2 z_loss LSE) p − g e_y, built in place in p's storage.
        g = p.mul_((gate + 2 * plan.z_loss * lse)[:, None])
        g[torch.arange(rows.numel(), device=g.device), y] -= gate
        if plan.softcap is not None:
            g.mul_(z.div_(plan.softcap).square_().neg_().add_(1))  # dz/dz_raw = 1 − tanh²
        del z
        if plan.need_b:
            grad_b += g.sum(0)
        g_low = g.to(W.dtype)
        if plan.need_h:
            grad_h.index_copy_(0, rows, (g_low @ W).to(h.dtype))
        if plan.need_w:
            if grad_w.dtype == W.dtype:
                grad_w.addmm_(g_low.t(), hc.to(W.dtype))
            else:
                grad_w.addmm_(g.to(grad_w.dtype).t(), hc.to(grad_w.dtype))
    # Separate tensors (not views of ``sums``): autograd outputs must not alias each other.
    stats = (sums[0].clone(), *(s.float().clone() for s in sums[1:].unbind()))
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return stats, (grad_h, grad_w, grad_b)


def target_logprobs(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> Tensor:
    """log p_{i,y} for every token (0 at ignored ones), detached, in O(chunk · V) memory.

    fp32 (fp64 for fp64 h).

    The pre-pass for objectives that need a statistic of the whole call before any gradient
    (Cayley's p̄, CADFT's sample likelihoods); also how a runtime scores targets with a frozen
    reference model for InfoSFT's ``q_source="reference"``.
    """
    check_options(softcap, 0.0, chunk_size)
    shape = labels.shape
    h, labels, _ = flatten_inputs(h, W, labels, bias)
    out = torch.zeros(labels.shape, dtype=compute_dtype(h), device=h.device)
    rows_all = (labels != ignore_index).nonzero().squeeze(1)
    with torch.no_grad():
        for start in range(0, rows_all.numel(), chunk_size):
            rows = rows_all[start : start + chunk_size]
            z = _chunk_logits(h.index_select(0, rows), W, bias, softcap)
            y = labels.index_select(0, rows)
            logp = z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
            out.index_copy_(0, rows, logp)
    return out.reshape(shape)


def chunked_token_loss(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    objective: str | TokenObjective = "ce",
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype | None = None,
    p_bar: Tensor | float | None = None,
    ref_logprobs: Tensor | None = None,
    doc_ids: Tensor | None = None,
    compat: Tensor | None = None,
    _scale_in_place: bool = True,
) -> TokenLossResult:
    """Σ_{i∈M} ℓ_i for any objective in O(chunk_size · V) extra memory (C6).

    Arguments as ``token_loss``; ``accum_dtype`` is the dtype of the grad_W buffer (default
    W's dtype, as Liger does; ``torch.float32`` trades V·D·2 more bytes for exact accumulation
    of bf16 chunks).
    """
    check_options(softcap, z_loss, chunk_size)
    obj = resolve_objective(objective)
    h, labels, extra = flatten_inputs(
        h, W, labels, bias, ref_logprobs=ref_logprobs, doc_ids=doc_ids, compat=compat
    )
    valid = labels != ignore_index

    def prepass() -> Tensor:
        return target_logprobs(
            h, W, labels, bias=bias, softcap=softcap, ignore_index=ignore_index, chunk_size=chunk_size
        )

    inputs: TokenInputs = obj.prepare(
        prepass, valid, p_bar=p_bar, ref_logprobs=extra["ref_logprobs"],
        doc_ids=extra["doc_ids"], compat=extra["compat"],
    )
    grad_on = torch.is_grad_enabled()
    plan = _Plan(
        obj, inputs, ignore_index, softcap, z_loss, chunk_size, accum_dtype,
        need_h=grad_on and h.requires_grad,
        need_w=grad_on and W.requires_grad,
        need_b=grad_on and bias is not None and bias.requires_grad,
        scale_in_place=_scale_in_place,
    )
    loss_sum, entropy_sum, p_sum, lse_sq_sum = ChunkedTokenLoss.apply(h, W, bias, labels, plan)
    return TokenLossResult(
        loss_sum=loss_sum,
        num_valid=valid.sum(),
        entropy_sum=entropy_sum,
        target_prob_sum=p_sum,
        z_loss_sum=lse_sq_sum,
    )


def chunked_cross_entropy(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype | None = None,
) -> TokenLossResult:
    """Cross-entropy summed over valid tokens without materializing [N, V] logits (C6).

    L_sum = Σ_k Σ_{i∈chunk k} (LSE(z_i) − z_{i,y}),  z_k = (H_k Wᵀ + b) in fp32, softcapped;
    the runtime divides by the global |M|, never by a chunk's count.  Gradients are computed in
    the forward pass (one grad_W buffer), equal to ``cross_entropy``'s up to summation order.
    Chunking as in Liger's fused linear cross-entropy and torchtune's chunked CE; no paper.

    Example:
        >>> h = torch.randn(10, 8, requires_grad=True)
        >>> W = torch.randn(50, 8, requires_grad=True)
        >>> labels = torch.randint(0, 50, (10,))
        >>> r = chunked_cross_entropy(h, W, labels, chunk_size=4)
        >>> (r.loss_sum / r.num_valid).backward()
    """
    return chunked_token_loss(
        h, W, labels, objective=CE(), bias=bias, softcap=softcap, ignore_index=ignore_index,
        z_loss=z_loss, chunk_size=chunk_size, accum_dtype=accum_dtype,
    )
