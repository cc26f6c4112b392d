"""Aten ops of one training step of ``pgs run specs/olmoe_1b_7b.toml`` by origin, beside HF's own
step (forward + loss + backward + ``torch.optim.AdamW``), on the CPU at a tiny OLMoE shape.

On the GPU each aten op that is not a view or an allocation launches at least one kernel (5-10 µs
of host time each, more inside backward's hooks), so a count of the ops pgs runs beyond HF's, by
where they come from, says where a host-bound step's extra time can go before a GPU trace does.
The pgs step is the real loop (``pgs.runtime.loop.train.run`` on the spec, the ``--profile``
hook replaced by a ``TorchDispatchMode`` around steps ``A..B``); the HF step is
``bench/product.py``'s peer (``bench/sft_step.py``'s ``hf_eager``), its ``torch.optim.AdamW`` made ``fused=True`` on the CPU
too, as it is on the GPU.  Each op is put down to the
innermost frame of pgs or transformers on the Python stack:

* ``router telemetry``: pgs/runtime/model/moe.py, pgs/func/losses/moe.py (the hooks, the window);
* ``optimizer``: pgs/runtime/optim/, pgs/func/ (the release hooks' group steps; the 8-bit
  AdamW runs its Triton kernels in Triton's interpreter, ``TRITON_INTERPRET=1``, each counted
  as one launch apart from the aten ops, as tests/test_release_launches.py does);
* ``loss``: pgs/func/losses/ and the objective (pgs/runtime/loop/sft.py); HF's transformers/loss/;
* ``model forward``: transformers, pgs/runtime/model/ (``final_hidden``);
* ``autograd (model)``: backward's own nodes (no frame of pgs or transformers below the
  ``backward()`` call);
* ``health``: the health monitor's update ratio (pgs/runtime/loop/health.py; on its summary
  steps only, every ``train.health_every`` or ``train.log_every`` steps);
* ``control plane``: the loop (train.py, control.py, health.py, metrics.py), the step record.

"launching" leaves out ``HOST_ONLY`` (views, splits, allocations); "syncs" are the ops that
read a tensor's value on the host (``SYNCS``), which on the GPU wait for the device when the
tensor lives there (the table names where each one comes from).  The data worker runs in its
own thread and is not counted (the dispatch mode is per thread).

    python bench/experiments/moe_step_ops.py                    # grouped_mm, step 3, 2 and 3 layers
    python bench/experiments/moe_step_ops.py --impl eager --steps 3:4 --set train.health_every=1
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

import product  # noqa: E402
from test_release_launches import HOST_ONLY, SYNCS  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "olmoe_1b_7b.toml")
#: the CPU shape (bench/moe.py's ``--small``), in the spec's precision: bf16 weights with
#: stochastic rounding and AdamW8bit's Triton kernels, as on the GPU
SHAPE = product.SMALL + ["model.config.num_experts=8", "model.config.num_experts_per_tok=2",
                         "model.dtype=bfloat16", "memory.stochastic_rounding=true",
                         "optimizer.args={weight_decay=0.0, backend=\"triton\", min_8bit_size=256}",
                         "train.log_every=1", "checkpoint.every=0",
                         "checkpoint.export=false", "train.eval_every=0"]
ORIGINS = ("router telemetry", "optimizer", "loss", "model forward", "autograd (model)", "health", "control plane",
           "other")


def origin(frame, backward: bool) -> str:
    """The origin of an op dispatched with ``frame`` innermost (module docstring)."""
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/pgs/runtime/model/moe.py" in path or "/pgs/func/losses/moe.py" in path:
            return "router telemetry"
        if "/pgs/runtime/optim/" in path or ("/pgs/func/" in path and "/pgs/func/losses/" not in path):
            return "optimizer"
        if "/pgs/func/losses/" in path or "/pgs/runtime/loop/sft.py" in path or "/transformers/loss/" in path:
            return "loss"
        if "/sft_step.py" in path:  # the HF step: its backward() call, else its loss
            return "autograd (model)" if backward else "loss"
        if "/transformers/" in path or "/pgs/runtime/model/" in path:
            return "model forward"
        if "/torch/optim/" in path:
            return "optimizer"
        if "/pgs/runtime/loop/health.py" in path:
            return "health"
        if "/pgs/runtime/" in path:
            return "autograd (model)" if backward else "control plane"
        frame = frame.f_back
    return "autograd (model)" if backward else "other"


class Count(TorchDispatchMode):
    """Aten ops by (origin, op name), syncs by origin, Triton kernel runs apart."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs: collections.Counter = collections.Counter()
        self.paused = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused[0]:
            name = func.overloadpacket.__name__
            where = origin(sys._getframe(1), torch._C._current_graph_task_id() != -1)
            self.ops[where][name] += 1
            if name in SYNCS:
                f, at = sys._getframe(1), "?"
                while f is not None:
                    p = f.f_code.co_filename.replace(os.sep, "/")
                    if "/pgs/" in p or "/transformers/" in p or "/bench/" in p:
                        at = f"{p.rsplit('/', 2)[-2]}/{p.rsplit('/', 1)[-1]}:{f.f_lineno}"
                        break
                    f = f.f_back
                self.syncs[at] += 1
        return func(*args, **(kwargs or {}))


