"""Where pgs_release's SFT step time goes (issue 8): a profile, a sync census and a few variants.

One GPU call (an H200; about 2-2.5 minutes at both shapes, cold compile caches included):

    python bench/experiments/sft_probe.py --out $OUT/probe.json --trace-dir $OUT
    python bench/experiments/sft_probe.py --small --out /tmp/probe.json          # CPU smoke
    python bench/experiments/sft_probe.py --selftest                             # trace summary only

What it does, per shape, on ONE model built and compiled once (every variant below differs only
in what the step does, so no variant pays a second compile):

Qwen3-4B, 1×4096, full activation checkpointing, compiled layers, lion8bit + SR in backward:

1. ``base``: exactly ``bench/sft_step.py``'s ``pgs_release`` (loss chunk 256, deferred head).
2. A sync census of one step: ``torch.cuda.set_sync_debug_mode("warn")`` with every warning
   recorded, counted by the Python line that synchronized.
3. A ``torch.profiler`` trace of 2 steps, summarised (``summarize_trace``): wall vs CUDA busy
   time per step (the idle rest is host-bound time), top kernels, GPU time by kernel class,
   GPU time and idle time by the code that launched the kernels (the phase annotations of the
   step, the release's group steps, the deferred head gradient, the autograd node), host syncs.
4. Variants with the two changes this probe tests, applied as monkeypatches here (the library
   files are another helper's, see the report):
   - ``nosync``: ``hp_tensor`` builds its hyperparameter vector from a cached device tensor,
     not three ``torch.tensor(x, device=cuda)`` per tensor (each a blocking H2D copy: a stream
     sync per 8-bit tensor inside backward, ~250 per step at 4B).
   - ``kadd``: the deferred head gradient (``DeferredHeadGrad.add_to``) rebuilt with the loss's
     Triton passes (bf16 logits, gradient in place, scale folded into the row coefficients)
     instead of fp32 logits + softmax + gradient (8 B per chunk element instead of 2), which
     is what lets the loss chunk grow from 256 to 1024-2048 rows at the same peak.
   The probe carries both versions of each (``hp_tensor_sync``/``hp_tensor_nosync``,
   ``add_to_torch``/``add_to_kernels``), so its rows mean the same with or without
   the fixes applied to the library (they are, since commit 8abfe76).
   Rows: ``nosync`` (chunk 256), ``nosync_kadd_c1024``, ``nosync_kadd_c2048``,
   ``nosync_c1024_nodefer`` (the head gradient computed in the loss's forward and held through
   backward: +V·D bytes, one head matmul less), ``noupdate_c1024`` (the release hooks drop the
   gradients without updating: forward + loss + backward alone, the floor the optimizer adds
   to), then a second profile of ``nosync_kadd_c1024``; then the memory levers: the layer
   inputs offloaded to pinned host memory (``apply_activation_checkpointing(...,
   offload=True)``) at chunks 256 and 1024, and one release group per parameter.

Qwen3-0.6B, 8×4096 packed: ``ac_base``, ``ac_nosync_kadd`` (chunk 2048), then checkpointing is
removed from the same compiled model: ``noac_base``, ``noac_nosync_kadd``.

Each timed row: warm-up steps, then ``--steps`` timed steps (tok/s, step ms, MFU as in
sft_step.py, peak allocated over the timed steps and over warm-up + timed).  ``--budget-s``
skips what would start after that many seconds (the JSON is written after every row).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings

if "--triton-on-cpu" in sys.argv:  # before triton is imported: its interpreter and pgs's CPU switch
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("PGS_TRITON_ON_CPU", "1")

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))
from sft_step import H200_BF16_FLOPS, SHAPES, SMALL_SHAPES, build, flops_per_token, make_batch  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- the two patches

def hp_tensor_nosync(device, *values):
    """``pgs.func.kernels.fused_transform.hp_tensor`` without a blocking host-to-device copy per call.

    Same values (each number and each tensor through float64 to float32): the numbers come
    from the module's cached device tensor (zeros where a tensor goes), the tensors are copied
    in on the device."""
    from pgs.func.kernels import fused_transform as F

    if all(not isinstance(v, torch.Tensor) for v in values):
        return F._hp_cached(device, tuple(float(v) for v in values))
    base = F._hp_cached(device, tuple(0.0 if isinstance(v, torch.Tensor) else float(v) for v in values))
    out = base.clone()
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            out[i] = v.to(device=device, dtype=torch.float64).reshape(()).to(torch.float32)
    return out


@torch.no_grad()
def add_to_kernels(self, out):
    """``DeferredHeadGrad.add_to`` through ``triton_ce``'s gradient pass where the forward used it.

    Per chunk: z = H_k Wᵀ in W's dtype, overwritten in place by s·(coef·p − gate·e_y) (the
    scale s folded into the fp32 row coefficients), then out += zᵀ H_k.  2 B per chunk element
    instead of the torch path's fp32 logits + fp32 softmax (8 B)."""
    from pgs.func.losses import chunked as C

    orig = add_to_torch
    if self.done or self._saved is None or self.scale is None:
        return orig(self, out)
    h, W, bias, labels, rows_all, gates, lses, plan = self._saved
    if bias is not None or out.dtype != W.dtype or not C._use_kernels(h, W, plan, out):
        return orig(self, out)
    from pgs.func.losses import triton_ce

    scale = self.scale.to(torch.float32)
    for start in range(0, rows_all.numel(), plan.chunk_size):
        rows = rows_all[start : start + plan.chunk_size]
        stop = start + rows.numel()
        hc = h.index_select(0, rows)
        y = labels.index_select(0, rows)
        gate = gates[start:stop].float()
        lse = lses[start:stop].float()
        coef = (gate + 2 * plan.z_loss * lse) * scale
        z = hc @ W.t()
        g = triton_ce.grad_in_place(z, y, None, plan.softcap, lse, coef, gate * scale)
        out.addmm_(g.t(), hc)
        del z, g
    self._saved, self.scale, self.done = None, None, True
    return out


