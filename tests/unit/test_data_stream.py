"""The training stream: mixing, epochs, exact resume, rank shares, eval batches."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pgs.errors import DataError
from pgs.runtime.data import DataConfig, DataSource, EvalStream, TrainStream
from pgs.runtime.data.synthetic import generate, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mix")
    a, b = str(folder / "a.jsonl"), str(folder / "b.jsonl")
    write_jsonl(a, generate(60, seed=1, weather_share=0.0))
    write_jsonl(b, generate(30, seed=2, weather_share=1.0))
    return a, b


def config(files, **kw):
    a, b = files
    return DataConfig(sources=[DataSource(a, weight=3.0), DataSource(b, weight=1.0)], max_seq_len=160, **kw)


def sequences(stream, n):
    return [[d.origin for d in stream._next_sequence()] for _ in range(n)]


def test_same_seed_same_stream_other_seed_other_stream(files, tok):
    first = sequences(TrainStream(config(files), tok, pack_window=16), 20)
    assert first == sequences(TrainStream(config(files), tok, pack_window=16), 20)
    assert first != sequences(TrainStream(config(files, seed=1), tok, pack_window=16), 20)


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_resume_continues_with_the_next_batch(files, tok, steps):
    stream = TrainStream(config(files), tok, pack_window=16)
    for _ in range(steps):
        stream.next_batch(2)
    state = json.loads(json.dumps(stream.state_dict()))
    expected = [stream.next_batch(2) for _ in range(3)]
    resumed = TrainStream(config(files), tok, pack_window=16)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch(2)
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.labels.tolist() == want.labels.tolist()
    assert resumed.stats.as_dict() == stream.stats.as_dict()


def test_resume_refuses_changed_data(files, tok):
    state = TrainStream(config(files), tok, pack_window=16).state_dict()
    other = TrainStream(config(files, seed=5), tok, pack_window=16)
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(state)


def test_ranks_read_disjoint_shares_of_the_same_global_stream(files, tok):
    single = TrainStream(config(files), tok, pack_window=16)
    rows = [single._next_sequence() for _ in range(8)]
    for rank in range(2):
        stream = TrainStream(config(files), tok, rank=rank, world_size=2, pack_window=16)
        first, second = stream.next_batch(2), stream.next_batch(2)
        want = rows[2 * rank:2 * rank + 2] + rows[4 + 2 * rank:4 + 2 * rank + 2]
        got = [first.input_ids[i] for i in range(2)] + [second.input_ids[i] for i in range(2)]
        for docs, ids in zip(want, got):
            flat = [t for d in docs for t in d.input_ids]
            assert ids[: len(flat)].tolist() == flat


def test_epochs_advance_and_every_record_is_seen(files, tok):
    a, _ = files
    stream = TrainStream(DataConfig(sources=[a], max_seq_len=160), tok, pack_window=10)
    seen = set()
    while stream.epoch == 0:
        seen.update(d.origin for d in stream._next_sequence())
    while stream._taken < len(stream._sequences):  # the epoch turned while filling this window
        seen.update(d.origin for d in stream._next_sequence())
    assert len(seen) == 60 and stream.epoch == 1


def test_unpacked_stream_has_one_document_per_row(files, tok):
    stream = TrainStream(config(files, packing=False), tok, pack_window=8)
    batch = stream.next_batch(4)
    assert batch.num_docs == 4 and all(len(c) == 2 for c in batch.cu_seqlens)


def test_eval_stream_gives_every_rank_the_same_number_of_batches(files, tok):
    a, _ = files
    cfg = DataConfig(sources=[a], eval=a, max_seq_len=160)
    total = [b.num_docs for b in EvalStream(cfg, tok, batch_size=8)]
    assert sum(total) == 60
    shares = [list(EvalStream(cfg, tok, batch_size=8, rank=r, world_size=3)) for r in range(3)]
    assert len({len(s) for s in shares}) == 1
    assert sum(b.num_docs for s in shares for b in s) == 60


def _window_origins(stream) -> list[str]:
    """The documents of the stream's next window, in draw order (the packer reorders them)."""
    while stream._sequences is not None and stream._taken < len(stream._sequences):
        stream._next_sequence()
    stream._next_sequence()
    return sorted(d.origin for seq in stream._sequences for d in seq)


def test_a_window_of_long_documents_closes_at_its_token_budget_and_skips_no_record(files, tok):
    """With a token budget of 3 rows a window holds the few documents that reach it, not
    pack_window of them, stopping at the first batch of draws that reaches it; every record is
    still drawn in order (each window is the next draws of the mixed order, none left unused)
    and a resume mid-window is exact."""
    a, _ = files
    cfg = DataConfig(sources=[a], max_seq_len=160)
    capped = TrainStream(cfg, tok, pack_window=64, window_tokens=3 * 160)
    first = _window_origins(capped)
    tokens = sum(len(d) for seq in capped._sequences for d in seq)
    assert 3 <= len(first) < 64 and tokens >= 3 * 160
    assert tokens - max(len(d) for seq in capped._sequences for d in seq) < 3 * 160  # closed at the budget
    one_at_a_time = TrainStream(cfg, tok, pack_window=1)  # windows of one document: the draw order
    at = 0
    for window in [first] + [_window_origins(capped) for _ in range(6)]:
        assert window == sorted(_window_origins(one_at_a_time)[0] for _ in window), at  # the next draws
        at += len(window)
    capped._next_sequence()  # into the next window: one of its sequences taken
    state = json.loads(json.dumps(capped.state_dict()))
    want = [capped.next_batch(1).input_ids.tolist() for _ in range(4)]
    resumed = TrainStream(cfg, tok, pack_window=64, window_tokens=3 * 160)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(1).input_ids.tolist() for _ in range(4)] == want


def test_windows_of_short_chats_do_not_reach_the_default_token_budget(files, tok):
    """The default budget (2**20 tokens or 16 rows) leaves windows of chats as they were: the
    same sequences as a stream with no budget at all."""
    cfg = config(files)
    assert sequences(TrainStream(cfg, tok, pack_window=64), 40) == sequences(
        TrainStream(cfg, tok, pack_window=64, window_tokens=2**40), 40)
