"""Steady steps through the product path: after warm-up, real variable-length data compiles
nothing new (issue 19: `pgs run` recompiled every layer at almost every new row width), and
the step's metrics are read without draining the device queue."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from pgs.runtime.model import layers

from pgs.runtime.loop import control
from helpers import tiny_spec


def _compiles(frame_counts) -> int:
    return sum(frame_counts.values())


def test_real_data_steps_compile_the_layers_once(tmp_path, monkeypatch):
    """Compiled layers over 10 steps of the quickstart's packed chats (documents of 20-110
    tokens, rows filled to different lengths): one compile at the first step, none after.
    Fails when rows are padded only to their batch's longest row (a new width, a recompile)."""
    from torch._dynamo.utils import counters

    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    monkeypatch.setattr(layers, "compile_layers",
                        functools.partial(layers.compile_layers, backend="eager"))
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
    assert len(fills) >= 3, "the data gave rows of one fill only: the test would not see a new width"
    assert (_compiles(counters["frames"]), counters["stats"]["unique_graphs"]) == after_first
    assert counters["stats"]["unique_graphs"] >= 1


def test_a_step_record_reads_back_the_numbers_the_step_computed():
    """The record's device numbers (entropy, lr, ‖g‖) come back through an asynchronous copy;
    reading gives the values the step computed, plain numbers beside them unchanged."""
    from pgs.runtime.loop.train import StepRecord

    record = StepRecord({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([3.25])},
                        lambda v: {"sum": v["a"] + v["b"] + v["c"], "b": v["b"]})
    assert record.read() == {"sum": 6.75, "b": 2} and record["sum"] == 6.75


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_thirty_real_data_steps_compile_and_plan_once(tmp_path):
    """Issue 19 on the GPU: the product loop (gradient release, compiled layers with inductor,
    packed documents through the varlen kernel, bf16) over 30 steps of the bundled long chats:
    after the first two steps no frame is compiled again, whatever the rows' document counts and
    fills.  (cuDNN's own graph cache, keyed by the bucketed document count, is not counted here.)"""
    from torch._dynamo.utils import counters

    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    spec = load_spec(tiny_spec(tmp_path, "steady_cuda", steps=32), [
        "memory.compile_layers=true", "memory.gradient_release=true", "memory.stochastic_rounding=true",
        "optimizer.alias=lion8bit", "optimizer.clip=0", "optimizer.args={}", "train.grad_accum=1",
        "model.dtype=bfloat16", "model.attn_implementation=varlen", "data.max_seq_len=1024",
        'data.sources=["pgs:bench/chats.jsonl"]', 'data.eval=""', "model.config.max_position_embeddings=4096"])
    torch._dynamo.reset()
    run = setup(spec)
    with control.StopSignals() as signals:
        for _ in range(2):
            train_step(run, signals, control.WallClock(None))
        torch.cuda.synchronize()
        frames = _compiles(counters["frames"]), counters["stats"]["unique_graphs"]
        fills = set()
        for _ in range(28):
            record, _ = train_step(run, signals, control.WallClock(None))
            fills.add(record["tokens"])
        torch.cuda.synchronize()
    run.loader.close()
    assert len(fills) > 5
    assert (_compiles(counters["frames"]), counters["stats"]["unique_graphs"]) == frames


def test_profile_traces_the_asked_steps_of_the_run(tmp_path):
    """`pgs run --profile 2:3`: a Chrome trace with those steps marked and an operator table."""
    import json

    from pgs.cli import main

    spec = tiny_spec(tmp_path, "prof", steps=4)
    assert main(["run", str(spec), "--profile", "2:3"]) == 0
    folder = tmp_path / "prof" / "profile"
    events = json.loads((folder / "trace.json").read_text())["traceEvents"]
    marks = {e["name"] for e in events if str(e.get("name", "")).startswith("pgs.step.")}
    assert marks == {"pgs.step.2", "pgs.step.3"}
    assert "Self CPU" in (folder / "ops.txt").read_text()


def test_a_malformed_profile_range_is_one_line_and_exit_2(tmp_path, capsys):
    from pgs.cli import main

    spec = tiny_spec(tmp_path, "badprof", steps=4)
    for bad in ("3", "a:b", "4:2", "0:1"):
        assert main(["run", str(spec), "--profile", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--profile" in err[0], err
    assert not (tmp_path / "badprof").exists()


_CAPPED = """
import torch
from pgs.runtime.loop.train import configure_allocator
configure_allocator(torch.device("cuda"), 1.0)
MiB = 2**20
keep = []
for round in range(6):  # blocks of changing sizes (at most 821 MiB live), some kept a while
    blocks = [torch.empty((8 + 13 * ((i * 7 + round) % 11)) * MiB, dtype=torch.uint8, device="cuda")
              for i in range(6)]
    keep += blocks[::2]
    del blocks
    keep = keep[-4:]
print("reserved", torch.cuda.max_memory_reserved() / 2**30)
try:
    torch.empty(1100 * MiB, dtype=torch.uint8, device="cuda")
    print("over the cap: allocated")
except torch.OutOfMemoryError:
    print("over the cap: out of memory")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_limit_caps_what_the_allocator_reserves():
    """memory.device_limit_gib: the caching allocator reserves at most the cap, giving cached
    blocks back instead of growing, and a request past the cap is out of memory (a fresh process:
    the cap is process-wide)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CAPPED], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert float(lines["reserved"]) <= 1.0
    assert lines["over"] == "the cap: out of memory"
