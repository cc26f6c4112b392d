"""Print the headline numbers of bench result files, one line a row (what bench/device.sh shows
at the end of a call): ``python bench/summarize.py RESULT.json [...]``.

Rows are read from every suite's JSON: ``rows`` / ``variants`` / ``results`` as a mapping of
name to row (optim-8bit, optim-step, optim-muon), ``results`` as a list of rows named by
``variant``, ``backend`` or ``setup`` (sft-step, sft-converge, loss-memory, product, distill, moe;
long-context's also by shape and length, with its status), ``runs`` (fsdp); numbers are rounded,
and a missing or unreadable file is one line saying so.
"""

from __future__ import annotations

import json
import os
import sys

KEYS = ("ms", "median_ms", "back_to_back_ms", "ratio_to_floor", "over_floor", "fraction_of_copy_bw",
        "host_ms_per_step", "tok_s", "mean_tok_s", "tokens_per_s", "scaling_efficiency", "last10_mean",
        "held_out_loss", "e2e_tok_s", "gen_tok_s", "train_tok_s", "gen_share", "vs_eager", "vs_hf", "peak_gib",
        "max_allocated_gib",
        "max_reserved_gib", "error")


def _row(name, row) -> str:
    if not isinstance(row, dict):
        return f"{name:28s} {round(row, 3) if isinstance(row, float) else row}"
    shown = {}
    for k in KEYS:
        v = row.get(k)
        if v is None or v == "":
            continue
        if isinstance(v, dict):
            v = {a: (round(b, 2) if isinstance(b, float) else b) for a, b in v.items() if a != "calls_per_step"}
        elif isinstance(v, float):
            v = round(v, 3)
        elif isinstance(v, str):
            v = v[:300]
        shown[k] = v
    return f"{name:28s} {shown}"


def lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        return [f"{path}: {err}"]
    out = [f"== {os.path.basename(path)}"]
    for key in ("rows", "variants", "results", "runs"):
        rows = data.get(key) if isinstance(data, dict) else None
        if isinstance(rows, dict):
            out += [_row(name, row) for name, row in rows.items()]
        elif isinstance(rows, list):
            for i, r in enumerate(rows):
                name = str(next((r[k] for k in ("variant", "backend", "setup", "world_size") if k in r), i))
                if "shape" in r and "length" in r:  # long-context: one row per setup, shape and length
                    name = f"{name} {r['shape']} {r['length']}"
                    r = dict(r, error=" ".join(x for x in (r.get("status"), r.get("error")) if x and x != "ok"))
                out.append(_row(name, r))
    return out


def main(argv: list[str]) -> int:
    for path in argv:
        print("\n".join(lines(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
