"""Which Python lines launch the eager reductions and copies of a pgs step (one GPU): profiles
one step of ``bench/sft_step.py``'s variant with stacks and prints the aten ops with the most
device time outside matmuls and compiled kernels, each with its launching stack.

    python3 bench/experiments/reduce_stacks.py [VARIANT] [SHAPE]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "bench")
import sft_step as S  # noqa: E402


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "pgs_release_noac_varlen"
    shape = sys.argv[2] if len(sys.argv) > 2 else "qwen3-0.6b"
    table, batch, seq = {**S.SHAPES, **S.SMALL_SHAPES}[shape]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = argparse.Namespace(compile_backend=None, small=False, triton_on_cpu=False, mlp_tiles=4, no_defer=False,
                              defer=False)
    model = S.build(table, torch.device(dev), S.split_name(name)[1])
    step, _ = S.variant_setup(name, model, args, S.default_loss_chunk(shape), S.SLAB_ROWS[shape])
    gen = torch.Generator().manual_seed(1)
    data = [S.make_batch(table["vocab_size"] if "vocab_size" in table else model.config.vocab_size, batch, seq,
                         dev, shape in S.PACKED, gen) for _ in range(3)]
    for d in data[:2]:
        step(*d)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(*data[2])
        if dev == "cuda":
            torch.cuda.synchronize()
    agg: dict = {}
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in ("aten::mm", "aten::addmm", "aten::bmm"):
            continue
        t = e.self_device_time_total
        if t <= 0 and dev == "cuda":
            continue
        chain, p = [], e.cpu_parent
        while p is not None and len(chain) < 7:
            if (".py(" in p.name and "torch/nn/modules/module.py" not in p.name) or "Backward" in p.name \
                    or "AccumulateGrad" in p.name or "CompiledFxGraph" in p.name:
                chain.append(p.name)
            p = p.cpu_parent
        key = (e.name, tuple(chain))
        n, tot = agg.get(key, (0, 0.0))
        agg[key] = (n + 1, tot + t)
    for (op, chain), (n, tot) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"{tot / 1e3:8.2f} ms  {n:4d}x  {op}")
        for line in chain:
            print("        ", line[:160])

if __name__ == "__main__":
    main()
