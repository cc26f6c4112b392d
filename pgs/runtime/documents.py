"""The documents of packed rows, read from their ``position_ids``: the one definition of a
document boundary, and the forms its users take it in.

A packed batch is ``[B, S]`` rows of documents laid end to end, each document numbered
``0, 1, 2, ...`` (``pgs.runtime.data.packing.collate``).  **A document starts at every token
whose position is 0, and at the first token of every row** (rows never share a document: a
row that begins inside a document, such as a context-parallel rank's part of a row, begins a
document of its own there).  Nothing else is a boundary.

Padding needs no rule of its own: collate and ``pgs.runtime.dist.context.shard_batch`` number a
row's trailing padding ``0, 1, 2, ...`` as well, so it is one more document of that row, which
no real token attends to (the real documents end before it) and whose labels are ``-100``.
Padding numbered all 0 would be one document per token, equally isolated.  Which tokens are
padding is not readable from the positions; collate's per-row ``cu_seqlens`` (built from the
documents' lengths, padding excluded) says that.

Three forms, all computed on the tensor's device:

* :func:`document_starts`: ``[B, S]`` bool, True where a document starts;
* :func:`document_ids`: ``[B, S]`` int64 id per token, unique over the whole batch, numbered
  from 1 in the order of the flattened rows (packed-document attention masks, SeCO's chunks,
  ring attention, CADFT's per-sample statistics: equal id = same document);
* :func:`cu_seqlens`: ``[D + 1]`` int32 cumulative lengths ``[0, l1, l1+l2, ..., B·S]`` over the
  flattened rows (the variable-length kernels' ``cu_seqlens``; one host read, for ``D``).

The definition is the runtime's packed-row format (how collate numbers positions and pads
rows), not a transform of the functional core, so it lives here, in the runtime's lowest
layer (it imports torch only), where data, model and dist all reach it; ``pgs.func``'s losses
take document ids as given.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_starts(position_ids: Tensor) -> Tensor:
    """``[..., S]`` bool: True at each token that begins a document (position 0, or a row's first token)."""
    starts = position_ids == 0
    if starts.shape[-1]:
        starts[..., 0] = True
    return starts


def document_ids(position_ids: Tensor) -> Tensor:
    """``[..., S]`` int64: each token's document, ids ``1, 2, ...`` unique over the whole batch."""
    return document_starts(position_ids).reshape(-1).cumsum(0).reshape(position_ids.shape)


def cu_seqlens(position_ids: Tensor) -> Tensor:
    """int32 ``[0, l1, l1+l2, ..., B·S]``: the document boundaries of the flattened ``[B, S]`` rows."""
    flat = document_starts(position_ids).reshape(-1)
    starts = flat.nonzero().flatten()
    end = torch.full((1,), flat.numel(), device=flat.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


__all__ = ["cu_seqlens", "document_ids", "document_starts"]
