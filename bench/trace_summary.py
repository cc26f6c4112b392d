"""A ``torch.profiler`` chrome trace of a few training steps, summarised per step (the
``sft-step`` suite's ``--profile N``: ``python -m bench sft-step --profile 2 ...``).

Wall vs CUDA busy time per step (the idle rest is host-bound time), top kernels, GPU time by
kernel class, GPU time and idle time by the code that launched the kernels (the ``probe.*``
phase annotations ``bench/sft_step.py`` puts around the step's phases, the release's group
steps, the deferred head gradient, the autograd node), host syncs and launches.
"""

from __future__ import annotations

import bisect
import collections

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize")
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
NODE_PREFIX = "autograd::engine::evaluate_function: "


def kernel_class(name: str, cat: str) -> str:
    n = name.lower()
    if cat != "kernel":
        return "memcpy/memset"
    if "lion8bit" in n or "adam" in n or "blockwise" in n:
        return "optimizer (8-bit kernels)"
    if "_row_stats_kernel" in n or "_grad_kernel" in n:
        return "loss (triton_ce)"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if n.startswith("triton_"):
        return "inductor (compiled layers)"
    return "aten eager (elementwise, copies, index, reductions)"


class _Intervals:
    """Annotations on one thread: innermost one containing a time (nested, few)."""

    def __init__(self):
        self.items: list[tuple[float, float, str]] = []

    def add(self, ts: float, end: float, name: str) -> None:
        self.items.append((ts, end, name))

    def innermost(self, t: float) -> str | None:
        best = None
        for ts, end, name in self.items:
            if ts <= t <= end and (best is None or end - ts < best[1] - best[0]):
                best = (ts, end, name)
        return best[2] if best else None


class _Flat:
    """Non-overlapping intervals (autograd nodes of one thread): the one containing a time."""

    def __init__(self, items):
        self.items = sorted(items)
        self.starts = [i[0] for i in self.items]

    def at(self, t: float) -> str | None:
        k = bisect.bisect_right(self.starts, t) - 1
        for j in range(k, max(k - 8, -1), -1):  # the latest start, or one of the few before it (nesting)
            ts, end, name = self.items[j]
            if end >= t:
                return name
        return None


