"""``pgs run --profile A:B``: a torch profiler trace of training steps A to B of the real run.

The trace covers what the product runs (data loader, forward, the control plane's read,
backward with the release steps inside, the metrics' copies), not a hand-wired harness.  It
writes, in ``<run dir>/profile/``:

* ``trace.json``: a Chrome/Perfetto trace (open it at https://ui.perfetto.dev) of CPU and CUDA
  activity with the steps marked (``pgs.step.N``);
* ``ops.txt``: the operators sorted by device time, then by host time (``key_averages``);
* ``streams.txt`` (CUDA): each device stream's busy time per step (kernels, copies by
  direction with their bytes and GB/s), how much of each side stream's work overlapped the
  compute stream's, and the compute stream's idle gaps: their total per step and the largest,
  named by the work before and after each.  Where a step loses time to copies it waits for
  (optimizer state streamed from the host, offloaded checkpoints) or to the host, the gaps show
  it (``stream_summary``).

Only the main process profiles; the steps outside ``A..B`` run untouched.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import defaultdict

import torch

from pgs.errors import SpecError


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (1-based, inclusive) -> ``(A, B)``; one clear line when it is malformed."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecError(f"--profile: {text!r} is not A:B (the first and last step to trace, e.g. 10:14)") from None
    if not 1 <= a <= b:
        raise SpecError(f"--profile: {text!r} needs 1 <= A <= B")
    return a, b


class Profiler:
    """Traces steps ``first..last`` (see the module docstring)."""

    def __init__(self, run_dir: str, steps: tuple[int, int], device: torch.device):
        self.first, self.last = steps
        self.folder = os.path.join(run_dir, "profile")
        self.cuda = device.type == "cuda"
        self._prof = None
        self._mark = None

    def before(self, step: int) -> None:
        """Called before step ``step`` (1-based) runs."""
        if step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
        if self._prof is not None:
            self._mark = torch.profiler.record_function(f"pgs.step.{step}")
            self._mark.__enter__()

    def after(self, step: int) -> None:
        """Called after step ``step`` returned."""
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (idempotent; also when the run ends early)."""
        if self._prof is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self.cuda:
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(self.folder, "trace.json"))
        averages = prof.key_averages()
        with open(os.path.join(self.folder, "ops.txt"), "w", encoding="utf-8") as handle:
            if self.cuda:
                handle.write(averages.table(sort_by="self_cuda_time_total", row_limit=60) + "\n\n")
            handle.write(averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n")
        if self.cuda:
            with open(os.path.join(self.folder, "trace.json"), encoding="utf-8") as handle:
                events = json.load(handle).get("traceEvents", [])
            with open(os.path.join(self.folder, "streams.txt"), "w", encoding="utf-8") as handle:
                handle.write(stream_summary(events, self.last - self.first + 1))


#: the device activity of a Kineto trace, by its category
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _kind(event: dict) -> str:
    if event.get("cat") != "gpu_memcpy":
        return event.get("cat", "")
    name = event.get("name", "")
    for direction in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
        if direction in name:
            return "copy " + direction
    return "copy"


#: a side stream's work that ends at most this long (µs) before the compute stream resumes is
#: taken as what the compute stream waited for (an event wait's latency is a few µs)
WAIT_SLACK_US = 50.0


def stream_summary(events: list[dict], steps: int, top: int = 8, min_gap_us: float = 20.0) -> str:
    """Where the device's time went over ``steps`` traced steps, per stream, from a Kineto
    Chrome trace's events (``ph == "X"`` of the categories ``DEVICE_CATEGORIES``, times in µs).

    The compute stream is the one with the most kernel time.  Per stream: busy time (the union
    of its activity) per step, its kernels and copies by direction (bytes and the mean GB/s of
    the copies), and for side streams the share of their busy time that overlapped the compute
    stream's.  Then the compute stream's idle time inside the traced window (first device event
    to last), per step, and its ``top`` largest gaps of at least ``min_gap_us``, each named by the
    compute work before and after it and by what the side streams did during it.

    The gaps are also summed by what ended them: a gap that closes within ``WAIT_SLACK_US`` of
    the end of a side stream's work (a copy the compute stream waited for through an event) is
    that stream's; any other gap is the host's (the compute stream waited for launches)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    if not device:
        return "no device activity in the trace\n"
    steps = max(1, steps)
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for e in device:
        by_stream[(e.get("args") or {}).get("stream", e.get("tid"))].append(e)
    busy = {s: _union([(e["ts"], e["ts"] + e["dur"]) for e in evs]) for s, evs in by_stream.items()}
    kernel_time = {s: sum(e["dur"] for e in evs if e.get("cat") == "kernel") for s, evs in by_stream.items()}
    compute = max(kernel_time, key=kernel_time.get)
    start = min(e["ts"] for e in device)
    end = max(e["ts"] + e["dur"] for e in device)
    lines = [f"{steps} steps traced, {(end - start) / 1e3 / steps:.2f} ms of device time line per step "
             f"(first device event to last); compute stream {compute}", ""]
    lines.append("stream | busy ms/step | overlaps compute | work per step")
    for s in sorted(by_stream, key=lambda s: (s != compute, -_length(busy[s]))):
        kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # µs, bytes, count
        for e in by_stream[s]:
            k = kinds[_kind(e)]
            k[0] += e["dur"]
            k[1] += float((e.get("args") or {}).get("bytes", 0) or 0)
            k[2] += 1
        work = []
        for name, (us, nbytes, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            part = f"{name} {us / 1e3 / steps:.2f} ms ×{count / steps:.0f}"
            if nbytes and us:
                part += f" {nbytes / steps / 2**30:.2f} GiB {nbytes / us / 1e3:.1f} GB/s"
            work.append(part)
        shared = "—" if s == compute else f"{_overlap(busy[s], busy[compute]) / max(_length(busy[s]), 1e-9):.0%}"
        lines.append(f"{s} | {_length(busy[s]) / 1e3 / steps:.2f} | {shared} | {'; '.join(work)}")
    spans = busy[compute]
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(spans, spans[1:]) if a1 - b0 >= min_gap_us]
    idle = (end - start) - _length(spans)
    lines += ["", f"compute stream idle: {idle / 1e3 / steps:.2f} ms per step "
                  f"({idle / max(end - start, 1e-9):.0%} of the window); gaps of {min_gap_us:g} µs or more: "
                  f"{len(gaps) / steps:.1f} per step, {_length(gaps) / 1e3 / steps:.2f} ms per step"]
    side_ends = sorted(((e["ts"] + e["dur"], s) for s, evs in by_stream.items() if s != compute for e in evs),
                       key=lambda x: x[0])
    end_times = [t for t, _ in side_ends]
    waited: dict[object, list[float]] = defaultdict(lambda: [0, 0.0])  # closer -> [gaps, µs]
    for a, b in gaps:
        at = bisect.bisect_right(end_times, b + 1e-3)  # the last side work that ended by the gap's end
        closer = side_ends[at - 1][1] if at and end_times[at - 1] >= max(a, b - WAIT_SLACK_US) else "host"
        waited[closer][0] += 1
        waited[closer][1] += b - a
    if gaps:
        lines.append(f"  by what ended them (side work ending ≤ {WAIT_SLACK_US:g} µs before compute resumed; "
                     "else the host):")
        for closer, (n, us) in sorted(waited.items(), key=lambda kv: -kv[1][1]):
            name = "host" if closer == "host" else f"stream {closer}"
            lines.append(f"    {name}: {n / steps:.1f} per step, {us / 1e3 / steps:.2f} ms per step")
    ordered = sorted(by_stream[compute], key=lambda e: e["ts"])
    ends = sorted(((e["ts"] + e["dur"], e.get("name", "")) for e in ordered))
    others = {s: busy[s] for s in busy if s != compute}
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        before = next((n for t, n in reversed(ends) if t <= a + 1e-3), "")
        after = next((e.get("name", "") for e in ordered if e["ts"] >= b - 1e-3), "")
        shared = {s: _overlap(iv, [(a, b)]) for s, iv in others.items()}
        during = [f"stream {s} busy {t / (b - a):.0%}" for s, t in shared.items() if t > 0]
        lines.append(f"  {(b - a) / 1e3:.3f} ms at +{(a - start) / 1e3:.1f} ms: after {before[:70]!r}, "
                     f"before {after[:70]!r}" + (f"; {', '.join(during)}" if during else "; no side stream busy"))
    return "\n".join(lines) + "\n"
