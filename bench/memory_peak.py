"""Where a ``pgs run``'s peak allocated memory comes from (CUDA only).

Runs ``pgs ARGS`` (e.g. ``run specs/qwen3_4b_12gib.toml --set ...``) in this process with the
caching allocator's history recorded (``torch.cuda.memory._record_memory_history``, Python
stacks).  Whenever ``torch.cuda.max_memory_allocated()`` has risen past ``--floor`` GiB (and by
more than 8 MiB since the last look) after the run's setup, a training step or a checkpoint
save, the recorded window is replayed backwards from the allocator's present state to the moment
of the peak, and the blocks live at that moment are written out: grouped by where they were
allocated (the innermost frames outside torch itself: pgs, transformers, compiled code), the
largest blocks with their stacks, and the stack of the allocation that reached the peak.
With ``--reset-after N`` the peak counters are reset after step N, so that the later looks show
what the steady steps reach (the first steps' compilation and autotuning left out).

    python bench/memory_peak.py --out /tmp/mp -- run specs/qwen3_4b_12gib.toml \\
        --set train.steps=40 --set checkpoint.dir=/tmp/mp/run --set checkpoint.every=20

Output: ``OUT/memory_peak.txt`` (each look, appended) and the run's own files.  The replay
counts a block as allocated from its ``alloc`` event to its ``free_requested`` event, as the
allocator's ``allocated_bytes`` counter does; a look whose window does not reach back to the
peak says so.  Recording slows the host a little; step times of such a run are not figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
MiB = 2**20


def _own(frame: dict) -> bool:
    """A frame outside torch's own package (pgs, transformers, bitsandbytes, compiled output)."""
    return "site-packages/torch/" not in frame.get("filename", "")


def _fmt(frame: dict) -> str:
    name = frame.get("filename", "?")
    parts = name.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else name
    return f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _site(frames: list[dict], depth: int = 3) -> str:
    """The innermost frame, then the innermost ``depth`` frames outside torch."""
    if not frames:
        return "(no stack: allocated before the window)"
    own = [f for f in frames if _own(f)][:depth]
    head = _fmt(frames[0])
    return " < ".join([head] + [_fmt(f) for f in own if _fmt(f) != head])


def live_at_peak(snapshot: dict, device: int = 0, start: int = 0) -> dict:
    """Replays the device's trace backwards from the snapshot's live blocks; returns the peak
    after the first ``start`` events (bytes, event index), the blocks live then
    ``{addr: (size, frames)}`` and the window's size."""
    events = sorted(snapshot["device_traces"][device], key=lambda e: e.get("time_us", 0))
    live: dict[int, tuple[int, list]] = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[block["address"]] = (block["size"], block.get("frames", []))
    now = sum(size for size, _ in live.values())
    alloc_frames: dict[int, list[int]] = defaultdict(list)  # addr -> indices of its alloc events
    for i, e in enumerate(events):
        if e.get("action") == "alloc":
            alloc_frames[e["addr"]].append(i)
    # allocated bytes after events[:i] for every i, from the present backwards
    amount, peak, peak_at = now, now, len(events)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.get("action") == "alloc":
            amount -= e["size"]
        elif e.get("action") == "free_requested":
            amount += e["size"]
        if amount > peak and i >= start:
            peak, peak_at = amount, i
    # the blocks live after events[:peak_at]: undo the events from the present back to it
    blocks = dict(live)
    for i in range(len(events) - 1, peak_at - 1, -1):
        e = events[i]
        if e.get("action") == "alloc":
            blocks.pop(e["addr"], None)
        elif e.get("action") == "free_requested":
            earlier = [j for j in alloc_frames.get(e["addr"], []) if j < peak_at]
            frames = events[earlier[-1]].get("frames", []) if earlier else []
            blocks[e["addr"]] = (e["size"], frames)
    # a block live now that was allocated inside the window: its alloc event's stack
    for addr, (size, frames) in list(blocks.items()):
        if not frames:
            earlier = [j for j in alloc_frames.get(addr, []) if j < peak_at]
            if earlier:
                blocks[addr] = (size, events[earlier[-1]].get("frames", []))
    reached = events[peak_at - 1] if 0 < peak_at <= len(events) else None
    return {"now": now, "peak": peak, "peak_at": peak_at, "events": len(events), "blocks": blocks,
            "reached": reached, "first_time_us": events[0].get("time_us") if events else None,
            "peak_time_us": reached.get("time_us") if reached else None}


