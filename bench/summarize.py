"""Print the headline numbers of bench result files, one line a row (what the device scripts
show at the end of a call): ``python bench/summarize.py RESULT.json [...]``.

Reads ``bench/optim_8bit.py`` output (``rows``: ms, back to back ms, × floor, host ms) and
``bench/sft_step.py`` output (``results``: tok/s, peak GiB, host ms per step by phase, error);
a missing file is one line saying so.
"""

from __future__ import annotations

import json
import sys

OPTIM_KEYS = ("ms", "back_to_back_ms", "ratio_to_floor", "host_ms_per_step", "error")


def lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        return [f"{path}: {err}"]
    out = []
    for name, row in data.get("rows", {}).items():
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k in OPTIM_KEYS}
        out.append(f"{name:28s} {shown}")
    for r in data.get("results", []):
        host = {k: v for k, v in (r.get("host_ms_per_step") or {}).items() if k != "calls_per_step"}
        out.append(f"{r['variant']} {round(r.get('tok_s', 0))} {round(r.get('peak_gib', 0), 3)} {host} "
                   f"{r.get('error', '')[:300]}")
    return out


def main(argv: list[str]) -> int:
    for path in argv:
        print("\n".join(lines(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