def _count_triton(mode: Count, counting: dict):
    """Triton kernel runs (interpreter) while ``counting["on"]``, the dispatch counter paused
    inside them; ``(Counter, restore)``."""
    import triton.runtime.interpreter as TI

    kernels = collections.Counter()
    run = TI.InterpretedFunction.run

    def counted(self, *a, **k):
        mode.paused[0] += 1
        if counting["on"]:
            kernels[self.fn.__name__] += 1
        try:
            return run(self, *a, **k)
        finally:
            mode.paused[0] -= 1

    def restore():
        TI.InterpretedFunction.run = run

    TI.InterpretedFunction.run = counted
    return kernels, restore


def pgs_step_ops(impl: str, steps: tuple[int, int], overrides=()) -> tuple[Count, collections.Counter]:
    """The aten ops (and Triton kernels) of ``pgs run``'s steps ``A..B`` of the spec."""
    from pgs.runtime.loop import train
    from pgs.runtime.spec.load import load_spec

    mode = Count()
    counting = {"on": False}
    kernels, restore = _count_triton(mode, counting)

    class Hook:  # in place of trace.Profiler: the loop calls before(step) / after(step) / close()
        def __init__(self, run_dir, window, device):
            self.first, self.last = window

        def before(self, step):
            if step == self.first:
                kernels.clear()
                mode.__enter__()
                counting["on"] = True

        def after(self, step):
            if step == self.last and counting["on"]:
                mode.__exit__(None, None, None)
                counting["on"] = False

        def close(self):
            if counting["on"]:
                mode.__exit__(None, None, None)
                counting["on"] = False

    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(SPEC, SHAPE + [f"model.experts_implementation={impl}", f"train.steps={steps[1] + 1}",
                                        f"checkpoint.dir={tmp}/run"] + list(overrides))
        saved, train.Profiler = train.Profiler, Hook
        try:
            code = train.run(spec, profile=steps)
        finally:
            train.Profiler = saved
            restore()
    if code != 0:
        raise SystemExit(f"pgs run exited {code}")
    return mode, collections.Counter(kernels)


def hf_step_ops(impl: str, steps: tuple[int, int], overrides=()) -> Count:
    """The aten ops of bench/product.py's HF peer (``hf_eager``) on the same shape and batches."""
    import sft_step

    mode = Count()
    calls = {"n": 0}
    peer = argparse.Namespace(small=False, peer="hf_eager", steps=steps[1], skip=0,
                              set=SHAPE + [f"model.experts_implementation={impl}"] + list(overrides))
    real = sft_step.variant_setup

    def counted_setup(*a, **k):
        step, opt = real(*a, **k)

        def wrapped(*x):
            calls["n"] += 1
            if steps[0] <= calls["n"] <= steps[1]:
                with mode:
                    return step(*x)
            return step(*x)

        return wrapped, opt

    class FusedAdamW(torch.optim.AdamW):  # the GPU's optimizer: fused (one multi-tensor op)
        def __init__(self, params, **kw):
            super().__init__(params, **{**kw, "fused": True})

    sft_step.variant_setup, adamw = counted_setup, torch.optim.AdamW
    torch.optim.AdamW = FusedAdamW
    try:
        product.run_peer(SPEC, peer)
    finally:
        sft_step.variant_setup, torch.optim.AdamW = real, adamw
    return mode