def report(tag: str, snapshot: dict, max_allocated: int, top: int = 25, start: int = 0) -> str:
    r = live_at_peak(snapshot, start=start)
    lines = [f"== {tag}: max_memory_allocated {max_allocated / GiB:.4f} GiB; window of {r['events']} events; "
             f"replayed peak {r['peak'] / GiB:.4f} GiB at event {r['peak_at']} (allocated now {r['now'] / GiB:.4f})"]
    if r["peak"] + MiB < max_allocated:
        lines.append("   the window does not reach back to the run's peak (it came earlier): groups below are "
                     "the window's own peak")
    total = sum(size for size, _ in r["blocks"].values())
    lines.append(f"   blocks live at the replayed peak: {len(r['blocks'])}, {total / GiB:.4f} GiB")
    if r["reached"] is not None:
        lines.append("   the allocation that reached it: "
                     f"{r['reached'].get('size', 0) / MiB:.1f} MiB, stack (innermost first):")
        for f in r["reached"].get("frames", [])[:40]:
            lines.append(f"      {_fmt(f)}")
    groups: dict[str, list[int]] = defaultdict(list)
    for size, frames in r["blocks"].values():
        groups[_site(frames)].append(size)
    lines.append("   live at the peak, by allocation site (GiB, blocks, site):")
    for site, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"   {sum(sizes) / GiB:8.4f} {len(sizes):6d}  {site}")
    lines.append("   largest blocks:")
    for size, frames in sorted(r["blocks"].values(), key=lambda b: -b[0])[:12]:
        lines.append(f"   {size / MiB:9.1f} MiB  {_site(frames, depth=6)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for memory_peak.txt")
    p.add_argument("--floor", type=float, default=11.9, help="look only once the peak is above this, GiB")
    p.add_argument("--entries", type=int, default=500_000, help="allocator events kept (a ring)")
    p.add_argument("--looks", type=int, default=8, help="at most this many looks")
    p.add_argument("--reset-after", type=int, default=0, metavar="N",
                   help="reset the peak counters after step N (0: never); later looks are the steady steps' peaks")
    p.add_argument("pgs", nargs=argparse.REMAINDER, help="-- then the pgs command line (run SPEC ...)")
    args = p.parse_args(argv)
    pgs_args = args.pgs[1:] if args.pgs[:1] == ["--"] else args.pgs
    import torch

    sys.path.insert(0, ROOT)
    import pgs.runtime.loop.checkpointer as checkpointer
    import pgs.runtime.loop.train as train
    from pgs.cli import main as pgs_main

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_peak.txt")
    torch.cuda.memory._record_memory_history(max_entries=args.entries, context="all", stacks="python")
    state = {"seen": 0, "looks": 0, "start": 0}  # start: the events before the last reset

    def look(tag: str) -> None:
        peak = torch.cuda.max_memory_allocated()
        if peak < args.floor * GiB or peak <= state["seen"] + 8 * MiB or state["looks"] >= args.looks:
            return
        state["seen"], state["looks"] = peak, state["looks"] + 1
        started = time.perf_counter()
        text = report(tag, torch.cuda.memory._snapshot(), peak, start=state["start"])
        text += f"\n   (look took {time.perf_counter() - started:.1f} s)\n"
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")
        print(text, file=sys.stderr, flush=True)

    def wrap(fn, tag):
        def inner(*a, **k):
            out = fn(*a, **k)
            run = a[0] if a and hasattr(a[0], "step") else None
            look(f"{tag} (step {run.step})" if run is not None else tag)
            if run is not None and tag.startswith("after the launch") and run.step == args.reset_after:
                torch.cuda.reset_peak_memory_stats()
                state["seen"] = 0
                state["start"] = len(torch.cuda.memory._snapshot()["device_traces"][0])
                with open(path, "a", encoding="utf-8") as handle:
                    handle.write(f"-- peak counters reset after step {run.step}: looks below are later steps\n")
            return out
        return inner

    train.setup = wrap(train.setup, "after setup")
    train.train_step = wrap(train.train_step, "after the launch of")
    checkpointer.save = wrap(checkpointer.save, "after the checkpoint save at")  # the loop's saves (loop/checkpointer.py)
    code = pgs_main(pgs_args)
    look("at the end")
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"pgs exit {code}; max allocated {torch.cuda.max_memory_allocated() / GiB:.4f} GiB, "
                     f"max reserved {torch.cuda.max_memory_reserved() / GiB:.4f} GiB\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
