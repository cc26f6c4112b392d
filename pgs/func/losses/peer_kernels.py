"""Fused-kernel backends for plain cross-entropy: Liger and Apple's Cut Cross-Entropy (arXiv 2411.09009;
docs/techniques/chunked_ce.md).

Both are optional (``pip install 'pgs[gpu]'``), CUDA-only, and imported only when asked for.
They return only the summed loss, so the token statistics (entropy, target probability,
LSE²) come from a no-grad chunked pass when ``stats=True`` (one extra head matmul without
backward); ``stats=False`` leaves them ``None``.  Gated objectives need per-token p inside
the gradient, which these kernels do not expose: they run on ``chunked`` or ``dense`` only.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from pgs.errors import InvalidArgument, MissingExtra
from pgs.func.losses.chunked import chunked_cross_entropy
from pgs.func.losses.head import check_options, flatten_inputs
from pgs.func.losses.result import TokenLossResult

_PACKAGES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def _import_backend(backend: str):
    package = _PACKAGES[backend]
    try:
        if backend == "liger":
            module = importlib.import_module("liger_kernel.transformers")
            return module.LigerFusedLinearCrossEntropyLoss
        return importlib.import_module("cut_cross_entropy").linear_cross_entropy
    except ImportError as err:
        raise MissingExtra(
            f"loss backend {backend!r} needs the {package} package: pip install 'pgs[gpu]' ({err})"
        ) from None


def _fused_loss_sum(backend, h, W, labels, bias, softcap, ignore_index) -> Tensor:
    fn = _import_backend(backend)
    if backend == "liger":
        options = {"ignore_index": ignore_index, "reduction": "sum"}
        if softcap is not None:  # older Liger versions lack the argument
            options["softcap"] = softcap
        loss = fn(**options)(W, h, labels, bias)
        # Newer Liger versions may return (loss, z_loss) or an output object.
        if isinstance(loss, tuple):
            loss = loss[0]
        loss = getattr(loss, "loss", loss)
        return loss.float()
    if h.dtype not in (torch.bfloat16, torch.float16) or W.dtype != h.dtype:
        raise InvalidArgument(
            f"backend 'cce' needs bf16 or fp16 h and W of one dtype, got h {h.dtype}, W {W.dtype}"
        )
    kwargs = {"ignore_index": ignore_index, "softcap": softcap, "reduction": "sum"}
    if bias is not None:
        kwargs["bias"] = bias
    return fn(h, W, labels, **kwargs).float()


def fused_cross_entropy(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    backend: str,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 1024,
    stats: bool = True,
) -> TokenLossResult:
    """Cross-entropy summed over valid tokens by Liger (``backend="liger"``) or CCE (``"cce"``).

    ℓ_i = LSE(z_i) − z_{i,y}, z_i = softcap(W h_i + b); loss_sum = Σ_{i∈M} ℓ_i.  CCE: arXiv
    2411.09009 (Wijmans et al., ICLR 2025).  Liger's fused linear cross-entropy: arXiv
    2410.10989.  ``chunk_size`` only sizes the statistics pass.

    Raises:
        MissingExtra: the package is not installed.
        InvalidArgument: not on CUDA, or z_loss > 0 (use ``chunked``).
    """
    if backend not in _PACKAGES:
        raise InvalidArgument(f"fused backend must be 'liger' or 'cce', got {backend!r}")
    check_options(softcap, z_loss, chunk_size)
    if z_loss:
        raise InvalidArgument(
            f"backend {backend!r} does not report the z-loss; use backend='chunked' for z_loss > 0"
        )
    fn = _import_backend(backend)  # MissingExtra before any device complaint
    del fn
    if h.device.type != "cuda" or W.device.type != "cuda":
        raise InvalidArgument(f"backend {backend!r} runs on CUDA only; h is on {h.device}")
    h, labels, _ = flatten_inputs(h, W, labels, bias)
    num_valid = (labels != ignore_index).sum()
    if int(num_valid) == 0:
        # Kernels divide or index on empty inputs; the chunked path gives exact zeros.
        return chunked_cross_entropy(
            h, W, labels, bias=bias, softcap=softcap, ignore_index=ignore_index
        )
    loss_sum = _fused_loss_sum(backend, h, W, labels, bias, softcap, ignore_index)
    entropy_sum = target_prob_sum = z_loss_sum = None
    if stats:
        with torch.no_grad():
            s = chunked_cross_entropy(
                h, W, labels, bias=bias, softcap=softcap, ignore_index=ignore_index,
                chunk_size=chunk_size,
            )
        entropy_sum, target_prob_sum, z_loss_sum = s.entropy_sum, s.target_prob_sum, s.z_loss_sum
    return TokenLossResult(loss_sum, num_valid, entropy_sum, target_prob_sum, z_loss_sum)