def launches(mode: Count, kernels: collections.Counter, where: str, per: int) -> float:
    """Launching aten ops of ``where`` per step (the optimizer's Triton kernels included)."""
    c = mode.ops.get(where, collections.Counter())
    n = sum(v for k, v in c.items() if k not in HOST_ONLY)
    return (n + (sum(kernels.values()) if where == "optimizer" else 0)) / per


def table(counts: dict, layers: list[int], at: int, per: int) -> str:
    """Launching ops per step by origin: for each side, the fixed part and the part per decoder
    layer (a line through the two layer counts), and the total at ``at`` layers."""
    lo, hi = layers[0], layers[-1]
    sides = sorted({s for s, _ in counts}, key=lambda s: s != "pgs")
    head = []
    for s in sides:
        head += [f"{s} fixed", f"{s} per layer", f"{s} at {at} layers"]
    lines = ["| origin | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    totals = collections.Counter()
    for where in ORIGINS:
        cells = []
        for s in sides:
            a = launches(*counts[(s, lo)], where, per)
            b = launches(*counts[(s, hi)], where, per)
            slope = (b - a) / (hi - lo) if hi != lo else 0.0
            fixed = a - slope * lo
            totals[(s, 0)] += fixed
            totals[(s, 1)] += slope
            cells += [f"{fixed:.0f}", f"{slope:.1f}", f"{fixed + slope * at:.0f}"]
        if any(c not in ("0", "0.0", "-0", "-0.0") for c in cells):
            lines.append(f"| {where} | " + " | ".join(cells) + " |")
    cells = []
    for s in sides:
        cells += [f"{totals[(s, 0)]:.0f}", f"{totals[(s, 1)]:.1f}", f"{totals[(s, 0)] + totals[(s, 1)] * at:.0f}"]
    lines.append("| **all** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="grouped_mm", help="model.experts_implementation")
    p.add_argument("--steps", default="3:3", help="the steps counted, A:B (after warm-up: caches filled)")
    p.add_argument("--layers", default="2,3", help="two decoder-layer counts (the per-layer part is their difference)")
    p.add_argument("--at", type=int, default=16, help="the layer count to extrapolate to (OLMoE-1B-7B: 16)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more spec overrides (both sides)")
    p.add_argument("--top", type=int, default=25, help="ops listed per origin")
    p.add_argument("--no-hf", action="store_true", help="the pgs step only")
    args = p.parse_args(argv)
    a, b = (int(x) for x in args.steps.split(":"))
    per = b - a + 1
    layers = [int(x) for x in args.layers.split(",")]
    torch.set_num_threads(1)
    counts = {}
    for n in layers:
        sets = [f"model.config.num_hidden_layers={n}"] + args.set
        counts[("pgs", n)] = pgs_step_ops(args.impl, (a, b), sets)
        if not args.no_hf:
            counts[("HF", n)] = (hf_step_ops(args.impl, (a, b), sets), collections.Counter())
    print(f"\nlaunching aten ops per step ({args.impl}, steps {a}..{b}; the optimizer's Triton kernels "
          f"included; layers {args.layers})\n")
    print(table(counts, layers, args.at, per))
    for (side, n), (mode, kernels) in counts.items():
        print(f"\n## {side}, {n} layers: Triton kernels {dict(kernels)}; host reads (syncs on a GPU when the "
              f"tensor lives there) {dict(mode.syncs)}")
        for where in ORIGINS:
            c = mode.ops.get(where)
            if c:
                top = ", ".join(f"{k} {v / per:.0f}" for k, v in c.most_common(args.top) if k not in HOST_ONLY)
                print(f"- {where}: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
