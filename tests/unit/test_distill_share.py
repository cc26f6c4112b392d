"""``pgs.runtime.loop.distill.global_share``: a rank's prompts in one process's order (micro-batch by
micro-batch, the ranks in order within one), from every rank's prompt lengths."""

from __future__ import annotations

from pgs.runtime.dist import fsdp as D
from pgs.runtime.loop import distill


def parts(lengths: list[list[int]]) -> list[list]:
    """``split_documents``-shaped micro-batches whose prompts have these lengths."""
    return [[([1] * n, [2], [True]) for n in micro] for micro in lengths]


def test_rows_follow_the_global_batch_order(monkeypatch):
    every = [[[3, 4], [5]], [[6], [7, 8]], [[], [2]]]  # 3 ranks, 2 micro-batches each; rank 2 has none in the first
    monkeypatch.setattr(D, "gather_object", lambda mine: every)
    # micro 0: rank 0 → 0, 1; rank 1 → 2; rank 2 → none.  micro 1: rank 0 → 3; rank 1 → 4, 5; rank 2 → 6
    expected = {0: (0, 1, 3), 1: (2, 4, 5), 2: (6,)}
    for rank, mine in enumerate(every):
        monkeypatch.setattr(D, "rank", lambda rank=rank: rank)
        share = distill.global_share(parts(mine))
        assert share.rows == expected[rank] and share.total == 7 and share.width == 8


def test_one_process_takes_every_row_in_order():
    share = distill.global_share(parts([[3, 4], [5]]))
    assert share.rows == (0, 1, 2) and share.total == 3 and share.width == 5
    assert share.all_stopped(True) and not share.all_stopped(False)
