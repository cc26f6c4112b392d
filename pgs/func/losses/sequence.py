"""Per-sequence summed log-probabilities of the labels, without [N, V] logits.

    logp_sum[s] = Σ_{i : seq_i = s, y_i ≠ −100} log softmax(z_i)[y_i],   z_i = softcap(W h_i + b)
    lengths[s]  = |{i : seq_i = s, y_i ≠ −100}|

The input to preference losses (``preference_loss``): chosen and rejected arms of a pair are
two isolated documents of one packed row, told apart by ``seq_ids``.  Labels follow
``token_loss``'s convention: ``labels[i]`` is the target predicted *from* ``h[i]`` (already
shifted by the caller), −100 for a token that is not a completion token.

The loss is a nonlinear function of the per-sequence sums, so the logit gradient of token i,
w_{seq_i}·(e_{y_i} − p_i) with w = ∂L/∂logp_sum, is only known in backward; unlike the
chunked token loss (whose gradient is fixed up to one scalar and computed in the forward),
backward here rebuilds each chunk's logits from the saved rows and their log-sum-exps.
Cost: one head matmul per chunk in forward, three in backward (logits, grad_h, grad_W);
extra memory O(chunk·V) plus grad_h [N, D] and grad_W [V, D], and one LSE per valid row kept
from forward to backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from pgs.errors import InvalidArgument
from pgs.func.losses.chunked import _chunk_logits
from pgs.func.losses.head import check_options, compute_dtype, flatten_inputs


class _SequenceLogps(torch.autograd.Function):
    """``apply(h [N, D], W [V, D], bias [V] | None, labels [N], seq [N], rows [M], num, chunk, softcap)``
    → logp_sum [num] (compute dtype); ``rows``: the valid rows, ``seq`` their sequence ids by row."""

    @staticmethod
    def forward(ctx, h, W, bias, labels, seq, rows, num, chunk, softcap):
        cdtype = compute_dtype(h)
        out = torch.zeros(num, dtype=cdtype, device=h.device)
        lses = torch.empty(rows.numel(), dtype=cdtype, device=h.device)
        with torch.no_grad():
            for start in range(0, rows.numel(), chunk):
                r = rows[start : start + chunk]
                z = _chunk_logits(h.index_select(0, r), W, bias, softcap)
                lse = torch.logsumexp(z, dim=-1)
                logp = z.gather(1, labels.index_select(0, r)[:, None]).squeeze(1) - lse
                out.index_add_(0, seq.index_select(0, r), logp)
                lses[start : start + r.numel()] = lse
        ctx.save_for_backward(h, W, bias, labels, seq, rows, lses)
        ctx.chunk, ctx.softcap = chunk, softcap
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        h, W, bias, labels, seq, rows, lses = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h) if need_h else None
        cdtype = compute_dtype(h)
        grad_w = torch.zeros_like(W) if need_w else None  # W's dtype, as the chunked token loss
        grad_b = torch.zeros(W.shape[0], dtype=cdtype, device=W.device) if need_b else None
        for start in range(0, rows.numel(), ctx.chunk):
            r = rows[start : start + ctx.chunk]
            hc = h.index_select(0, r)
            z = _chunk_logits(hc, W, bias, ctx.softcap)
            w = grad_out.index_select(0, seq.index_select(0, r)).to(cdtype)  # ∂L/∂logp_sum of each row's sequence
            # G = w·(e_y − p) · softcap′, in p's storage
            g = (z - lses[start : start + r.numel(), None]).exp_().mul_(-w[:, None])
            g[torch.arange(r.numel(), device=g.device), labels.index_select(0, r)] += w
            if ctx.softcap is not None:
                g.mul_(z.div_(ctx.softcap).square_().neg_().add_(1))  # d softcap(x)/dx = 1 − tanh²
            del z
            if need_b:
                grad_b += g.sum(0)
            g_low = g.to(W.dtype)
            if need_h:
                grad_h.index_copy_(0, r, (g_low @ W).to(h.dtype))
            if need_w:
                grad_w.addmm_(g_low.t(), hc.to(W.dtype))
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
) -> tuple[Tensor, Tensor]:
    """Summed log p(label) per sequence over its completion tokens, chunked over rows.

    ``logp_sum[s] = Σ_{i: seq_ids_i = s, labels_i ≠ −100} (z_{i,y_i} − LSE(z_i))`` with
    z_i = softcap(W h_i + b) in fp32, and ``lengths[s]`` the number of those tokens.  Never
    more than ``chunk_size`` rows of logits exist; equal to log_softmax of the full logits,
    gathered and scatter-added by sequence id, up to fp32 summation order (forward and
    backward).  Gradients flow to ``hidden``, ``weight`` and ``bias``; one backward per
    forward (no double backward).

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

    Returns:
        ``(logp_sum [num_sequences] fp32 (fp64 for fp64 hidden), lengths [num_sequences] int64)``.

    Example:
        >>> h, W = torch.randn(1, 6, 4), torch.randn(9, 4)
        >>> labels = torch.tensor([[-100, 3, 5, -100, 2, -100]])
        >>> seq = torch.tensor([[0, 0, 0, 1, 1, 1]])
        >>> logp, n = sequence_logps(h, W, labels, seq, 2)
        >>> n.tolist()
        [2, 1]
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
            raise InvalidArgument(f"seq_ids: a completion token has sequence id {top}, but num_sequences={num_sequences}")
        y_valid = y.index_select(0, rows)
        lo, hi = int(y_valid.min()), int(y_valid.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise InvalidArgument(f"labels: ids must be in [0, {weight.shape[0]}) or -100, got {lo if lo < 0 else hi}")
    lengths = torch.bincount(seq_valid, minlength=num_sequences)[:num_sequences]
    logp = _SequenceLogps.apply(h, weight, bias, y.long(), seq, rows, num_sequences, int(chunk_size), softcap)
    return logp, lengths
