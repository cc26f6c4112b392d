"""bench/product.py's summary of a ``pgs run``'s step records."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.product import summarize  # noqa: E402


def _records():
    out = [{"event": "start"}]
    for step in range(1, 7):
        rec = {"step": step, "loss": 1.0, "tokens": 4096, "time": 10.0 + step, "step_seconds": 0.5 if step > 2 else 9.0,
               "mem_gib": 8.0 + step / 100, "reserved_gib": 9.0}
        if step > 1:
            rec.update({"release/host_ms": float(step), "offload/host_ms": 2.0, "offload/unannounced": 0})
        out.append(rec)
    return out


def test_summary_skips_warm_up_and_averages_the_host_times_over_the_timed_steps():
    out = summarize(_records(), skip=2)
    assert out["steps"] == 6
    assert out["mean_tok_s"] == pytest.approx(4096 / 0.5)
    assert out["median_step_s"] == 0.5 and out["max_over_median"] == 1.0
    assert out["mean release/host_ms"] == pytest.approx((3 + 4 + 5 + 6) / 4)  # steps 3-6, not 2
    assert out["mean offload/host_ms"] == 2.0 and out["mean offload/unannounced"] == 0
    assert "mean offload/fetches" not in out  # only what the run logged
    assert out["max_allocated_gib"] == pytest.approx(8.06) and out["max_reserved_gib"] == 9.0


def test_summary_of_too_few_steps_is_an_error_row():
    assert "error" in summarize(_records()[:3], skip=2)
