"""``[memory] seco_chunk`` through ``pgs run``'s loop: chunk-wise training equals the whole-row run
(losses to float32 summation order, with and without gradient release) and trains; SpaCO trains."""

from __future__ import annotations

import pytest

from tests.helpers import step_records, tiny_spec


def _losses(tmp_path, name: str, sets: list[str], steps: int = 6) -> list[float]:
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    path = tiny_spec(tmp_path, name, steps=steps, every=0)
    assert run(load_spec(path, sets)) == 0
    return [r["loss"] for r in step_records(tmp_path / name)]


@pytest.mark.parametrize("release", [False, True], ids=["bound", "release"])
def test_seco_run_equals_the_whole_row_run(tmp_path, release, monkeypatch):
    from pgs.runtime.model import seco

    sweeps = []
    backward = seco.ChunkedRow._backward

    def counted(self, scale):
        backward(self, scale)
        sweeps.append(self.backwards)

    monkeypatch.setattr(seco.ChunkedRow, "_backward", counted)
    sets = ["train.grad_accum=1", "optimizer.clip=0"] if release else []
    sets += ["memory.gradient_release=true"] if release else []
    whole = _losses(tmp_path, "whole", sets)
    assert not sweeps
    chunked = _losses(tmp_path, "seco", sets + ["memory.seco_chunk=24"])
    assert sweeps and all(n == 4 for n in sweeps)  # 96-token rows in 4 chunks, every step
    assert chunked == pytest.approx(whole, rel=2e-5)
    assert chunked[-1] < chunked[0]


def test_spaco_run_trains(tmp_path):
    losses = _losses(tmp_path, "spaco", ["memory.seco_chunk=24", "memory.spaco_keep=0.5"], steps=8)
    assert len(losses) == 8 and losses[-1] < losses[0]
