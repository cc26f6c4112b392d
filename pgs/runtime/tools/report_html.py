"""``pgs report``'s page: one self-contained HTML file, ``<run dir>/report/report.html``.

Everything is inside the file, so it opens offline and can be mailed or attached as it is:
the summary table, one chart per plot of ``pgs.runtime.tools.report.PLOTS`` drawn here as
inline SVG (no plotting library, no script, no external style or font), the sample replies
of every evaluation (``[eval] samples``: ``<run dir>/samples/step_<N>.jsonl``, newest first),
and the run's resolved spec.  Text from the run (sample replies, spec values) is escaped.
"""

from __future__ import annotations

import html
import json
import math
import os
import re

#: Line colours, in the order the series of a chart get them.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1340px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.85em; max-width: 40em; }
details { margin: 0.4em 0; }
"""


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value != 0 else "0"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values between ``lo`` and ``hi``."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Round values between ``10**lo`` and ``10**hi``: the decades, with 2× and 5× where the
    range holds few decades."""
    decades = range(math.floor(lo), math.ceil(hi) + 1)
    for multiples in ((1,), (1, 2, 5), (1, 2, 3, 5, 7)):
        ticks = [m * 10.0 ** e for e in decades for m in multiples if lo <= math.log10(m * 10.0 ** e) <= hi]
        if len(ticks) >= 3:
            return ticks
    return ticks or [10.0 ** lo]


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], *, log: bool = False,
              lines: tuple[tuple[float, str], ...] = (), ylabel: str = "") -> str:
    """An SVG line chart of ``series`` (name -> ``(step, value)`` points; names starting with
    ``eval`` drawn as points joined by a line), a log y axis when ``log`` and every value is
    positive, and dashed horizontal ``lines`` (value, label)."""
    drawn = {k: v for k, v in series.items() if v}
    values = [y for pts in drawn.values() for _, y in pts] + [y for y, _ in lines]
    log = log and all(y > 0 for y in values)
    f = (lambda y: math.log10(y)) if log else (lambda y: y)
    xs = [x for pts in drawn.values() for x, _ in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(f(y) for y in values), max(f(y) for y in values)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return TOP + (1 - (f(y) - y0) / (y1 - y0)) * h

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">',
           f'<title>{html.escape(title)}</title>',
           f'<text x="{WIDTH / 2}" y="17" text-anchor="middle" font-size="13" font-weight="bold">'
           f'{html.escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    yticks = _log_ticks(y0, y1) if log else _ticks(y0, y1)
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{_fmt(t)}</text>')
    for t in _ticks(x0, x1):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + h}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{TOP + h + 14}" text-anchor="middle" font-size="10">{_fmt(t)}</text>')
    out.append(f'<text x="{LEFT + w / 2}" y="{HEIGHT - 6}" text-anchor="middle" font-size="11">step</text>')
    if ylabel:
        out.append(f'<text transform="translate(13 {TOP + h / 2}) rotate(-90)" text-anchor="middle" '
                   f'font-size="11">{html.escape(ylabel)}{" (log)" if log else ""}</text>')
    legend = []
    for i, (name, points) in enumerate(drawn.items()):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline class="series" data-name="{html.escape(name)}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.4" points="{path}"/>')
        if name.startswith("eval") or len(points) == 1:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in points]
        legend.append((name, colour, False))
    for value, label in lines:
        y = py(value)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" '
                   f'stroke-dasharray="5,4"/>')
        legend.append((label, "#d62728", True))
    for i, (name, colour, dashed) in enumerate(legend):
        y = TOP + 12 + 14 * i
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out.append(f'<line x1="{LEFT + w - 150}" x2="{LEFT + w - 130}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>'
                   f'<text x="{LEFT + w - 126}" y="{y}" font-size="10">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def read_samples(run_dir: str) -> list[tuple[int, list[dict]]]:
    """Every ``samples/step_<N>.jsonl`` of the run, newest step first (torn lines skipped)."""
    folder = os.path.join(run_dir, "samples")
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = re.fullmatch(r"step_(\d+)\.jsonl", name)
        if not match:
            continue
        rows = []
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
        found.append((int(match.group(1)), rows))
    return sorted(found, key=lambda item: -item[0])


def prompt_text(row: dict) -> str:
    """The prompt of a sample as its last user message (the whole conversation in the HTML's title)."""
    messages = row.get("prompt") if isinstance(row.get("prompt"), list) else []
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else json.dumps(messages, ensure_ascii=False)


def _samples_html(samples: list[tuple[int, list[dict]]]) -> list[str]:
    out = ["<h2>Samples</h2>"]
    for k, (step, rows) in enumerate(samples):
        out.append(f"<details{' open' if k == 0 else ''}><summary>step {step}: {len(rows)} replies</summary>"
                   "<table class=\"samples\"><tr><th>#</th><th>prompt</th><th>reply</th><th>reference</th></tr>")
        for row in rows:
            conversation = html.escape(json.dumps(row.get("prompt"), ensure_ascii=False), quote=True)
            out.append(f'<tr><td class="num">{html.escape(str(row.get("index", "")))}</td>'
                       f'<td class="text" title="{conversation}">{html.escape(prompt_text(row))}</td>'
                       f'<td class="text">{html.escape(str(row.get("reply", "")))}</td>'
                       f'<td class="text">{html.escape(str(row.get("reference", "")))}</td></tr>')
        out.append("</table></details>")
    return out


def render(run_dir: str, rows: list[tuple[str, str]], charts: list[str], spec_text: str | None,
           samples: list[tuple[int, list[dict]]]) -> str:
    """The page: title, summary, charts, samples, resolved spec."""
    title = f"pgs report: {os.path.abspath(run_dir)}"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
           f"<h1>{html.escape(title)}</h1>", "<h2>Summary</h2>", '<table class="summary">']
    out += [f'<tr><th>{html.escape(a)}</th><td class="num">{html.escape(b)}</td></tr>' for a, b in rows]
    out.append("</table>")
    if charts:
        out += ["<h2>Curves</h2>", '<div class="charts">', *charts, "</div>"]
    if samples:
        out += _samples_html(samples)
    if spec_text is not None:
        out += ["<h2>Resolved spec</h2>", f'<pre class="spec">{html.escape(spec_text)}</pre>']
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_html(path: str, text: str) -> None:
    """Write the page whole, then move it into place (a reader never sees half a page)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
