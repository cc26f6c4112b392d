"""Packing layout, shifted labels, truncation and drop policies."""

from __future__ import annotations

import pytest
import torch

from pgs.runtime.data import DataConfig, DataStats, Document, best_fit_decreasing, collate, encode_document
from pgs.runtime.data.records import Conversation
from transformers import AutoTokenizer

IGNORE = -100


def doc(ids, mask):
    return Document(tuple(ids), tuple(bool(m) for m in mask))


def test_labels_are_shifted_inside_each_document():
    a = doc([1, 2, 3, 4], [0, 0, 1, 1])
    b = doc([5, 6, 7], [0, 1, 1])
    batch = collate([[a, b]], pad_id=0, seq_len=9)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0, 0]]
    # position 3 (last of a) must not predict 5 (first of b)
    assert batch.labels.tolist() == [[IGNORE, 3, 4, IGNORE, 6, 7, IGNORE, IGNORE, IGNORE]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]  # the padding: one document
    assert batch.cu_seqlens[0].tolist() == [0, 4, 7]
    assert batch.cu_seqlens[0].dtype == torch.int32
    assert batch.num_docs == 2 and batch.num_trained_tokens == 4 and batch.num_tokens == 7
    assert batch.forward_kwargs()["use_cache"] is False
    assert "attention_mask" not in batch.forward_kwargs()


def test_padding_rows_are_ignored():
    batch = collate([[doc([1, 2], [0, 1])], []], pad_id=9)
    assert batch.input_ids.tolist() == [[1, 2], [9, 9]]
    assert batch.labels[1].tolist() == [IGNORE, IGNORE]
    assert batch.position_ids.tolist() == [[0, 1], [0, 1]]  # an all-padding row is one document


def test_best_fit_decreasing_fills_fullest_bin():
    bins = best_fit_decreasing([5, 4, 3, 3, 2, 1], capacity=6)
    assert sorted(sorted(b) for b in bins) == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(ValueError):
        best_fit_decreasing([7], capacity=6)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")


LONG = Conversation(
    messages=[{"role": "user", "content": "What is 123 + 456? " * 4}, {"role": "assistant", "content": "579"}],
    tools=None,
    origin="x.jsonl:1",
)


def test_drop_policy_counts_too_long(tok):
    stats = DataStats()
    config = DataConfig(sources=["x.jsonl"], max_seq_len=20, truncation="drop")
    assert encode_document(LONG, tok, config, stats) is None
    assert stats.dropped_too_long == 1 and stats.samples == 0


def test_truncation_that_keeps_no_trained_token_drops(tok):
    stats = DataStats()
    config = DataConfig(sources=["x.jsonl"], max_seq_len=20, truncation="truncate")
    assert encode_document(LONG, tok, config, stats) is None  # the answer was cut away
    assert stats.truncated == 1 and stats.dropped_no_trained == 1


def test_truncation_keeps_a_prefix_with_trained_tokens(tok):
    stats = DataStats()
    short = Conversation(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9"}],
        tools=None, origin="x.jsonl:2",
    )
    config = DataConfig(sources=["x.jsonl"], max_seq_len=14, truncation="truncate")
    document = encode_document(short, tok, config, stats)
    assert document is not None and len(document) == 14 and document.num_trained > 0
    assert stats.truncated == 1 and stats.samples == 1
