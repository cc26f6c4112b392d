"""Steady steps through the product path: after warm-up, real variable-length data compiles
nothing new (issue 19: `pgs run` recompiled every layer at almost every new row width), and
the step's metrics are read without draining the device queue."""

from __future__ import annotations

import functools

import torch

from pgs.runtime import checkpointing, control
from test_train import tiny_spec


def _compiles(frame_counts) -> int:
    return sum(frame_counts.values())


def test_real_data_steps_compile_the_layers_once(tmp_path, monkeypatch):
    """Compiled layers over 10 steps of the quickstart's packed chats (documents of 20-110
    tokens, rows filled to different lengths): one compile at the first step, none after.
    Fails when rows are padded only to their batch's longest row (a new width, a recompile)."""
    from torch._dynamo.utils import counters

    from pgs.runtime.spec import load_spec
    from pgs.runtime.train import setup, train_step

    monkeypatch.setattr(checkpointing, "compile_layers",
                        functools.partial(checkpointing.compile_layers, backend="eager"))
    spec = load_spec(tiny_spec(tmp_path, "steady", steps=12), ["memory.compile_layers=true", "train.grad_accum=1"])
    torch._dynamo.reset()
    run = setup(spec)
    widths = set()
    original = run.loader.next_step

    def spy():
        batches = original()
        widths.update(b.input_ids.shape[1] for b in batches)
        return batches

    run.loader.next_step = spy
    with control.StopSignals() as signals:
        train_step(run, signals, control.WallClock(None))
        after_first = (_compiles(counters["frames"]), counters["stats"]["unique_graphs"])
        fills = set()
        for _ in range(9):
            record, _ = train_step(run, signals, control.WallClock(None))
            fills.add(record["tokens"])
    run.loader.close()
    assert widths == {spec.data.max_seq_len}
    assert len(fills) > 3, "the data gave rows of one fill only: the test would not see a new width"
    assert (_compiles(counters["frames"]), counters["stats"]["unique_graphs"]) == after_first
    assert counters["stats"]["unique_graphs"] >= 1


def test_a_step_record_reads_back_the_numbers_the_step_computed():
    """The record's device numbers (entropy, lr, ‖g‖) come back through an asynchronous copy;
    reading gives the values the step computed, plain numbers beside them unchanged."""
    from pgs.runtime.train import StepRecord

    record = StepRecord({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([3.25])},
                        lambda v: {"sum": v["a"] + v["b"] + v["c"], "b": v["b"]})
    assert record.read() == {"sum": 6.75, "b": 2} and record["sum"] == 6.75
