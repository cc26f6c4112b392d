"""Token-level distillation divergences between a student's and a teacher's output head.

With z_S = softcap(W_S h_S + b_S) and z_T = softcap(W_T h_T + b_T) the two heads' logits at a
token, τ the temperature, S = softmax(z_S/τ) and T = softmax(z_T/τ), the per-token losses are

==========  ==========================================================  ==========================
kind        per-token loss                                              reading
==========  ==========================================================  ==========================
forward_kl  KL(T‖S) = Σ_v T_v (log T_v − log S_v)                       mode-covering (SFT on T)
reverse_kl  KL(S‖T) = Σ_v S_v (log S_v − log T_v)                       mode-seeking
jsd         JSD(β) = β·KL(T‖M) + (1−β)·KL(S‖M),  M = β·T + (1−β)·S      between the two, β∈(0,1)
==========  ==========================================================  ==========================

JSD(β) is the generalized Jensen-Shannon divergence of GKD (Agarwal et al., "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv 2306.13649,
§3, with P = T the teacher and Q = S the student), the convention TRL's ``GKDTrainer`` also
uses.  It is bounded by log 2 for β = ½ (the usual JSD) and interpolates the KLs:

    JSD(β) / β      → KL(T‖S)   as β → 0   (M → S; the (1−β)·KL(S‖M) term is O(β²))
    JSD(β) / (1−β)  → KL(S‖T)   as β → 1   (M → T; the β·KL(T‖M) term is O((1−β)²))

and JSD_β(T, S) = JSD_{1−β}(S, T), so JSD(½) is symmetric in the two heads.  No τ² factor
is applied (as GKD and TRL; Hinton's τ² rescaling is the caller's choice).

Gradients go to the student only (the teacher's inputs are detached).  With u = z_S/τ the
student's logit gradient of one token's loss is

    forward_kl:  (S − T) / τ
    reverse_kl:  S ⊙ (log S − log T − KL(S‖T)) / τ
    jsd:         (1−β) · S ⊙ (log S − log M − KL(S‖M)) / τ      (∂JSD/∂S_v = (1−β) log(S_v/M_v))

times the softcap derivative 1 − (z_S/s)².  Like the chunked cross-entropy (docs/techniques/chunked_ce.md), the forward
walks the masked rows in chunks, builds both heads' fp32 logits for the chunk only (never
[N, V] of either model beyond one chunk), and forms the chunk's gradients at once (grad_h for
its rows, its share of grad_W); backward only scales them.  Pure: no I/O, no process groups.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from pgs.errors import InvalidArgument
from pgs.func.losses.chunked import chunk_logits
from pgs.func.losses.head import add_chunk_head_grads, check_options, compute_dtype
from pgs.func.losses.preference import check_number

DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd")


class DistillLoss(NamedTuple):
    """Summed statistics of one micro-batch of a distillation loss.

    Attributes:
        loss_sum: 0-d, differentiable in the student's inputs: Σ over masked tokens of the
            per-token divergence.
        num_tokens: 0-d int64: the number of masked tokens.
    """

    loss_sum: Tensor
    num_tokens: Tensor


def _xlogy_diff(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """Σ_v p_v (log p_v − log q_v) per row, with 0·log 0 = 0 (a p_v that underflowed)."""
    term = torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device))
    return term.sum(-1)


def _chunk_loss_and_grad(zs: Tensor, zt: Tensor, kind: str, beta: float, tau: float, need_grad: bool):
    """Per-row losses [c] and, if asked, the gradient w.r.t. the student's logits zs [c, V]."""
    log_s = torch.log_softmax(zs / tau, dim=-1)
    log_t = torch.log_softmax(zt / tau, dim=-1)
    s, t = log_s.exp(), log_t.exp()
    grad = None
    if kind == "forward_kl":
        loss = _xlogy_diff(t, log_t, log_s)
        if need_grad:
            grad = (s - t).div_(tau)
    elif kind == "reverse_kl":
        loss = _xlogy_diff(s, log_s, log_t)
        if need_grad:
            grad = s * (log_s - log_t - loss[:, None]).div_(tau)
            grad = torch.where(s > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    else:  # jsd
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
        kl_sm = _xlogy_diff(s, log_s, log_m)
        loss = beta * _xlogy_diff(t, log_t, log_m) + (1 - beta) * kl_sm
        if need_grad:
            grad = s * (log_s - log_m - kl_sm[:, None]).mul_((1 - beta) / tau)
            grad = torch.where(s > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return loss, grad


class _DistillLoss(torch.autograd.Function):
    """``apply(h_s [N, D], W_s [V, D], b_s | None, h_t [N, Dt], W_t [V, Dt], b_t | None, rows [M],
    opts)`` → loss_sum (0-d, compute dtype).  Gradients for h_s, W_s, b_s are formed in forward."""

    @staticmethod
    def forward(ctx, hs, Ws, bs, ht, Wt, bt, rows, opts):
        kind, beta, tau, chunk, cap_s, cap_t, grad_on = opts
        # needs_input_grad is set under torch.no_grad too: the caller's grad mode decides
        need_h, need_w, need_b = (grad_on and n for n in ctx.needs_input_grad[:3])
        need = need_h or need_w or need_b
        cdtype = compute_dtype(hs)
        total = torch.zeros((), dtype=cdtype, device=hs.device)
        grad_h = torch.zeros_like(hs) if need_h else None
        grad_w = torch.zeros_like(Ws) if need_w else None
        grad_b = torch.zeros(Ws.shape[0], dtype=cdtype, device=Ws.device) if need_b else None
        with torch.no_grad():
            for start in range(0, rows.numel(), chunk):
                r = rows[start : start + chunk]
                hc = hs.index_select(0, r)
                zs = chunk_logits(hc, Ws, bs, cap_s)
                zt = chunk_logits(ht.index_select(0, r), Wt, bt, cap_t).to(zs.dtype)
                loss, g = _chunk_loss_and_grad(zs, zt, kind, beta, tau, need)
                total += loss.sum()
                del zt
                if not need:
                    continue
                if cap_s is not None:
                    g.mul_(zs.div_(cap_s).square_().neg_().add_(1))  # d softcap(x)/dx = 1 − tanh²
                del zs
                if need_b:
                    grad_b += g.sum(0)
                g_low = g.to(Ws.dtype)
                del g
                add_chunk_head_grads(g_low, hc, Ws, r, grad_h, grad_w)
        ctx.grads = (grad_h, grad_w, None if grad_b is None else grad_b.to(bs.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("distill_loss: backward ran twice on one forward (its gradients are scaled in place)")
        grads, ctx.grads = ctx.grads, None
        out = [None if g is None else g.mul_(grad_out.to(g.dtype)) for g in grads]
        return out[0], out[1], out[2], None, None, None, None, None


def distill_loss(
    student_h: Tensor,
    student_W: Tensor,
    teacher_h: Tensor,
    teacher_W: Tensor,
    mask: Tensor,
    *,
    kind: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> DistillLoss:
    """Σ over masked tokens of the student–teacher divergence ``kind`` (the module docstring).

    Both heads' logits exist for ``chunk_size`` masked rows at a time only.  The student's
    gradient (to ``student_h``, ``student_W``, ``student_bias``) is computed chunk by chunk in
    the forward pass and scaled in backward (one backward per forward); the teacher's inputs
    get none.  Equal to the dense formula on the full logits up to fp32 summation order.

    Args:
        student_h: the student's final hidden states [B, S, D] (or [N, D]).
        student_W: the student's LM head [V, D].
        teacher_h: the teacher's final hidden states [B, S, Dt] at the same positions.
        teacher_W: the teacher's LM head [V, Dt] (the same vocabulary V).
        mask: [B, S] (or [N]) bool: the tokens the loss covers (completion tokens, where
            ``h[i]`` predicts the next completion token).
        kind: ``forward_kl`` (KL(T‖S)), ``reverse_kl`` (KL(S‖T)) or ``jsd`` (JSD(β)).
        beta: β ∈ (0, 1), jsd only (the teacher's weight in the mixture M).
        temperature: τ > 0, applied to both heads' logits.
        chunk_size: masked rows per chunk.
        student_bias, teacher_bias: optional head biases [V].
        student_softcap, teacher_softcap: s in z ← s·tanh(z/s), or None.

    Returns:
        ``DistillLoss(loss_sum, num_tokens)``: loss_sum fp32 (fp64 for fp64 student_h).

    Example:
        >>> hs, ht = torch.randn(2, 5, 4), torch.randn(2, 5, 6)
        >>> Ws, Wt = torch.randn(11, 4), torch.randn(11, 6)
        >>> mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
        >>> out = distill_loss(hs, Ws, ht, Wt, mask, kind="jsd", beta=0.5)
        >>> int(out.num_tokens), bool(0 <= out.loss_sum <= 6 * math.log(2))
        (6, True)
    """
    if kind not in DISTILL_KINDS:
        raise InvalidArgument(f"kind: unknown distillation loss {kind!r}; expected one of {list(DISTILL_KINDS)}")
    if kind == "jsd":
        check_number("beta", beta, 0 < beta < 1,
                     "in (0, 1) for kind='jsd' (use forward_kl / reverse_kl for the limits)")
    check_number("temperature", temperature, temperature > 0, "> 0")
    check_options(student_softcap, 0.0, chunk_size)
    check_options(teacher_softcap, 0.0)
    for name, W in (("student_W", student_W), ("teacher_W", teacher_W)):
        if not isinstance(W, Tensor) or W.dim() != 2:
            raise InvalidArgument(f"{name} must be a [V, D] tensor, got {getattr(W, 'shape', type(W).__name__)}")
    if student_W.shape[0] != teacher_W.shape[0]:
        raise InvalidArgument(
            f"vocabulary mismatch: student_W has {student_W.shape[0]} rows, teacher_W {teacher_W.shape[0]} "
            "(distillation needs one shared vocabulary)"
        )
    for name, h, W in (("student_h", student_h, student_W), ("teacher_h", teacher_h, teacher_W)):
        if h.shape[-1] != W.shape[1]:
            raise InvalidArgument(f"{name} is {tuple(h.shape)} but its head is {tuple(W.shape)} (hidden size differs)")
    if teacher_h.shape[:-1] != student_h.shape[:-1]:
        raise InvalidArgument(
            f"teacher_h has positions {tuple(teacher_h.shape[:-1])}, student_h {tuple(student_h.shape[:-1])} "
            "(the teacher must score the same tokens)"
        )
    if not isinstance(mask, Tensor) or mask.shape != student_h.shape[:-1]:
        raise InvalidArgument(
            f"mask must have shape {tuple(student_h.shape[:-1])} (student_h without its last dim), "
            f"got {tuple(getattr(mask, 'shape', ()))}"
        )
    for name, b, W in (("student_bias", student_bias, student_W), ("teacher_bias", teacher_bias, teacher_W)):
        if b is not None and b.shape != W.shape[:1]:
            raise InvalidArgument(f"{name} must be [V] = [{W.shape[0]}], got {tuple(b.shape)}")
    hs = student_h.reshape(-1, student_h.shape[-1])
    ht = teacher_h.detach().reshape(-1, teacher_h.shape[-1])
    rows = mask.reshape(-1).to(torch.bool).nonzero().squeeze(1)
    num = torch.tensor(rows.numel(), dtype=torch.int64, device=hs.device)
    opts = (kind, float(beta), float(temperature), int(chunk_size), student_softcap, teacher_softcap,
            torch.is_grad_enabled())
    tb = None if teacher_bias is None else teacher_bias.detach()
    loss = _DistillLoss.apply(hs, student_W, student_bias, ht, teacher_W.detach(), tb, rows, opts)
    return DistillLoss(loss, num)
