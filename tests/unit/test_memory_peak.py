"""bench/memory_peak.py's replay of the allocator's history: the peak and what was live then."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

from memory_peak import live_at_peak, report  # noqa: E402


def _frames(name: str) -> list[dict]:
    return [{"filename": "/venv/lib/python3.12/site-packages/torch/_tensor.py", "line": 1, "name": "empty"},
            {"filename": f"/repo/pgs/runtime/{name}.py", "line": 7, "name": name}]


def _event(action: str, addr: int, size: int, name: str) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": _frames(name)}


def _snapshot(events: list[dict], live: dict[int, int]) -> dict:
    for t, e in enumerate(events):
        e["time_us"] = t
    blocks = [{"address": a, "size": s, "state": "active_allocated", "frames": []} for a, s in live.items()]
    blocks.append({"address": 999, "size": 64, "state": "inactive", "frames": []})  # cached, not allocated
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]}


def test_the_peak_and_its_live_blocks_are_replayed_from_the_present():
    # block 0 (30 B) predates the window; 1 and 2 overlap; 3 comes after 2 is freed
    events = [_event("alloc", 1, 100, "forward"), _event("alloc", 2, 50, "loss"),
              _event("free_requested", 2, 50, "loss_free"), _event("free_completed", 2, 50, "loss_free"),
              _event("alloc", 3, 20, "backward"), _event("free_requested", 1, 100, "forward_free"),
              _event("free_completed", 1, 100, "forward_free")]
    r = live_at_peak(_snapshot(events, {0: 30, 3: 20}))
    assert r["now"] == 50
    assert r["peak"] == 180 and r["peak_at"] == 2  # after the second alloc
    assert {a: s for a, (s, _) in r["blocks"].items()} == {0: 30, 1: 100, 2: 50}
    # each block freed after the peak keeps the stack of its alloc, not of its free
    assert r["blocks"][2][1][-1]["name"] == "loss" and r["blocks"][1][1][-1]["name"] == "forward"
    assert r["blocks"][0][1] == []  # allocated before the window: no stack known
    assert r["reached"]["addr"] == 2


def test_a_start_index_restricts_the_peak_to_the_later_events():
    events = [_event("alloc", 1, 100, "warmup"), _event("free_requested", 1, 100, "warmup_free"),
              _event("alloc", 2, 40, "steady"), _event("free_requested", 2, 40, "steady_free")]
    snap = _snapshot(events, {0: 30})
    assert live_at_peak(snap)["peak"] == 130
    later = live_at_peak(snap, start=2)
    assert later["peak"] == 70 and later["peak_at"] == 3
    assert {a: s for a, (s, _) in later["blocks"].items()} == {0: 30, 2: 40}


def test_the_report_groups_by_the_frames_outside_torch_and_says_when_the_window_is_short():
    events = [_event("alloc", 1, 3 * 2**20, "forward"), _event("alloc", 2, 2**20, "forward")]
    snap = _snapshot(events, {1: 3 * 2**20, 2: 2**20})
    text = report("t", snap, max_allocated=4 * 2**20)
    assert "runtime/forward.py:7 forward" in text and "does not reach back" not in text
    group = [line for line in text.splitlines() if "forward.py:7 forward" in line and "0.0039" in line]
    assert group and group[0].split()[1] == "2"  # both blocks in one group of 4 MiB
    assert "does not reach back" in report("t", snap, max_allocated=64 * 2**20)
