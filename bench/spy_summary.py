"""Summarise a py-spy ``--format raw`` (collapsed stacks) recording of a host-bound step (the
``sft-step`` suite's ``--spy PREFIX`` writes one per variant).

    python -m bench sft-step --spy /tmp/spy --only pgs_release ...
    python bench/spy_summary.py /tmp/spy.pgs_release.txt [--top 40] [--json out.json]

Stacks under compilation (dynamo, inductor's compile, AOT autograd's lazy backward compile) and
outside a training step (model build, warm-up setup) are dropped; every thread's samples count
(backward's hooks and recomputes run on the autograd thread).  Prints, as shares of the kept
samples: per thread, self time by function (where the host time is spent) and inclusive time
by function (what it is spent for), with the file and function of each frame.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

COMPILING = ("convert_frame.py", "compile_fx.py", "async_compile.py", "codecache.py", "_compile_fx_inner",
             "aot_dispatch_autograd", "fx_codegen_and_compile", "__init__.py:_load_kernel")
FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]+?)(?::(?P<line>\d+))?\)$")


def _frame_name(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    file = m["file"].split("site-packages/")[-1]
    return f"{file}:{m['func']}"


def parse(path: str):
    """[(thread, [frame names, outermost first], samples)]."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            thread = frames[0] if frames[0].startswith("thread") else "?"
            body = frames[1:] if thread != "?" else frames
            rows.append((thread, body, int(count)))
    return rows


def summarise(rows, top: int = 40, keep: str | None = None) -> dict:
    kept = [(t, f, n) for t, f, n in rows
            if not any(c in fr for fr in f for c in COMPILING) and (keep is None or any(keep in fr for fr in f)
                                                                      or "MainThread" not in t)]
    total = sum(n for _, _, n in kept) or 1
    threads = collections.Counter()
    self_t = collections.Counter()
    incl = collections.Counter()
    for t, frames, n in kept:
        threads[t] += n
        names = [_frame_name(fr) for fr in frames]
        if names:
            self_t[names[-1]] += n
        for name in set(names):
            incl[name] += n
    share = lambda c: [(k, round(100 * v / total, 2)) for k, v in c.most_common(top)]  # noqa: E731
    return {"samples": total, "threads": share(threads), "self": share(self_t), "inclusive": share(incl)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--keep", default="variant_setup.<locals>.step",
                   help="main-thread samples count only under a frame containing this (default: the bench's step)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = summarise(parse(args.raw), args.top, args.keep or None)
    print(f"{out['samples']} samples kept")
    for key in ("threads", "self", "inclusive"):
        print(f"--- {key} (% of kept samples)")
        for name, pct in out[key]:
            print(f"{pct:6.2f}  {name[:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
