"""The scores' report: one histogram per score (PNG) and a summary table (``summary.md``)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

#: The scores drawn and summarised, with their axis labels.
FIELDS = {
    "nll": "familiarity: mean NLL of the trained tokens (nats)",
    "entropy": "mean next-token entropy (nats)",
    "hes": "HES: sum of the top 0.5% token entropies (nats)",
    "trained": "trained tokens per sample",
    "tokens": "tokens per sample",
}


def summary_rows(scores: list[dict]) -> list[tuple[str, str]]:
    """``(what, value)`` rows: counts, drops by reason, and per score mean / p5 / median / p95."""
    kept = [s for s in scores if s.get("kept")]
    rows = [("samples", str(len(scores))), ("kept (scored)", str(len(kept)))]
    for reason, n in sorted(Counter(s.get("reason") for s in scores if not s.get("kept")).items()):
        rows.append((f"dropped: {reason}", str(n)))
    truncated = sum(bool(s.get("truncated")) for s in kept)
    if truncated:
        rows.append(("truncated", str(truncated)))
    for field in FIELDS:
        values = np.array([s[field] for s in kept], dtype=np.float64)
        if values.size == 0:
            continue
        p5, p50, p95 = np.percentile(values, [5, 50, 95])
        rows.append((field, f"mean {values.mean():.4g}  p5 {p5:.4g}  median {p50:.4g}  p95 {p95:.4g}"))
    return rows


def draw_histograms(scores: list[dict], out_dir: str) -> list[str]:
    """``hist_<score>.png`` for each score; returns the file names (matplotlib needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = [s for s in scores if s.get("kept")]
    written = []
    for field, label in FIELDS.items():
        values = [s[field] for s in kept]
        if not values:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.hist(values, bins=min(50, max(5, len(set(values)))), color="#4878a8")
        ax.set(title=f"{field} ({len(values)} samples)", xlabel=label, ylabel="samples")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        name = f"hist_{field}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def write_score_report(scores: list[dict], out_dir: str, title: str, console=None) -> list[tuple[str, str]]:
    """Write ``out_dir/report/`` (histograms, ``summary.md``) and print the table; returns its rows."""
    from rich.table import Table

    from pgs.runtime import output

    console = console or output.console()
    report = os.path.join(out_dir, "report")
    os.makedirs(report, exist_ok=True)
    try:
        plots = draw_histograms(scores, report)
    except ImportError:
        plots = []
        console.print("[yellow]warning:[/] matplotlib is not installed (pip install 'pgs[plot]'); no plots drawn")
    rows = summary_rows(scores)
    with open(os.path.join(report, "summary.md"), "w", encoding="utf-8") as handle:
        handle.write(f"# pgs prepare: {title}\n\n| what | value |\n|---|---|\n")
        handle.writelines(f"| {what} | {value} |\n" for what, value in rows)
        if plots:
            handle.write("\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n")
    table = Table(title=f"pgs prepare: {title}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    console.print(f"wrote {report}/summary.md" + (f" and {len(plots)} plots" if plots else ""))
    return rows
