"""``pgs run --profile``'s stream summary (``pgs.runtime.loop.trace.stream_summary``): busy time
per device stream, the side streams' overlap with compute, and the compute stream's gaps named
by the work around them, from a Kineto trace's events."""

from __future__ import annotations

from pgs.runtime.loop.trace import stream_summary


def _event(stream, ts, dur, name="k", cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, **args}}


def test_a_wait_for_a_copy_shows_as_a_gap_named_by_its_neighbours():
    events = [
        _event(7, 0, 100, "fwd"), _event(7, 100, 50, "bwd"), _event(7, 300, 100, "step"),  # idle 150..300
        _event(20, 120, 200, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", bytes=2**30),
        _event(21, 350, 100, "Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", bytes=2**29),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host work is not device time
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10},
    ]
    text = stream_summary(events, 1)
    lines = text.splitlines()
    assert lines[0].startswith("1 steps traced, 0.45 ms") and lines[0].endswith("compute stream 7")
    assert "7 | 0.25 | — | kernel 0.25 ms ×3" in lines
    assert "20 | 0.20 | 25% | copy HtoD 0.20 ms ×1 1.00 GiB 5368.7 GB/s" in lines
    assert "21 | 0.10 | 50% | copy DtoH 0.10 ms ×1 0.50 GiB 5368.7 GB/s" in lines
    assert any(x.startswith("compute stream idle: 0.20 ms per step (44% of the window)") and
               x.endswith("1.0 per step, 0.15 ms per step") for x in lines)
    assert lines[-1] == "  0.150 ms at +0.1 ms: after 'bwd', before 'step'; stream 20 busy 100%"


def test_per_step_figures_divide_by_the_steps_and_small_gaps_are_not_listed():
    events = []
    for step in range(4):
        t = step * 1000
        events += [_event(3, t, 900, "layer"), _event(3, t + 905, 90, "opt")]  # 5 µs gaps, then 5 µs
    text = stream_summary(events, 4)
    assert "3 | 0.99 | — | kernel 0.99 ms ×2" in text
    assert "gaps of 20 µs or more: 0.0 per step" in text and " ms at +" not in text


def test_no_device_activity():
    assert stream_summary([{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}], 3) == \
        "no device activity in the trace\n"


def test_gaps_are_summed_by_the_side_stream_whose_work_ended_them_else_the_host():
    events = [
        _event(7, 0, 100, "bwd"), _event(7, 300, 100, "step"),  # gap 100..300, closed by stream 20's copy at 290
        _event(20, 150, 140, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", bytes=2**20),
        _event(7, 500, 100, "bwd"),  # gap 400..500: the copy on 21 ended 80 µs earlier (not waited for)
        _event(21, 400, 20, "Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", bytes=2**20),
        _event(7, 750, 100, "step"),  # gap 600..750: nothing on a side stream
    ]
    lines = stream_summary(events, 2).splitlines()
    at = lines.index("  by what ended them (side work ending ≤ 50 µs before compute resumed; else the host):")
    assert lines[at + 1:at + 3] == ["    host: 1.0 per step, 0.12 ms per step",
                                    "    stream 20: 0.5 per step, 0.10 ms per step"]
