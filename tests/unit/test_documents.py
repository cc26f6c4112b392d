"""``pgs.runtime.documents``: one definition of a packed row's document boundaries, equal to each
computation it replaced.

The four replaced computations are kept below verbatim (as they were in
``model/attention.py: cu_seqlens_from_positions``, ``data/packing.py: doc_ids``,
``dist/context.py: document_ids`` and ``model/seco.py: RowState.__init__``) and compared with
the new functions on packed rows with padding, single documents, and rows that start inside a
document (context-parallel shards of both layouts, and arbitrary positions).
"""

from __future__ import annotations

import pytest
import torch

from pgs.runtime.data import Document, collate
from pgs.runtime.dist.context import SequenceShard, shard_batch
from pgs.runtime.documents import cu_seqlens, document_ids, document_starts


# ------------------------------------------------------------------ the replaced computations


def old_attention_cu_seqlens(position_ids):
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    row_starts = torch.arange(0, flat.numel(), position_ids.shape[-1], device=flat.device)
    starts = torch.unique(torch.cat([starts, row_starts]))
    end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def old_packing_doc_ids(position_ids):
    return (position_ids.reshape(-1) == 0).cumsum(0).reshape(position_ids.shape)


def old_context_document_ids(position_ids):
    return torch.cumsum((position_ids == 0).to(torch.int64), dim=-1)


def old_seco_docs(position_ids):
    batch, width = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    return starts.reshape(-1).cumsum(0).reshape(batch, width)


# ------------------------------------------------------------------ the rows compared


def _collated(lengths_per_row, seq_len):
    rows = [[Document(tuple(range(1, n + 1)), (True,) * n) for n in row] for row in lengths_per_row]
    return collate(rows, pad_id=0, seq_len=seq_len)


#: rows that each start at position 0 (what collate gives every step)
WHOLE_ROWS = {
    "packed with padding": _collated([(7, 5, 9), (5, 9), (3,)], seq_len=24).position_ids,
    "one document per row, padded": _collated([(4,), (9,), (12,)], seq_len=12).position_ids,
    "one document filling one row": _collated([(16,)], seq_len=16).position_ids,
    "one row, no padding": _collated([(3, 4, 1, 8)], seq_len=16).position_ids,
}


def _shards(layout, world):
    batch = _collated([(7, 5, 9), (5, 9), (21,)], seq_len=21)  # shard_batch pads the rows to split
    return {f"{layout} shard {r}/{world}": shard_batch(batch, SequenceShard(r, world, layout)).position_ids
            for r in range(world)}


#: rows that start inside a document: each rank's part of packed rows, and arbitrary positions
MID_DOCUMENT = {
    **_shards("contiguous", 3), **_shards("zigzag", 2),
    "arbitrary": torch.tensor([[3, 4, 5, 0, 1], [7, 0, 1, 2, 0], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
}

ALL = {**WHOLE_ROWS, **MID_DOCUMENT}


def _same_document(ids):
    """``[B, S, S]``: tokens i and j of a row are in one document (what every user of ids compares)."""
    return ids[:, :, None] == ids[:, None, :]


def test_the_shards_do_start_inside_documents():
    assert any(bool((pos[:, 0] != 0).any()) for pos in MID_DOCUMENT.values())


@pytest.mark.parametrize("name", list(ALL))
def test_cu_seqlens_equals_the_packed_attention_boundaries(name):
    pos = ALL[name]
    new, old = cu_seqlens(pos), old_attention_cu_seqlens(pos)
    assert new.dtype == old.dtype == torch.int32
    assert torch.equal(new, old)


@pytest.mark.parametrize("name", list(ALL))
def test_document_ids_equal_seco_document_ids(name):
    pos = ALL[name]
    assert torch.equal(document_ids(pos), old_seco_docs(pos))


@pytest.mark.parametrize("name", list(ALL))
def test_document_ids_split_each_row_as_the_ring_attention_ids(name):
    # ring attention compares ids of one row only (dist/context.py: _allowed)
    pos = ALL[name]
    assert torch.equal(_same_document(document_ids(pos)), _same_document(old_context_document_ids(pos)))


@pytest.mark.parametrize("name", list(WHOLE_ROWS))
def test_document_ids_equal_the_packing_ids_on_rows_that_start_a_document(name):
    pos = WHOLE_ROWS[name]
    assert torch.equal(document_ids(pos), old_packing_doc_ids(pos))


def test_a_row_that_starts_inside_a_document_never_continues_the_previous_row():
    # the one input where packing.doc_ids differed: it counted only positions 0 over the
    # flattened batch, so row 1's leading tokens joined row 0's last document
    pos = torch.tensor([[0, 1, 2, 0, 1], [2, 3, 0, 1, 2]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2], [3, 3, 4, 4, 4]]
    assert old_packing_doc_ids(pos).tolist() == [[1, 1, 1, 2, 2], [2, 2, 3, 3, 3]]


@pytest.mark.parametrize("name", list(ALL))
def test_the_three_forms_agree(name):
    pos = ALL[name]
    starts, ids, cu = document_starts(pos), document_ids(pos), cu_seqlens(pos)
    assert cu.tolist() == [*starts.reshape(-1).nonzero().flatten().tolist(), pos.numel()]
    lengths = (cu[1:] - cu[:-1]).long()
    assert torch.equal(torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths).view(pos.shape), ids)


def test_positions_are_not_changed_and_padding_is_one_document_per_row():
    batch = _collated([(3, 2), (5,)], seq_len=8)
    pos = batch.position_ids.clone()
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3], [4, 4, 4, 4, 4, 5, 5, 5]]
    assert cu_seqlens(pos).tolist() == [0, 3, 5, 8, 13, 16]
    assert torch.equal(pos, batch.position_ids)
