"""``token_loss``: one entry point that picks a backend and an objective by name."""

from __future__ import annotations

import torch
from torch import Tensor

from pgs.errors import InvalidArgument
from pgs.func.losses.chunked import chunked_token_loss
from pgs.func.losses.dense import dense_token_loss
from pgs.func.losses.peer_kernels import fused_cross_entropy
from pgs.func.losses.objectives import CE, TokenObjective, resolve_objective
from pgs.func.losses.result import TokenLossResult
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions, memory_options

BACKENDS = ("chunked", "dense", "liger", "cce")


def token_loss(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    backend: str = "chunked",
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
    stats: bool = True,
    memory: MemoryOptions = NO_MEMORY_OPTIONS,
) -> TokenLossResult:
    """Summed token loss of the output head ``z = softcap(h Wᵀ + b)`` against ``labels``.

    loss_sum = Σ_{i∈M} ℓ_i + z_loss · Σ_{i∈M} LSE(z_i)², with ℓ_i given by ``objective``
    (docs/techniques/README.md): ``"ce"``, ``"deft"``, ``"deft_cayley"``, ``"dft"``, ``"infosft"``,
    ``"cadft"``, ``"deformed_log"`` (fixed α), or an instance (``InfoSFT(p_bar=0.9,
    q_source="reference")``, ``DeformedLog(0.5)``, any ``TokenObjective``).  The
    caller divides by the global valid-token count.

    Args:
        h: final hidden states [..., D] (any float dtype).
        W: output-head weight [V, D].
        labels: target ids with the shape of ``h`` without its last dim; ``ignore_index`` masks.
        backend: ``"chunked"`` (default; O(chunk·V) memory), ``"dense"`` (reference),
            ``"liger"`` / ``"cce"`` (CUDA fused kernels, objective ``"ce"`` only).
        bias: optional head bias [V].  softcap: s in z ← s·tanh(z/s), or None.
        z_loss: coefficient of LSE² (chunked and dense only).
        chunk_size: rows per chunk (chunked backend, and the statistics pass of fused ones).
        accum_dtype: dtype of the chunked backend's grad_W buffer (default W's dtype).
        p_bar: Cayley's p̄ (default: this call's mean target probability, one pre-pass).
        ref_logprobs: InfoSFT ``q_source="reference"``: log q per token from a frozen model.
        doc_ids: CADFT: sample id per token.  compat: CADFT: explicit per-token c instead.
        stats: fused backends only: compute entropy / target-prob sums with a no-grad pass.
        memory: a ``pf.MemoryOptions``; with ``defer_head_grad`` (chunked backend only) W gets no
            gradient from autograd and the caller adds ``result.head_grad`` into W's gradient
            later (tied embeddings, docs/memory.md).

    Returns:
        ``TokenLossResult`` (sums and the valid count; all zero, never NaN, when all masked).
    """
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown loss backend {backend!r}; expected one of {list(BACKENDS)}")
    obj = resolve_objective(objective)
    objective_args = dict(p_bar=p_bar, ref_logprobs=ref_logprobs, doc_ids=doc_ids, compat=compat)
    memory = memory_options(memory, "token_loss")
    if memory.defer_head_grad and backend != "chunked":
        raise InvalidArgument(f"token_loss: memory.defer_head_grad needs backend='chunked', got {backend!r}")
    if backend in ("liger", "cce"):
        if not isinstance(obj, CE):
            raise InvalidArgument(
                f"objective {obj.name!r} needs per-token probabilities inside the gradient, which "
                f"backend {backend!r} does not expose; use backend='chunked' (or 'dense')"
            )
        return fused_cross_entropy(
            h, W, labels, backend=backend, bias=bias, softcap=softcap,
            ignore_index=ignore_index, z_loss=z_loss, chunk_size=chunk_size, stats=stats,
        )
    if backend == "dense":
        return dense_token_loss(
            h, W, labels, objective=obj, bias=bias, softcap=softcap,
            ignore_index=ignore_index, z_loss=z_loss, **objective_args,
        )
    return chunked_token_loss(
        h, W, labels, objective=obj, bias=bias, softcap=softcap, ignore_index=ignore_index,
        z_loss=z_loss, chunk_size=chunk_size, accum_dtype=accum_dtype, memory=memory,
        **objective_args,
    )