# The "before" versions, as the library had them at commit af4c42f, so that the probe measures
# the same pair whether or not bench/experiments/issue8_sync_and_rebuild.diff has been applied.

def hp_tensor_sync(device, *values):
    """``hp_tensor`` as before: a ``torch.tensor(x, device=...)`` per number when any value is a
    tensor (a blocking host-to-device copy each)."""
    from pgs.func.kernels import fused_transform as F

    if all(not isinstance(v, torch.Tensor) for v in values):
        return F._hp_cached(device, tuple(float(v) for v in values))
    parts = [v.to(device=device, dtype=torch.float64).reshape(()) if isinstance(v, torch.Tensor)
             else torch.tensor(float(v), dtype=torch.float64, device=device) for v in values]
    return torch.stack(parts).to(torch.float32)


@torch.no_grad()
def add_to_torch(self, out):
    """``DeferredHeadGrad.add_to`` as before: fp32 logits, softmax and gradient per chunk."""
    from pgs.func.losses import chunked as C

    if self.done or self._saved is None:
        raise RuntimeError("deferred head gradient: nothing to add (not saved, or already added)")
    if self.scale is None:
        raise RuntimeError("deferred head gradient: backward has not reached the loss yet")
    h, W, bias, labels, rows_all, gates, lses, plan = self._saved
    scale = self.scale
    for start in range(0, rows_all.numel(), plan.chunk_size):
        rows = rows_all[start : start + plan.chunk_size]
        hc = h.index_select(0, rows)
        y = labels.index_select(0, rows)
        gate, lse = gates[start : start + rows.numel()], lses[start : start + rows.numel()]
        g = C._logit_grad(C._chunk_logits(hc, W, bias, plan.softcap), lse, y, gate, plan)
        g.mul_(scale.to(g.dtype))
        if out.dtype == W.dtype:
            out.addmm_(g.to(W.dtype).t(), hc.to(W.dtype))
        else:
            out.addmm_(g.to(out.dtype).t(), hc.to(out.dtype))
        del g
    self._saved, self.scale, self.done = None, None, True
    return out


_ORIGINAL = {"add_to": add_to_torch, "hp": hp_tensor_sync}


