"""Per-sequence summed log-probabilities of the labels, without [N, V] logits.

    logp_sum[s] = Σ_{i : seq_i = s, y_i ≠ −100} log softmax(z_i)[y_i],   z_i = softcap(W h_i + b)
    lengths[s]  = |{i : seq_i = s, y_i ≠ −100}|

The input to preference losses (``preference_loss``; DPO, Rafailov et al., arXiv 2305.18290):
chosen and rejected arms of a pair are two isolated documents of one packed row, told apart by
``seq_ids``.  Labels follow ``token_loss``'s convention: ``labels[i]`` is the target predicted
*from* ``h[i]`` (already shifted by the caller), −100 for a token that is not a completion token.

The loss is a nonlinear function of the per-sequence sums, so the logit gradient of token i,

    ∂L/∂z_i = w_{seq_i}·(e_{y_i} − p_i) = gate_i·(p_i − e_{y_i}),   w = ∂L/∂logp_sum,  gate_i = −w_{seq_i}

(times the softcap derivative 1 − (z/s)²), is only known in backward; unlike the chunked token
loss (whose gradient is fixed up to one scalar and computed in the forward), backward here
rebuilds each chunk's logits from the saved rows and their log-sum-exps.  It is the chunked
loss's G with gate_i = −w_{seq_i}, z-loss 0 and scale 1, so it is built by the same code: the
Triton passes of ``triton_ce`` on CUDA (the chunk's logits in W's dtype, LSE and log p_y by
``row_stats`` in forward, overwritten in place by G with ``grad_in_place`` in backward; the
torch path elsewhere, and for a bias gradient) and ``chunked.logit_grad`` otherwise.
Cost: one head matmul per chunk in forward, three in backward (logits, grad_h, grad_W); extra
memory one chunk's logits (chunk·V in W's dtype with the Triton passes; fp32 logits and
softmax, 8 B per element, on the torch path), grad_h [N, D] and grad_W [V, D], and one LSE per
valid row kept from forward to backward.

Deferred head gradient (``memory.defer_head_grad``, a ``pf.MemoryOptions``).  With a tied head (the input embedding's
weight) stepped by gradient release, a dense grad_W [V, D] handed to autograd at the start of
backward lives through the whole backward (0.72 GiB at Qwen3-4B) and defeats ``tied_slabs``
(whose point is that no V×D gradient exists).  Deferred, backward computes grad_h (and the
bias's gradient) and gives W no gradient; it saves the valid rows, their gates −w_{seq_i} and
LSEs into a ``chunked.DeferredHeadGrad`` (scale 1), whose ``add_to(out)`` adds
Σ_k Gₖᵀ H_k into a [V, D] buffer and ``add_rows_to(out, r0, r1)`` only vocabulary rows
[r0, r1) — the same object, and the same rebuild, as the token loss's deferred head gradient
(``GradientRelease.before_step`` takes it).  Unlike the token loss it is filled in backward
(the gates need w): ``head_grad.ready`` turns True when backward has passed the loss.  Cost:
one more head matmul per chunk (backward: logits, grad_h; the rebuild: logits, grad_W), and
16 B per valid row (index, gate, LSE) plus h held until the rebuild, instead of grad_W.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from pgs.errors import InvalidArgument
from pgs.func.losses.chunked import DeferredHeadGrad, chunk_logits, logit_grad, _Plan, _use_kernels
from pgs.func.losses.head import add_chunk_head_grads, check_options, compute_dtype, flatten_inputs
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions, memory_options


class _SequenceLogps(torch.autograd.Function):
    """``apply(h [N, D], W [V, D], bias [V] | None, labels [N], seq [N], rows [M], num, plan, deferred)``
    → logp_sum [num] (compute dtype); ``rows``: the valid rows, ``seq`` their sequence ids by row;
    ``plan``: a ``chunked._Plan`` (chunk size, softcap, z-loss 0, which gradients); ``deferred``:
    a ``DeferredHeadGrad`` that backward fills instead of giving W a gradient, or None."""

    @staticmethod
    def forward(ctx, h, W, bias, labels, seq, rows, num, plan, deferred):
        cdtype = compute_dtype(h)
        out = torch.zeros(num, dtype=cdtype, device=h.device)
        lses = torch.empty(rows.numel(), dtype=cdtype, device=h.device)
        kernels = _use_kernels(h, W, plan, None)
        with torch.no_grad():
            for start in range(0, rows.numel(), plan.chunk_size):
                r = rows[start : start + plan.chunk_size]
                hc, y = h.index_select(0, r), labels.index_select(0, r)
                if kernels:  # the chunk's logits in W's dtype, the row statistics in fp32
                    from pgs.func.losses import triton_ce

                    lse, _, _, logp = triton_ce.row_stats(hc @ W.t(), y, bias, plan.softcap)
                else:
                    z = chunk_logits(hc, W, bias, plan.softcap)
                    lse = torch.logsumexp(z, dim=-1)
                    logp = z.gather(1, y[:, None]).squeeze(1) - lse
                    del z
                out.index_add_(0, seq.index_select(0, r), logp.to(cdtype))
                lses[start : start + r.numel()] = lse
        ctx.save_for_backward(h, W, bias, labels, seq, rows, lses)
        ctx.plan, ctx.deferred = plan, deferred
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        h, W, bias, labels, seq, rows, lses = ctx.saved_tensors
        plan, deferred = ctx.plan, ctx.deferred
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdtype = compute_dtype(h)
        # gate_i = −∂L/∂logp_sum of each valid row's sequence: G = gate·(p − e_y), as chunked's
        gates = grad_out.detach().index_select(0, seq.index_select(0, rows)).to(cdtype).neg_()
        if need_w and deferred is not None:  # W's share is rebuilt later, by whoever holds ``deferred``
            deferred.save(h, W, bias, labels, rows, gates, lses, plan)
            deferred.scale = torch.ones((), dtype=cdtype, device=h.device)
            need_w = False
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros_like(W) if need_w else None  # W's dtype, as the chunked token loss
        grad_b = torch.zeros(W.shape[0], dtype=cdtype, device=W.device) if need_b else None
        if not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None, None
        kernels = not need_b and _use_kernels(h, W, plan, grad_w)
        for start in range(0, rows.numel(), plan.chunk_size):
            r = rows[start : start + plan.chunk_size]
            hc, y = h.index_select(0, r), labels.index_select(0, r)
            gate, lse = gates[start : start + r.numel()], lses[start : start + r.numel()]
            if kernels:  # W's dtype, in place: coef = gate (no z-loss)
                from pgs.func.losses import triton_ce

                g_low = triton_ce.grad_in_place(hc @ W.t(), y, bias, plan.softcap, lse, gate, gate)
            else:
                g = logit_grad(chunk_logits(hc, W, bias, plan.softcap), lse, y, gate, plan)
                if need_b:
                    grad_b += g.sum(0)
                g_low = g.to(W.dtype)
                del g
            add_chunk_head_grads(g_low, hc, W, r, grad_h, grad_w)
            del g_low
        return (
            grad_h,
            grad_w,
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None, None, None,
        )


def sequence_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    seq_ids: Tensor,
    num_sequences: int,
    *,
    chunk_size: int = 2048,
    bias: Tensor | None = None,
    softcap: float | None = None,
    memory: MemoryOptions = NO_MEMORY_OPTIONS,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, DeferredHeadGrad | None]:
    """Summed log p(label) per sequence over its completion tokens, chunked over rows.

    ``logp_sum[s] = Σ_{i: seq_ids_i = s, labels_i ≠ −100} (z_{i,y_i} − LSE(z_i))`` with
    z_i = softcap(W h_i + b) in fp32, and ``lengths[s]`` the number of those tokens.  Never
    more than ``chunk_size`` rows of logits exist; equal to log_softmax of the full logits,
    gathered and scatter-added by sequence id, up to fp32 summation order (forward and
    backward).  Gradients flow to ``hidden``, ``weight`` and ``bias``; one backward per
    forward (no double backward).  The logit gradient is ∂L/∂z_i = −w_{seq_i}·(p_i − e_{y_i})
    with w = ∂L/∂logp_sum (the module docstring).

    Args:
        hidden: final hidden states [B, S, D] or [N, D].
        weight: the LM head [V, D].
        labels: [B, S] (or [N]) targets aligned with ``hidden`` as ``token_loss`` expects
            (``labels[i]`` is predicted from ``hidden[i]``); −100 = not a completion token.
        seq_ids: [B, S] (or [N]) integer: which sequence each token belongs to, in
            [0, num_sequences), or −1 for none (such tokens are not counted).
        num_sequences: the number of sequences (the outputs' length).
        chunk_size: rows of logits per chunk.
        bias: optional head bias [V].  softcap: s in z ← s·tanh(z/s), or None.
        memory: a ``pf.MemoryOptions``; with ``defer_head_grad`` autograd gives ``weight`` no
            gradient; backward fills the returned ``head_grad`` instead, whose ``add_to(out)`` /
            ``add_rows_to(out, r0, r1)`` add Σ_k Gₖᵀ H_k (all rows / rows [r0, r1) of the
            vocabulary) once backward has passed this function (``head_grad.ready``);
            ``discard()`` drops it.  How a tied head's gradient joins the embedding's under
            gradient release (``GradientRelease.before_step``, docs/memory.md).

    Returns:
        ``(logp_sum [num_sequences] fp32 (fp64 for fp64 hidden), lengths [num_sequences] int64)``,
        and with ``memory.defer_head_grad`` a third element ``head_grad``: a ``DeferredHeadGrad``,
        or None where ``weight`` gets no gradient anyway (frozen, or grad mode off).

    Example:
        >>> h, W = torch.randn(1, 6, 4), torch.randn(9, 4)
        >>> labels = torch.tensor([[-100, 3, 5, -100, 2, -100]])
        >>> seq = torch.tensor([[0, 0, 0, 1, 1, 1]])
        >>> logp, n = sequence_logps(h, W, labels, seq, 2)
        >>> n.tolist()
        [2, 1]
        >>> W.requires_grad_(True)  # doctest: +ELLIPSIS
        tensor(...)
        >>> from pgs.func import MemoryOptions
        >>> logp, n, head = sequence_logps(h, W, labels, seq, 2, memory=MemoryOptions(defer_head_grad=True))
        >>> logp.sum().backward()
        >>> W.grad is None, head.ready
        (True, True)
        >>> grad = head.add_to(torch.zeros_like(W))  # = the W.grad without deferring
    """
    check_options(softcap, 0.0, chunk_size)
    if isinstance(num_sequences, bool) or int(num_sequences) != num_sequences or num_sequences < 0:
        raise InvalidArgument(f"num_sequences must be a non-negative integer, got {num_sequences!r}")
    num_sequences = int(num_sequences)
    if not isinstance(seq_ids, Tensor) or seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
        raise InvalidArgument(f"seq_ids must be an integer tensor, got {getattr(seq_ids, 'dtype', type(seq_ids))}")
    h, y, extra = flatten_inputs(hidden, weight, labels, bias, seq_ids=seq_ids)
    seq = extra["seq_ids"].long()
    valid = (y != -100) & (seq >= 0)
    rows = valid.nonzero().squeeze(1)
    seq_valid = seq.index_select(0, rows)
    if rows.numel():
        top = int(seq_valid.max())
        if top >= num_sequences:
            raise InvalidArgument(f"seq_ids: a completion token has sequence id {top}, "
                                  f"but num_sequences={num_sequences}")
        y_valid = y.index_select(0, rows)
        lo, hi = int(y_valid.min()), int(y_valid.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise InvalidArgument(f"labels: ids must be in [0, {weight.shape[0]}) or -100, got {lo if lo < 0 else hi}")
    lengths = torch.bincount(seq_valid, minlength=num_sequences)[:num_sequences]
    grad_on = torch.is_grad_enabled()
    plan = _Plan(None, None, -100, softcap, 0.0, int(chunk_size), None,
                 need_h=grad_on and h.requires_grad, need_w=grad_on and weight.requires_grad,
                 need_b=grad_on and bias is not None and bias.requires_grad, scale_in_place=False)
    deferring = memory_options(memory, "sequence_logps").defer_head_grad
    deferred = DeferredHeadGrad() if deferring and plan.need_w else None
    logp = _SequenceLogps.apply(h, weight, bias, y.long(), seq, rows, num_sequences, plan, deferred)
    if deferring:
        return logp, lengths, deferred
    return logp, lengths
