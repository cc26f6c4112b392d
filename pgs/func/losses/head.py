"""The output head shared by every backend: shape checks, logits z = softcap(h Wᵀ + b), and a
chunk's head gradients from its logit gradient (the chunked token, sequence and distillation losses)."""

from __future__ import annotations

import torch
from torch import Tensor

from pgs.errors import InvalidArgument


def compute_dtype(h: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 hidden states, fp64 for fp64 (so gradcheck runs in fp64)."""
    return torch.promote_types(h.dtype, torch.float32)


def flatten_inputs(h: Tensor, W: Tensor, labels: Tensor, bias: Tensor | None, **per_token):
    """Check shapes and flatten ``h [..., D]`` to ``[N, D]`` and every per-token tensor to ``[N]``.

    Returns ``(h, labels, per_token)`` with ``per_token`` holding the flattened optional
    tensors (``None`` stays ``None``).
    """
    if W.dim() != 2:
        raise InvalidArgument(f"head weight W must be [V, D], got shape {tuple(W.shape)}")
    if h.shape[-1] != W.shape[1]:
        raise InvalidArgument(
            f"hidden size mismatch: h is {tuple(h.shape)} but W is {tuple(W.shape)} (expected h [..., {W.shape[1]}])"
        )
    if labels.shape != h.shape[:-1]:
        raise InvalidArgument(
            f"labels have shape {tuple(labels.shape)}, expected {tuple(h.shape[:-1])} (h without its last dim)"
        )
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise InvalidArgument(f"labels must be an integer tensor, got {labels.dtype}")
    if bias is not None and bias.shape != W.shape[:1]:
        raise InvalidArgument(f"bias must be [V] = [{W.shape[0]}], got {tuple(bias.shape)}")
    flat = {}
    for name, t in per_token.items():
        if t is not None and t.shape != labels.shape:
            raise InvalidArgument(
                f"{name} has shape {tuple(t.shape)}, expected the labels' shape {tuple(labels.shape)}"
            )
        flat[name] = None if t is None else t.reshape(-1)
    return h.reshape(-1, h.shape[-1]), labels.reshape(-1), flat


def check_options(softcap: float | None, z_loss: float, chunk_size: int | None = None) -> None:
    """Reject softcap ≤ 0, negative z-loss and non-positive chunk sizes with one clear line."""
    if softcap is not None and not softcap > 0:
        raise InvalidArgument(f"softcap must be > 0 or None, got {softcap}")
    if not z_loss >= 0:
        raise InvalidArgument(f"z_loss must be >= 0, got {z_loss}")
    if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
        raise InvalidArgument(f"chunk_size must be a positive integer, got {chunk_size}")


def head_logits(h: Tensor, W: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """z = s·tanh((h Wᵀ + b)/s) in the compute dtype (the matmul runs in h's dtype, then upcasts).

    Differentiable (the dense backend); the chunked backend has an in-place twin.
    """
    z = (h @ W.t()).to(compute_dtype(h))
    if bias is not None:
        z = z + bias.to(z.dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def add_chunk_head_grads(g: Tensor, hc: Tensor, W: Tensor, rows: Tensor | None, grad_h: Tensor | None,
                         grad_w: Tensor | None) -> None:
    """One chunk's share of the head's input and weight gradients, from its logit gradient
    G = ∂L/∂z [n, V] (docs/techniques/chunked_ce.md): ``grad_h[rows] = G W`` (written, not added: a row lies
    in one chunk; in grad_h's dtype) and ``grad_W += Gᵀ H_c`` with ``hc`` = H_c = h[rows].

    The products run in W's dtype, G rounded to it once.  A grad_W that accumulates in another
    dtype than W's (fp32 of a bf16 head) takes G and H_c in its own dtype instead.  ``None``
    skips a gradient.  A caller done with its compute-dtype G rounds it to W's dtype itself and
    drops it before the call, so that only the rounded copy is live during the products (the
    rounding here is then no copy)."""
    low = g.to(W.dtype) if grad_h is not None or (grad_w is not None and grad_w.dtype == W.dtype) else None
    if grad_h is not None:
        grad_h.index_copy_(0, rows, (low @ W).to(grad_h.dtype))
    if grad_w is not None:
        if grad_w.dtype == W.dtype:
            grad_w.addmm_(low.t(), hc.to(W.dtype))
        else:
            grad_w.addmm_(g.to(grad_w.dtype).t(), hc.to(grad_w.dtype))