def set_patches(nosync: bool, kadd: bool) -> None:
    """Install the after (True) or the before (False) version of each change (module and class
    attributes, read at call time)."""
    import pgs.func.adam8bit as A
    import pgs.func.lion8bit_direction as L
    from pgs.func.kernels import fused_transform as F
    from pgs.func.losses import chunked as C

    hp = hp_tensor_nosync if nosync else hp_tensor_sync
    for mod in (F, L, A):
        mod.hp_tensor = hp
    C.DeferredHeadGrad.add_to = add_to_kernels if kadd else add_to_torch
    C.DeferredHeadGrad.KERNEL_PASS = kadd


# ----------------------------------------------------------------------------- the pgs step

class PgsModel:
    """One model (checkpointed, compiled layers) with ``GradientRelease(lion8bit)``; ``step(cfg)``."""

    def __init__(self, shape: str, args, device):
        from pgs.runtime.model.layers import apply_activation_checkpointing, compile_layers

        self.shape = shape
        self.table, self.batch, self.seq = (SMALL_SHAPES if args.small else SHAPES)[shape]
        self.packed = shape in ("qwen3-0.6b", "tiny")
        self.device = device
        self.model = build(self.table, device)
        self.ac = "full"
        apply_activation_checkpointing(self.model, "full")
        compile_kw = {"backend": args.compile_backend} if args.compile_backend else {}
        compile_layers(self.model, **compile_kw)
        self.backend = "triton" if (args.small and args.triton_on_cpu) else "auto"
        self.noupdate = False
        self.make_release("layer")
        self.gen = torch.Generator().manual_seed(1)
        self.flops = flops_per_token(self.model, self.seq)

    def make_release(self, groups: str) -> None:
        """A fresh ``GradientRelease`` (lion8bit, SR, fused) with ``groups``; the old one's hooks go."""
        import pgs.func as pf
        from pgs.runtime.optim.release import GradientRelease

        if getattr(self, "release", None) is not None:
            self.release.remove()
            self.release = None
            gc.collect()
        self.groups = groups
        self.release = GradientRelease(pf.lion8bit(1e-5, backend=self.backend), self.model, groups=groups,
                                       stochastic_rounding=True, track_grad_norm=False, fused=True)
        inner = self.release._step_group

        def annotated_group_step(group):
            with torch.profiler.record_function("probe.release_group"):
                (self._drop_group if self.noupdate else inner)(group)

        self.release._step_group = annotated_group_step  # what finish() calls
        self.release._arrivals.on_complete = annotated_group_step  # what the hooks call

    def offload_inputs(self) -> None:
        """Full checkpointing with the layer inputs in pinned host memory (the compiled layer
        forwards are kept: no recompile)."""
        from pgs.runtime.model.layers import apply_activation_checkpointing

        apply_activation_checkpointing(self.model, "full", offload=True)
        self.ac = "full+offload"

    @torch.no_grad()
    def _drop_group(self, group: str) -> None:
        """A group "step" without the update (the ``noupdate`` row: forward, loss and backward
        alone): the deferred contributions still run, then the gradients are dropped."""
        rel = self.release
        for n in rel.groups[group]:
            p = rel.params[n]
            fns = rel._before.pop(n, None)
            if fns:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                for fn in fns:
                    fn(p.grad)
            p.grad = None
        rel._arrivals.done.add(group)

    def remove_checkpointing(self) -> None:
        from pgs.runtime.model.layers import remove_activation_checkpointing

        remove_activation_checkpointing(self.model)  # keeps the compiled layer forwards
        self.ac = "none"

    def batch_data(self):
        return make_batch(self.model.config.vocab_size, self.batch, self.seq, self.device, self.packed, self.gen)

    def step(self, ids, pos, cfg: dict):
        from pgs.func.losses import token_loss
        from pgs.runtime.model.build import final_hidden, output_head

        rf = torch.profiler.record_function
        with rf("probe.step"):
            with rf("probe.fwd_model"):
                h = final_hidden(self.model, ids, pos)
            with rf("probe.fwd_loss"):
                W, bias, softcap = output_head(self.model)
                labels = torch.roll(ids, -1, dims=1)
                labels[:, -1] = -100
                defer = cfg["defer"] and W is self.model.get_input_embeddings().weight
                r = token_loss(h, W, labels, bias=bias, softcap=softcap, chunk_size=cfg["chunk"],
                               defer_head_grad=defer)
                if defer:
                    hg = r.head_grad

                    def add(buf):
                        with rf("probe.defer_add"):
                            hg.add_to(buf)

                    self.release.before_step(W, add)
                loss = r.loss_sum / r.num_valid
            with rf("probe.bwd"):
                loss.backward()
        return loss.detach()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_row(pm: PgsModel, name: str, cfg: dict, warmup: int, steps: int) -> dict:
    cuda = pm.device.type == "cuda"
    set_patches(cfg["nosync"], cfg["kadd"])
    pm.noupdate = cfg.get("noupdate", False)
    out = {"row": name, "shape": pm.shape, "ac": pm.ac, "groups": pm.groups, **cfg}
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        g0, p0 = pm.release.fused_group_steps, pm.release.plain_group_steps
        loss = None
        for _ in range(warmup):
            loss = pm.step(*pm.batch_data(), cfg)
        sync(pm.device)
        if cuda:
            out["peak_with_warmup_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        data = [pm.batch_data() for _ in range(steps)]
        sync(pm.device)
        t = time.perf_counter()
        for ids, pos in data:
            loss = pm.step(ids, pos, cfg)
        sync(pm.device)
        dt = time.perf_counter() - t
        tokens = pm.batch * pm.seq * steps
        out.update(tok_s=tokens / dt, step_ms=1e3 * dt / steps, mfu=pm.flops * tokens / dt / H200_BF16_FLOPS,
                   loss=float(loss), fused_group_steps=pm.release.fused_group_steps - g0,
                   plain_group_steps=pm.release.plain_group_steps - p0)
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_with_warmup_gib"] = max(out["peak_with_warmup_gib"], out["peak_gib"])
    except torch.OutOfMemoryError as err:
        out["error"] = f"OOM: {str(err).splitlines()[0]}"
        pm.release.zero_grad()
        pm.release._arrivals.reset()
        gc.collect()
        torch.cuda.empty_cache()
    except Exception as err:  # noqa: BLE001 - a probe reports every failure and goes on
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc(limit=8)
    finally:
        set_patches(False, False)
        pm.noupdate = False
    nan = float("nan")
    msg = out.get("error") or (f"{out['tok_s']:8.0f} tok/s  {out['step_ms']:6.1f} ms  MFU {out['mfu']:.3f}  "
                               f"peak {out.get('peak_gib', nan):.2f} GiB "
                               f"(w/ warm-up {out.get('peak_with_warmup_gib', nan):.2f})  loss {out['loss']:.3f}")
    log(f"{pm.shape:>10} {name:<24} {msg}")
    return out


def sync_census(pm: PgsModel, cfg: dict) -> dict:
    """One step under ``set_sync_debug_mode("warn")``: synchronizing calls by Python line."""
    if pm.device.type != "cuda":
        return {"skipped": "no CUDA"}
    set_patches(cfg["nosync"], cfg["kadd"])
    ids, pos = pm.batch_data()
    sync(pm.device)
    where: collections.Counter = collections.Counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pm.step(ids, pos, cfg)
                torch.cuda.set_sync_debug_mode(0)
                sync(pm.device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                where[f"{os.path.relpath(w.filename, os.path.dirname(BENCH))}:{w.lineno}"] += 1
    finally:
        set_patches(False, False)
    out = {"syncs": sum(where.values()), "by_line": dict(where.most_common(12))}
    log(f"sync census {cfg}: {out['syncs']} syncs; " + ", ".join(f"{k} ×{v}" for k, v in where.most_common(5)))
    return out


def profile_row(pm: PgsModel, name: str, cfg: dict, steps: int, trace_dir: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = pm.device.type == "cuda"
    set_patches(cfg["nosync"], cfg["kadd"])
    try:
        data = [pm.batch_data() for _ in range(steps)]
        pm.step(*pm.batch_data(), cfg)  # warm with this config (its first call of the patched paths)
        sync(pm.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            for ids, pos in data:
                pm.step(ids, pos, cfg)
            with torch.profiler.record_function("probe.sync"):
                sync(pm.device)
            wall = time.perf_counter() - t
        tmp = tempfile.mkdtemp()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        summary = summarize_trace(events, steps)
        summary["wall_ms_per_step_timer"] = 1e3 * wall / steps
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            dest = os.path.join(trace_dir, f"trace_{pm.shape}_{name}.json.gz")
            with open(path, "rb") as src, gzip.open(dest, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            if os.path.getsize(dest) > 15 * 2**20:  # what comes back is limited to 16 MiB a file
                os.remove(dest)
                summary["trace_file"] = "too large, dropped"
            else:
                summary["trace_file"] = os.path.basename(dest)
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        set_patches(False, False)
    print_summary(f"{pm.shape} {name}", summary)
    return {"row": name, "shape": pm.shape, **cfg, "profile": summary}


# ----------------------------------------------------------------------------- trace summary

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
    log(f"profile {title}: wall {s['wall_ms_per_step']:.1f} ms/step, CUDA busy {s['cuda_busy_ms_per_step']:.1f}, "
        f"idle {s['cuda_idle_ms_per_step']:.1f} (busy {s['busy_fraction']}), syncs/step {s['syncs_per_step']}, "
        f"launches/step {s['kernel_launch_calls_per_step']}")
    for key in ("gpu_ms_by_class", "gpu_ms_by_annotation", "idle_ms_by_annotation", "gpu_ms_by_autograd_node",
                "idle_ms_by_autograd_node", "syncs_by_annotation_per_step"):
        print(f"    {key}: " + ", ".join(f"{k} {v}" for k, v in s[key].items()), flush=True)
    print(f"    release groups/step {s['release_group_steps_per_step']}, release CPU ms/step "
          f"{s['release_group_cpu_ms_per_step']}, defer_add CPU ms/step {s['defer_add_cpu_ms_per_step']}", flush=True)
    for k in s["top_kernels"][:8]:
        print(f"    {k['ms_per_step']:8.2f} ms ×{k['calls_per_step']:<6} {k['name']}", flush=True)


def selftest() -> int:
    """The summary on a hand-made trace (two kernels, one gap, one sync, nested annotations)."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "probe.step", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "probe.bwd", "ts": 50, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "probe.release_group", "ts": 60, "dur": 10, "tid": 2},
        {"ph": "X", "cat": "user_annotation", "name": "probe.sync", "ts": 100, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": NODE_PREFIX + "CompiledFunctionBackward", "ts": 55, "dur": 10, "tid": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 1, "tid": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 62, "dur": 1, "tid": 2,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 64, "dur": 3, "tid": 2,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 20, "dur": 80, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "lion8bit_kernel", "ts": 150, "dur": 30, "args": {"correlation": 2}},
    ]
    s = summarize_trace(ev, 1)
    us = lambda ms: round(ms * 1e3, 1)  # noqa: E731
    assert us(s["wall_ms_per_step"]) == 200, s
    assert us(s["cuda_busy_ms_per_step"]) == 110, s
    assert us(s["cuda_idle_ms_per_step"]) == 90, s  # 0-20, 100-150, 180-200
    assert s["gpu_ms_by_class"] == {"matmul": 0.08, "optimizer (8-bit kernels)": 0.03}, s
    assert s["idle_ms_by_annotation"] == {"probe.release_group": 0.05, "probe.step": 0.02,
                                          "(after the last kernel)": 0.02}, s
    assert s["idle_ms_by_autograd_node"] == {"CompiledFunctionBackward": 0.05, "(no autograd node)": 0.02}, s
    assert s["syncs_by_annotation_per_step"] == {"probe.release_group": 1.0}, s
    assert s["release_group_cpu_ms_per_step"] == 0.01, s
    print("selftest ok")
    return 0


def check_patches(device) -> dict:
    """The two patches against the library's own functions on a small problem (on the CPU the
    kernels need ``--triton-on-cpu``): hp vectors equal exactly; head gradients of the kernel
    and the torch ``add_to`` against each other and against a dense fp32 reference (relative
    to the largest entry)."""
    from pgs.func.losses import chunked as C
    from pgs.func.losses import token_loss

    import importlib

    set_patches(True, True)
    out = {"installed": all(importlib.import_module(m).hp_tensor is hp_tensor_nosync
                            for m in ("pgs.func.lion8bit_direction", "pgs.func.adam8bit", "pgs.func.kernels.fused_transform"))
           and C.DeferredHeadGrad.add_to is add_to_kernels}
    set_patches(False, False)
    out["removed"] = (importlib.import_module("pgs.func.lion8bit_direction").hp_tensor is hp_tensor_sync
                      and C.DeferredHeadGrad.add_to is add_to_torch)
    lr = torch.full((), 3e-5, dtype=torch.float64, device=device)
    hp = _ORIGINAL["hp"]
    out["hp_equal"] = (bool(torch.equal(hp(device, 0.1, 0.01, lr, 0.0), hp_tensor_nosync(device, 0.1, 0.01, lr, 0.0)))
                       and bool(torch.equal(hp(device, 0.1, 0.5), hp_tensor_nosync(device, 0.1, 0.5))))
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        n, d, v = 300, 64, 1000
        h = (torch.randn(n, d, generator=g) * 0.7).to(device, dtype).requires_grad_()
        W = (torch.randn(v, d, generator=g) * 0.3).to(device, dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), generator=g).to(device)
        labels[::7] = -100
        grads = []
        for kadd in (False, True):
            r = token_loss(h, W, labels, backend="chunked", chunk_size=64, defer_head_grad=True)
            (r.loss_sum * 0.37).backward()
            buf = torch.zeros_like(W)
            (add_to_kernels if kadd else _ORIGINAL["add_to"])(r.head_grad, buf)
            grads.append(buf.float())
            h.grad = None
        ref = _ref_grad(h, W, labels)
        top = ref.abs().max().item()
        name = str(dtype).replace("torch.", "")
        out[f"{name}_kadd_vs_torch"] = (grads[1] - grads[0]).abs().max().item() / top
        out[f"{name}_torch_vs_fp32"] = (grads[0] - ref).abs().max().item() / top
        out[f"{name}_kadd_vs_fp32"] = (grads[1] - ref).abs().max().item() / top
    out["kernels_used"] = C._use_kernels(h, W, C._Plan(None, None, -100, None, 0.0, 64, None, True, False, False, True),
                                         None)
    log(f"patch check: {out}")
    return out


def _ref_grad(h, W, labels):
    """0.37 · ∂(Σ CE)/∂W in fp32 (dense)."""
    W32 = W.detach().float().requires_grad_()
    z = h.detach().float() @ W32.t()
    loss = torch.nn.functional.cross_entropy(z, labels, ignore_index=-100, reduction="sum") * 0.37
    loss.backward()
    return W32.grad


# ----------------------------------------------------------------------------- main

def cfg(chunk, nosync=False, kadd=False, defer=True) -> dict:
    return {"chunk": chunk, "nosync": nosync, "kadd": kadd, "defer": defer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/sft_probe.json")
    p.add_argument("--trace-dir", default=None, help="write gzipped chrome traces here (each ≤ 15 MiB)")
    p.add_argument("--shapes", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--small", action="store_true", help="the tiny shape on the CPU (a smoke run)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per row (the first row: +1)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1e9, help="start nothing after this many seconds")
    p.add_argument("--triton-on-cpu", action="store_true")
    p.add_argument("--compile-backend", default=None)
    p.add_argument("--selftest", action="store_true")
    args = p.parse_args(argv)
    if args.selftest:
        return selftest()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.small and device.type == "cpu" and args.compile_backend is None:
        args.compile_backend = "eager"
    shapes = ["tiny"] if args.small else [s for s in args.shapes.split(",") if s]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "argv": sys.argv[1:], "steps": args.steps, "warmup": args.warmup}
    rows: list = []

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)

    def left() -> bool:
        ok = time.perf_counter() - T0 < args.budget_s
        if not ok:
            log("budget spent: skipping the rest")
        return ok

    def guarded(fn, *a, **kw):
        try:
            rows.append(fn(*a, **kw))
        except Exception as err:  # noqa: BLE001
            rows.append({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8),
                         "call": getattr(fn, "__name__", str(fn))})
            log(f"{getattr(fn, '__name__', fn)} failed: {err}")
        write()

    guarded(lambda: {"row": "patch_check", **check_patches(device)})
    big = {"qwen3-4b": 256, "qwen3-0.6b": 2048, "tiny": 32}
    for shape in shapes:
        if not left():
            break
        log(f"building {shape}")
        pm = None
        try:
            pm = PgsModel(shape, args, device)
            c0 = big[shape]
            w, n = args.warmup, args.steps
            if shape in ("qwen3-4b", "tiny"):
                c1, c2 = (1024, 2048) if shape == "qwen3-4b" else (64, 128)
                guarded(timed_row, pm, "base", cfg(c0), w + 1, n)
                if left():
                    guarded(lambda: {"row": "sync_census_base", "shape": shape, **sync_census(pm, cfg(c0))})
                if left():
                    guarded(profile_row, pm, "base", cfg(c0), args.profile_steps, args.trace_dir)
                if left():
                    guarded(timed_row, pm, "nosync", cfg(c0, nosync=True), w, n)
                if left():
                    guarded(lambda: {"row": "sync_census_nosync", "shape": shape,
                                     **sync_census(pm, cfg(c1, nosync=True, kadd=True))})
                if left():
                    guarded(timed_row, pm, f"nosync_kadd_c{c1}", cfg(c1, nosync=True, kadd=True), w, n)
                if left():
                    guarded(timed_row, pm, f"nosync_kadd_c{c2}", cfg(c2, nosync=True, kadd=True), w, n)
                if left():
                    guarded(timed_row, pm, f"nosync_c{c1}_nodefer", cfg(c1, nosync=True, defer=False), w, n)
                if left():
                    guarded(timed_row, pm, f"noupdate_c{c1}", {**cfg(c1, nosync=True, kadd=True), "noupdate": True},
                            w, n)
                if left():
                    guarded(profile_row, pm, f"nosync_kadd_c{c1}", cfg(c1, nosync=True, kadd=True),
                            args.profile_steps, args.trace_dir)
                # the memory levers: layer inputs in host memory (-0.70 GiB of kept inputs at 4B),
                # then one release group per parameter (a layer's gradients never all at once)
                if left():
                    pm.offload_inputs()
                    guarded(timed_row, pm, f"offload_nosync_kadd_c{c0}", cfg(c0, nosync=True, kadd=True), w, n)
                if left():
                    guarded(timed_row, pm, f"offload_nosync_kadd_c{c1}", cfg(c1, nosync=True, kadd=True), w, n)
                if left():
                    pm.make_release("parameter")
                    guarded(timed_row, pm, f"offload_pergroup_nosync_kadd_c{c0}", cfg(c0, nosync=True, kadd=True),
                            w, n)
            if shape in ("qwen3-0.6b", "tiny"):
                guarded(timed_row, pm, "ac_base", cfg(c0), w + 1, n)
                if left():
                    guarded(timed_row, pm, "ac_nosync_kadd", cfg(c0, nosync=True, kadd=True), w, n)
                if left():
                    pm.remove_checkpointing()
                    guarded(timed_row, pm, "noac_base", cfg(c0), w + 1, n)
                if left():
                    guarded(timed_row, pm, "noac_nosync_kadd", cfg(c0, nosync=True, kadd=True), w, n)
        except Exception as err:  # noqa: BLE001
            rows.append({"shape": shape, "error": f"{type(err).__name__}: {err}",
                         "traceback": traceback.format_exc(limit=8)})
            log(f"{shape} failed: {err}")
            write()
        finally:
            try:  # graph breaks and recompiles of the compiled layers over this shape's rows
                from torch._dynamo.utils import counters

                rows.append({"row": "dynamo_counters", "shape": shape, "stats": dict(counters["stats"]),
                             "graph_breaks": dict(collections.Counter(counters["graph_break"]).most_common(8)),
                             "recompiles": dict(collections.Counter(counters.get("recompiles", {})).most_common(8))})
                log(f"dynamo {shape}: {rows[-1]['stats']}; graph breaks {sum(counters['graph_break'].values())}")
                counters.clear()
            except Exception as err:  # noqa: BLE001
                log(f"dynamo counters unavailable: {err}")
            write()
            if pm is not None:
                pm.release.remove()
            pm = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                torch._dynamo.reset()
            except Exception:  # noqa: BLE001
                pass
    write()
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