def summarize_trace(events: list, steps: int) -> dict:
    """A chrome trace (``torch.profiler``) of ``steps`` probe steps, per step.

    Window: the first ``probe.step`` annotation's start to the end of ``probe.sync`` (or the
    last device event).  CUDA busy = union of kernel/memcpy/memset intervals in the window;
    idle = window − busy.  Every device event is attributed to the code that launched it (its
    launch call, matched by correlation id): the innermost ``probe.*`` annotation of the
    launching thread (else of any thread), and the autograd node running on that thread.
    Idle gaps are attributed to the launcher of the kernel that ended them (the GPU waited
    for that launch)."""
    per = 1.0 / max(steps, 1)
    dev, launches, syncs = [], {}, []
    ann_by_tid: dict = collections.defaultdict(_Intervals)
    all_ann = _Intervals()
    nodes_by_tid: dict = collections.defaultdict(list)
    step_starts, window_end = [], None
    n_launch = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        if cat in DEVICE_CATS:
            dev.append((ts, ts + dur, name, cat, (e.get("args") or {}).get("correlation")))
        elif cat in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (e.get("tid"), ts)
            if name in SYNC_NAMES:
                syncs.append((e.get("tid"), ts, dur))
            if name in LAUNCH_NAMES:
                n_launch += 1
        elif cat == "user_annotation" and name.startswith("probe."):
            ann_by_tid[e.get("tid")].add(ts, ts + dur, name)
            all_ann.add(ts, ts + dur, name)
            if name == "probe.step":
                step_starts.append(ts)
            elif name == "probe.sync":
                window_end = ts + dur
        elif cat == "cpu_op" and name.startswith(NODE_PREFIX):
            nodes_by_tid[e.get("tid")].append((ts, ts + dur, name[len(NODE_PREFIX):]))
    nodes = {tid: _Flat(v) for tid, v in nodes_by_tid.items()}
    dev.sort()
    w0 = min(step_starts) if step_starts else (dev[0][0] if dev else 0.0)
    w1 = max(window_end or 0.0, max((d[1] for d in dev), default=0.0))
    wall = max(w1 - w0, 0.0)

    def labels(tid, t):
        a = ann_by_tid[tid].innermost(t) if tid in ann_by_tid else None
        a = a or all_ann.innermost(t) or "outside probe annotations"
        nd = nodes[tid].at(t) if tid in nodes else None
        return a, nd or "(no autograd node)"

    busy = idle = 0.0
    cur_end = w0
    by_kernel: dict = collections.defaultdict(lambda: [0.0, 0])
    by_class: dict = collections.Counter()
    gpu_by_ann: dict = collections.Counter()
    gpu_by_node: dict = collections.Counter()
    idle_by_ann: dict = collections.Counter()
    idle_by_node: dict = collections.Counter()
    gaps = []
    n_dev = 0
    for ts, end, name, cat, corr in dev:
        if end <= w0 or ts >= w1:
            continue
        n_dev += 1
        ts_c, end_c = max(ts, w0), min(end, w1)
        launch = launches.get(corr)
        ann, node = labels(*launch) if launch else ("(launch not found)", "(launch not found)")
        if ts_c > cur_end:
            gap = ts_c - cur_end
            idle += gap
            idle_by_ann[ann] += gap
            idle_by_node[node] += gap
            gaps.append((gap, name[:80], ann, node))
        if end_c > cur_end:
            busy += end_c - max(ts_c, cur_end)
            cur_end = end_c
        d = end - ts
        k = by_kernel[name[:100]]
        k[0] += d
        k[1] += 1
        by_class[kernel_class(name, cat)] += d
        gpu_by_ann[ann] += d
        gpu_by_node[node] += d
    if w1 > cur_end:  # the host's tail: after the last kernel, before the window ends
        idle += w1 - cur_end
        idle_by_ann["(after the last kernel)"] += w1 - cur_end
    sync_by_ann: dict = collections.Counter()
    sync_ms = 0.0
    for tid, ts, dur in syncs:
        if w0 <= ts <= w1:
            a, _ = labels(tid, ts)
            sync_by_ann[a] += 1
            sync_ms += dur
    release = [(ts, end) for tid in ann_by_tid for ts, end, n in ann_by_tid[tid].items if n == "probe.release_group"]
    defer = [(ts, end) for tid in ann_by_tid for ts, end, n in ann_by_tid[tid].items if n == "probe.defer_add"]
    ms = lambda us: round(us * per / 1e3, 3)  # noqa: E731 - µs over all steps -> ms per step
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    gaps.sort(reverse=True)
    return {
        "steps": steps,
        "wall_ms_per_step": ms(wall),
        "cuda_busy_ms_per_step": ms(busy),
        "cuda_idle_ms_per_step": ms(idle),
        "busy_fraction": round(busy / wall, 4) if wall else None,
        "device_events_per_step": round(n_dev * per, 1),
        "kernel_launch_calls_per_step": round(n_launch * per, 1),
        "gpu_ms_by_class": {k: ms(v) for k, v in by_class.most_common()},
        "top_kernels": [{"name": n, "ms_per_step": ms(v[0]), "calls_per_step": round(v[1] * per, 1)} for n, v in top],
        "gpu_ms_by_annotation": {k: ms(v) for k, v in gpu_by_ann.most_common()},
        "idle_ms_by_annotation": {k: ms(v) for k, v in idle_by_ann.most_common()},
        "gpu_ms_by_autograd_node": {k: ms(v) for k, v in gpu_by_node.most_common(8)},
        "idle_ms_by_autograd_node": {k: ms(v) for k, v in idle_by_node.most_common(8)},
        "syncs_per_step": round(len([s for s in syncs if w0 <= s[1] <= w1]) * per, 1),
        "sync_call_ms_per_step": ms(sync_ms),
        "syncs_by_annotation_per_step": {k: round(v * per, 1) for k, v in sync_by_ann.most_common()},
        "release_group_steps_per_step": round(len(release) * per, 1),
        "release_group_cpu_ms_per_step": ms(sum(e - s for s, e in release)),
        "defer_add_cpu_ms_per_step": ms(sum(e - s for s, e in defer)),
        "largest_gaps_us": [{"us": round(g, 1), "next_kernel": n, "launched_in": a, "node": nd}
                            for g, n, a, nd in gaps[:10]],
        "gaps_over_20us_per_step": round(sum(1 for g in gaps if g[0] > 20) * per, 1),
    }


def print_summary(title: str, s: dict) -> None:
    print(f"profile {title}: wall {s['wall_ms_per_step']:.1f} ms/step, CUDA busy {s['cuda_busy_ms_per_step']:.1f}, "
        f"idle {s['cuda_idle_ms_per_step']:.1f} (busy {s['busy_fraction']}), syncs/step {s['syncs_per_step']}, "
        f"launches/step {s['kernel_launch_calls_per_step']}", flush=True)
    for key in ("gpu_ms_by_class", "gpu_ms_by_annotation", "idle_ms_by_annotation", "gpu_ms_by_autograd_node",
                "idle_ms_by_autograd_node", "syncs_by_annotation_per_step"):
        print(f"    {key}: " + ", ".join(f"{k} {v}" for k, v in s[key].items()), flush=True)
    print(f"    release groups/step {s['release_group_steps_per_step']}, release CPU ms/step "
          f"{s['release_group_cpu_ms_per_step']}, defer_add CPU ms/step {s['defer_add_cpu_ms_per_step']}", flush=True)
    for k in s["top_kernels"][:8]:
        print(f"    {k['ms_per_step']:8.2f} ms ×{k['calls_per_step']:<6} {k['name']}", flush=True)
