"""Selection rules over scored samples, and the prepared JSONL they write.

Every rule takes the kept score lines (``score.py``) and returns the chosen ids, deterministic
given its seed:

* :func:`random_subset` — the baseline every selection is compared with: the same number of
  samples, drawn uniformly from all scored samples.
* :func:`drop_outliers` — leaves out samples whose length (tokens) or familiarity (mean NLL)
  lies more than ``z`` standard deviations from the mean.
* :func:`jshape` — a J-shaped difficulty mix: the samples split into quartiles of familiarity
  (mean NLL; low is easy), then 20% of the selection drawn from the easiest quartile, 50% from
  the second, 25% from the third, 5% from the hardest.  A heuristic (pgs's own, loosely after
  arXiv 2605.12906 and 2502.02797; neither paper tests a difficulty mixture).
* :func:`top_hes` — the highest HES share (arXiv 2605.22389: the top 20% matched the full set
  on math/STEM SFT, and was worse on code).

:func:`write_selection` copies the chosen records, byte for byte, from their source files
into a JSONL that a spec can name as a source.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from pgs.errors import SpecError
from pgs.runtime.data.sources import SourceIndex

#: The J-shaped mix: shares of the selection from the easy, medium, hard and very hard quartiles.
JSHAPE_SHARES = (0.20, 0.50, 0.25, 0.05)
RULES = ("random", "jshape", "hes", "outliers")


def _ids(scores: list[dict]) -> list[str]:
    return [s["id"] for s in scores]


def _order(ids) -> list[str]:
    """Ids in source, then record order (a selection's output order)."""
    return sorted(ids, key=lambda i: tuple(int(x) for x in i.split(":")))


def random_subset(scores: list[dict], n: int, seed: int) -> list[str]:
    """``n`` ids drawn uniformly without replacement (all of them when ``n`` ≥ the pool)."""
    ids = _order(_ids(scores))
    n = min(n, len(ids))
    picked = np.random.default_rng([seed, 0x5E1EC7]).choice(len(ids), size=n, replace=False)
    return _order(ids[i] for i in picked)


def zscores(values: np.ndarray) -> np.ndarray:
    """(x − mean) / std; all 0 when the values do not vary."""
    std = values.std()
    return np.zeros_like(values) if std == 0 else (values - values.mean()) / std


def drop_outliers(scores: list[dict], z: float = 3.0) -> tuple[list[str], dict]:
    """The ids whose |z-score| of ``tokens`` and of ``nll`` are both ≤ ``z``; and the counts dropped."""
    if not z > 0:
        raise SpecError(f"--outlier-z: expected a number > 0, got {z}")
    if not scores:
        return [], {"length": 0, "nll": 0}
    length = np.abs(zscores(np.array([s["tokens"] for s in scores], dtype=np.float64))) > z
    nll = np.abs(zscores(np.array([s["nll"] for s in scores], dtype=np.float64))) > z
    keep = [s["id"] for s, a, b in zip(scores, length, nll) if not (a or b)]
    return _order(keep), {"length": int(length.sum()), "nll": int((nll & ~length).sum())}


def quartiles(scores: list[dict]) -> list[list[str]]:
    """The ids split into four equal-count bins of familiarity, easiest (lowest NLL) first.

    Ties in NLL go by id, so the split is deterministic."""
    ranked = sorted(scores, key=lambda s: (s["nll"], tuple(int(x) for x in s["id"].split(":"))))
    n = len(ranked)
    cuts = [round(n * q) for q in (0, 0.25, 0.5, 0.75, 1)]
    return [[s["id"] for s in ranked[a:b]] for a, b in zip(cuts, cuts[1:])]


def quotas(n: int, shares, sizes: list[int]) -> list[int]:
    """How many to take from each bin: ``n`` split by ``shares`` (largest remainder), each capped
    at its bin's size, what a full bin cannot give handed to the others by their shares."""
    n = min(n, sum(sizes))
    want = [0] * len(sizes)
    open_bins = [i for i in range(len(sizes)) if sizes[i] > 0]
    left = n
    while left > 0 and open_bins:
        total = sum(shares[i] for i in open_bins) or len(open_bins)
        raw = [(left * (shares[i] / total if total else 1 / len(open_bins)), i) for i in open_bins]
        give = {i: math.floor(x) for x, i in raw}
        for _, i in sorted(raw, key=lambda t: (-(t[0] - math.floor(t[0])), t[1]))[: left - sum(give.values())]:
            give[i] += 1
        for i in open_bins:
            take = min(give[i], sizes[i] - want[i])
            want[i] += take
            left -= take
        open_bins = [i for i in open_bins if want[i] < sizes[i]]
    return want


def jshape(scores: list[dict], n: int, seed: int, shares=JSHAPE_SHARES) -> list[str]:
    """``n`` ids: 20/50/25/5% from the familiarity quartiles, easiest first, uniformly within each."""
    bins = quartiles(scores)
    take = quotas(n, shares, [len(b) for b in bins])
    rng = np.random.default_rng([seed, 0x7A5E])
    out = []
    for ids, k in zip(bins, take):
        out += [ids[i] for i in rng.choice(len(ids), size=k, replace=False)]
    return _order(out)


def top_hes(scores: list[dict], n: int) -> list[str]:
    """The ``n`` ids of highest HES (ties by id)."""
    ranked = sorted(scores, key=lambda s: (-s["hes"], tuple(int(x) for x in s["id"].split(":"))))
    return _order(s["id"] for s in ranked[:n])


def size_of(pool: int, size: int | None, fraction: float | None, default_fraction: float | None) -> int:
    """The selection's size from ``--size`` or ``--fraction`` of the pool."""
    if size is not None and fraction is not None:
        raise SpecError("--size and --fraction: give one of them")
    if size is not None:
        if size < 1:
            raise SpecError(f"--size: expected an integer >= 1, got {size}")
        return min(size, pool)
    fraction = default_fraction if fraction is None else fraction
    if fraction is None:
        raise SpecError("--size or --fraction: how many samples to select")
    if not 0 < fraction <= 1:
        raise SpecError(f"--fraction: expected a number in (0, 1], got {fraction}")
    return max(1, round(pool * fraction))


def select(scores: list[dict], rule: str, *, size: int | None = None, fraction: float | None = None,
           seed: int = 0, outlier_z: float | None = None) -> dict:
    """Apply ``rule`` (after the outlier drop when ``outlier_z`` is given) to the kept scores.

    Returns ``{"selected": ids, "random": ids of the same size from all kept samples, ...}``
    with the counts; ``rule = "outliers"`` is the outlier drop alone.
    """
    if rule not in RULES:
        raise SpecError(f"--select: {rule!r} is not one of {', '.join(RULES)}")
    kept = [s for s in scores if s.get("kept")]
    if not kept:
        raise SpecError("--select: no scored sample to select from")
    pool, dropped = kept, {"length": 0, "nll": 0}
    if rule == "outliers" or outlier_z is not None:
        ids, dropped = drop_outliers(kept, 3.0 if outlier_z is None else outlier_z)
        keep = set(ids)
        pool = [s for s in kept if s["id"] in keep]
    if rule == "outliers":
        chosen = _ids(pool)
    else:
        n = size_of(len(pool), size, fraction, 0.2 if rule == "hes" else None)
        if rule == "random":
            chosen = random_subset(pool, n, seed)
        elif rule == "jshape":
            chosen = jshape(pool, n, seed)
        else:
            chosen = top_hes(pool, n)
    chosen = _order(chosen)
    baseline = random_subset(kept, len(chosen), seed + 1)
    return {"rule": rule, "seed": seed, "scored": len(kept), "pool": len(pool),
            "dropped_outliers": dropped, "selected": chosen, "random": baseline}


def write_selection(spec, ids: list[str], path: str, keep_order: bool = False) -> int:
    """Write the records of ``ids`` from the spec's sources into ``path`` (JSONL).

    A JSON-lines source's lines are copied verbatim; a record of another kind of source (JSON
    array, Parquet, Arrow, ``datasets`` folder) is written as one JSON object per line.  In
    source and record order, or in the order of ``ids`` with ``keep_order``."""
    wanted = [tuple(int(x) for x in sid.split(":")) for sid in ids]
    if not keep_order:
        wanted.sort()
    indexes: dict[int, SourceIndex] = {}
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as out:
            for s, i in wanted:
                if s >= len(spec.data.sources):
                    raise SpecError(f"sample {s}:{i} names source {s}, but the spec has {len(spec.data.sources)}")
                if s not in indexes:
                    indexes[s] = SourceIndex(spec.data.sources[s], spec.data.on_bad_record)
                index = indexes[s]
                raw = index.reader.read(index.offsets[i])
                if not isinstance(raw, (bytes, str)):
                    raw = json.dumps(index.reader.record(raw, index.reader.origin(index.lines[i])),
                                     ensure_ascii=False, default=str)
                line = raw.encode() if isinstance(raw, str) else raw
                out.write(line if line.endswith(b"\n") else line + b"\n")
    finally:
        for index in indexes.values():
            index.close()
    os.replace(tmp, path)
    return len(wanted)


def write_summary(result: dict, path: str) -> None:
    """``selection.json``: the rule, the counts, and both id lists."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
