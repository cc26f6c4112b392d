"""Documents, best-fit-decreasing packing, and the batches the training loop consumes.

A *document* is one tokenized conversation.  Packing places whole documents into sequences
of ``max_seq_len`` tokens; inside a sequence each document keeps its own positions
(``position_ids`` restart at 0) and its own labels, so that no label crosses a document
boundary.  How the model is then kept from attending across documents is in ``isolation``.

Labels are already shifted: ``labels[i]`` is the target of position ``i``, that is the next
token of the same document when that token is trained, else -100.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Sequence

import attrs
import numpy as np
import torch

from pgs.errors import DataError

IGNORE_INDEX = -100


@attrs.frozen
class Document:
    """One tokenized sample: token ids, which tokens are trained, and ``file:line``."""

    input_ids: tuple[int, ...]
    train_mask: tuple[bool, ...]
    origin: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    def labels(self) -> list[int]:
        """Shifted targets: token ``j+1`` where it is trained, -100 elsewhere and at the end."""
        ids, mask = self.input_ids, self.train_mask
        return [ids[j + 1] if mask[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)] + [IGNORE_INDEX]

    @property
    def num_trained(self) -> int:
        """Trained targets (a trained first token has no position that predicts it)."""
        return sum(self.train_mask[1:])


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity``: longest first, each into the fullest bin it fits.

    Returns the item indices of each bin, bins in the order they were opened.  Items longer
    than ``capacity`` are a caller error (truncate or drop them first).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"item {i} of length {size} exceeds the bin capacity {capacity}")
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (room - size, b))
    return bins


@attrs.frozen
class PackedBatch:
    """A batch of packed sequences, ready for a HF causal LM.

    ``input_ids``, ``labels``, ``position_ids``: ``[B, S]`` long.  Padding (at the end of a
    row): pad token, label -100, positions 0, 1, 2, ... (the padding is one document of its own,
    never attended to by the row's real documents, which end before it).
    ``cu_seqlens``: per row, an int32 tensor of document boundaries ``[0, l1, l1+l2, ...]``
    (padding not included).  ``num_trained_tokens`` counts labels != -100; it can be 0 for an
    all-padding batch (eval on a rank with fewer samples), which the loss must divide safely.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[torch.Tensor]
    num_docs: int
    num_trained_tokens: int
    num_tokens: int  # non-padding tokens

    def forward_kwargs(self) -> dict:
        """What to pass to a HF model so that packed documents stay isolated (see ``isolation``)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


def collate(rows: Sequence[Sequence[Document]], pad_id: int, seq_len: int | None = None) -> PackedBatch:
    """Lay out rows of documents as a ``PackedBatch``, padded to ``seq_len`` or the longest row."""
    used = [sum(len(d) for d in row) for row in rows]
    width = max([seq_len or 0, *used, 1])
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((batch, width), dtype=torch.long)
    docs = [doc for row in rows for doc in row]
    lengths = np.fromiter((len(doc) for doc in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum())
    trained = 0
    if total:
        # Every document of the batch end to end, then each row's run copied into its row.
        ids = np.fromiter(itertools.chain.from_iterable(d.input_ids for d in docs), dtype=np.int64, count=total)
        mask = np.fromiter(itertools.chain.from_iterable(d.train_mask for d in docs), dtype=bool, count=total)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        present = lengths > 0
        # labels[p] = the next token of the same document where it is trained (Document.labels)
        flat_labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        flat_labels[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        flat_labels[ends[present] - 1] = IGNORE_INDEX
        positions = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        # Document.num_trained summed: trained tokens less each document's first token
        trained = int(mask.sum()) - int(mask[starts[present]].sum())
        ids_view, labels_view, positions_view = input_ids.numpy(), labels.numpy(), position_ids.numpy()
        at = 0
        for r, n in enumerate(used):
            ids_view[r, :n] = ids[at:at + n]
            labels_view[r, :n] = flat_labels[at:at + n]
            positions_view[r, :n] = positions[at:at + n]
            at += n
    # the padding at the end of a row is one document of its own (positions 0, 1, ...), so the
    # packed-attention kernels see one more document per padded row, not one per padding token
    # (a count that would change with every batch)
    ramp = torch.arange(width, dtype=torch.long)
    for r, n in enumerate(used):
        if n < width:
            position_ids[r, n:] = ramp[:width - n]
    cu_seqlens = []
    first = 0
    for row in rows:
        bounds = np.zeros(len(row) + 1, dtype=np.int32)
        np.cumsum(lengths[first:first + len(row)], out=bounds[1:])
        cu_seqlens.append(torch.from_numpy(bounds).clone())
        first += len(row)
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        num_docs=len(docs),
        num_trained_tokens=trained,
        num_tokens=sum(used),
    )


def pad_id(tokenizer, default: int | None = None) -> int:
    """The id that pads rows: the tokenizer's pad token, else its eos; else ``default`` (0 where
    ``pgs profile`` builds a model without a tokenizer's special tokens), or a ``DataError``
    when no default is given."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    if default is None:
        raise DataError("the tokenizer has neither a pad nor an eos token to pad batches with")
    return default
