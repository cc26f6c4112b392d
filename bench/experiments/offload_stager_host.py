"""Host time of the optimizer-state offload's staging per release group (``StateStager``'s
acquire, lookahead prefetches and write-back), on the CPU, without a model.

Gradient release steps each group inside backward's hooks, so the staging's Python runs on the
host between the group's gradient and the next layer's backward kernels; where backward is
host-bound it is exposed time (docs/memory.md, "Optimizer state on the host").  Here: 38 groups
(a Qwen3-4B's 36 layers, the embedding and the final norm in count) of a Lion8bit state shaped
like a decoder layer's (7 matrices, 4 norm weights: 21 leaves), 4 staging slots, the order
backward completes them; the copies are synchronous CPU copies of small buffers, so what is
timed is the Python and dispatcher work.  Prints µs per group and the top of a cProfile.

    python bench/experiments/offload_stager_host.py [--groups 38] [--steps 50]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import pgs.func as pf
from pgs.runtime.optim.offload import StateStager


def layer_params() -> dict:
    out = {f"w{i}": torch.zeros(64, 256) for i in range(7)}
    out.update({f"norm{i}": torch.zeros(64) for i in range(4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=38)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    chain = pf.lion8bit(1e-3, block_size=64, min_8bit_size=256)
    states = {f"g{i}": chain.init(layer_params()) for i in range(args.groups)}
    stager = StateStager(states, states.items(), slots=4)
    order = list(states)
    ahead = len(stager.slots) - 1

    def step() -> None:
        for i, g in enumerate(order):
            dev = stager.acquire(g)
            for h in order[i + 1:i + 1 + ahead]:
                stager.prefetch(h)
            stager.release(g, dev)  # an in-place step: the tree handed back is the one acquired
            for h in order[i + 1:i + 1 + ahead]:
                stager.prefetch(h)

    for _ in range(5):
        step()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    per_group = (time.perf_counter() - t) / args.steps / args.groups
    print(f"{per_group * 1e6:.1f} µs per group, {per_group * args.groups * 1e3:.2f} ms per step of {args.groups} groups")
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(10)])
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
