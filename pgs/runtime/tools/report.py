"""``pgs report RUN_DIR``: plots and a summary table from a run's ``metrics.jsonl``.

The reader is tolerant: a record may carry any subset of the keys (``step``, ``loss``,
``lr``, ``grad_norm``, ``entropy``, ``tokens_per_s``, ``eval_loss``, ``eval_accuracy``,
``skipped``, ...), non-numeric and non-finite values are ignored, and a line that is not
JSON (a run killed mid-write leaves a torn last line) is counted, not fatal.  A plot is
drawn only for series that have points.

Only the latest run of the file is read: records after the last fresh start.  A fresh start
is a ``{"event": "start"}`` record, or (files written before that record existed: no start
record before it) a step record lower than the one before it without a ``resume`` event in
between; a ``resume`` event continues the run it resumes (``pgs run --resume`` has already cut
the records after its checkpoint).  Events may name an earlier step than the records around
them (a background checkpoint is logged when it ends, under the step it saved).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import attrs

from pgs.errors import PgsError
from pgs.runtime import userpath

#: One PNG per entry: file name -> (title, y label, metric keys drawn on it, log scale).
PLOTS: dict[str, tuple[str, str, tuple[str, ...], bool]] = {
    "loss.png": ("loss", "loss", ("loss", "eval_loss", "ema_eval_loss", "eval_preference_loss"), False),
    "lr.png": ("learning rate", "lr", ("lr",), False),
    "grad_norm.png": ("gradient norm (before clipping)", "grad norm", ("grad_norm",), True),
    "entropy.png": ("mean next-token entropy", "nats", ("entropy",), False),
    "tokens_per_s.png": ("throughput", "tokens / s", ("tokens_per_s",), False),
    "eval_accuracy.png": ("eval accuracy", "accuracy", ("eval_accuracy",), False),
    "update_ratio.png": ("update / weight norm ratio (health summaries)", "‖Δw‖ / ‖w‖", ("health/update_ratio",), True),
    # [preference] runs
    "preference.png": ("preference accuracy (chosen reward above rejected; KTO: reward on its label's side of z_ref)",
                       "accuracy", ("preference_accuracy", "eval_preference_accuracy"), False),
    "rewards.png": ("implicit rewards", "reward", ("reward_chosen", "reward_rejected", "reward_desirable",
                                                   "reward_undesirable", "reward_margin", "eval_reward_margin"), False),
    "logps.png": ("summed log-probs of the completions", "log p", ("logp_chosen", "logp_rejected", "logp_desirable",
                                                                   "logp_undesirable", "eval_logp_chosen",
                                                                   "eval_logp_rejected", "eval_logp_desirable",
                                                                   "eval_logp_undesirable"), False),
    "kl.png": ("KTO's reference point z_ref (estimated KL from the reference)", "nats", ("kl", "eval_kl"), False),
}

#: Per-task accuracies (``evaluate.task_accuracy``) are drawn on eval_accuracy.png too, and the
#: per-group update ratios (``pgs.runtime.loop.health``) on update_ratio.png.
TASK_ACCURACY = "eval_accuracy_"
GROUP_RATIO = "health/update_ratio/"


class ReportError(PgsError):
    """The run folder has nothing to report (exit 2)."""


@attrs.define
class Metrics:
    """Series read from ``metrics.jsonl``: ``series[key] = [(step, value), ...]`` in file order."""

    series: dict[str, list[tuple[float, float]]] = attrs.field(factory=dict)
    records: int = 0
    bad_lines: int = 0
    earlier_records: int = 0  # records of earlier runs in the same file (not read)
    earlier_runs: int = 0

    def last(self, key: str) -> float | None:
        points = self.series.get(key)
        return points[-1][1] if points else None

    def best(self, key: str, lowest: bool = True) -> tuple[float, float] | None:
        points = self.series.get(key)
        if not points:
            return None
        return (min if lowest else max)(points, key=lambda p: p[1])

    def mean(self, key: str) -> float | None:
        points = self.series.get(key)
        return sum(v for _, v in points) / len(points) if points else None


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_metrics(path: str) -> Metrics:
    """Parse ``metrics.jsonl`` into per-key series; ``step`` (or the record index) is the x axis."""
    metrics = Metrics()
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (is this a run folder? it has no metrics.jsonl)") from None
    with handle:
        last_step: float | None = None
        seen_start = False  # a file with start records marks every fresh start with one
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                metrics.bad_lines += 1
                continue
            if not isinstance(record, dict):
                metrics.bad_lines += 1
                continue
            step = _number(record.get("step"))
            event = record.get("event")
            seen_start = seen_start or event == "start"
            if event == "resume":
                last_step = step
            elif metrics.records and (event == "start" or (not seen_start and event is None and step is not None
                                                             and last_step is not None and step < last_step)):
                metrics.earlier_records += metrics.records  # a fresh start: what came before is another run
                metrics.earlier_runs += 1
                metrics.series.clear()
                metrics.records = 0
            if step is not None and event != "resume":
                last_step = step
            x = step if step is not None else float(metrics.records)
            metrics.records += 1
            for key, value in record.items():
                v = _number(value)
                if v is not None and key not in ("step", "time"):
                    metrics.series.setdefault(key, []).append((x, v))
    return metrics


def summary_rows(metrics: Metrics) -> list[tuple[str, str]]:
    """``(what, value)`` rows of the summary table."""
    rows: list[tuple[str, str]] = [("records", f"{metrics.records}")]
    if metrics.earlier_runs:
        rows.append(("earlier runs in the file", f"{metrics.earlier_runs} ({metrics.earlier_records} records, "
                                                 "not read)"))
    if metrics.bad_lines:
        rows.append(("unreadable lines", f"{metrics.bad_lines}"))
    steps = [x for points in metrics.series.values() for x, _ in points]
    if steps:
        rows.append(("last step", f"{int(max(steps))}"))

    def add(label: str, value: float | None, fmt: str = ".4g") -> None:
        if value is not None:
            rows.append((label, format(value, fmt)))

    add("first train loss", metrics.series["loss"][0][1] if metrics.series.get("loss") else None)
    add("last train loss", metrics.last("loss"))
    tasks = sorted(k for k in metrics.series if k.startswith(TASK_ACCURACY))
    for key, lowest in (("eval_loss", True), ("eval_accuracy", False), *((k, False) for k in tasks),
                        ("eval_preference_loss", True), ("eval_preference_accuracy", False)):
        best = metrics.best(key, lowest)
        if best is not None:
            add(f"last {key}", metrics.last(key))
            rows.append((f"best {key}", f"{best[1]:.4g} (step {int(best[0])})"))
    add("last lr", metrics.last("lr"))
    add("max grad norm", metrics.best("grad_norm", lowest=False)[1] if metrics.series.get("grad_norm") else None)
    add("last eval_logp_chosen", metrics.last("eval_logp_chosen"))
    add("last entropy", metrics.last("entropy"))
    add("min entropy", metrics.best("entropy")[1] if metrics.series.get("entropy") else None)
    add("mean tokens/s", metrics.mean("tokens_per_s"), ",.0f")
    for key, label in (("mem_gib", "peak allocated GiB"), ("reserved_gib", "peak reserved GiB")):
        add(label, metrics.best(key, lowest=False)[1] if metrics.series.get(key) else None, ".3f")
    # where a host-bound release step spends its host time (docs/runtime.md, per-step metrics)
    add("mean host ms in release group steps", metrics.mean("release/host_ms"), ".1f")
    add("mean host ms in optimizer offload staging", metrics.mean("offload/host_ms"), ".1f")
    if metrics.series.get("offload/unannounced"):
        rows.append(("offload groups fetched on demand",
                     f"{int(sum(v for _, v in metrics.series['offload/unannounced']))} (all steps)"))
    if metrics.series.get("skipped"):
        rows.append(("skipped steps", f"{int(metrics.last('skipped'))} (last value)"))
    return rows


def _markdown(rows: Iterable[tuple[str, str]], run_dir: str, plots: list[str]) -> str:
    lines = [f"# pgs report: {run_dir}", "", "| what | value |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    if plots:
        lines += ["", *[f"![{p[:-4]}]({p})" for p in plots]]
    return "\n".join(lines) + "\n"


def _resolved_spec(run_dir: str) -> dict:
    """The run's ``spec.resolved.toml`` as a table ({} when absent or unreadable)."""
    import tomllib

    try:
        with open(os.path.join(run_dir, "spec.resolved.toml"), "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _entropy_floor(run_dir: str, spec: dict | None = None) -> float | None:
    """``train.entropy_warn`` from the run's resolved spec, to draw on the entropy plot."""
    spec = _resolved_spec(run_dir) if spec is None else spec
    train = spec.get("train", {})
    return (_number(train.get("entropy_warn")) or None) if isinstance(train, dict) else None


def _clip_threshold(spec: dict) -> float | None:
    """The global-norm clip of the run (``optimizer.clip``, or a ``clip_by_global_norm`` entry
    of ``optimizer.chain``), to draw on the grad-norm plot; None when it does not clip."""
    optimizer = spec.get("optimizer", {})
    if not isinstance(optimizer, dict):
        return None
    clip = _number(optimizer.get("clip"))
    if clip is not None and clip > 0:
        return clip
    for entry in optimizer.get("chain") or []:
        if isinstance(entry, dict) and entry.get("name") == "clip_by_global_norm":
            args = entry.get("args") if isinstance(entry.get("args"), dict) else entry
            value = _number(args.get("max_norm"))
            if value is not None and value > 0:
                return value
    return None


def _warmup(spec: dict) -> int:
    schedule = spec.get("schedule", {})
    value = _number(schedule.get("warmup")) if isinstance(schedule, dict) else None
    return int(value) if value else 0


def _zoom_start(metrics: Metrics, warmup: int) -> float | None:
    """The first step of the loss plot's zoomed panel: past warm-up (the schedule's, at least
    5% of the run), or None when too few train-loss points would remain."""
    points = metrics.series.get("loss") or []
    if len(points) < 8:
        return None
    last = max(x for x, _ in points)
    start = max(float(warmup), 0.05 * last)
    return start if sum(1 for x, _ in points if x > start) >= 4 else None


def plot_keys(filename: str, metrics: Metrics) -> list[str]:
    """The series of ``metrics`` drawn on plot ``filename`` (``PLOTS``, with the per-task
    accuracies and per-group update ratios), those that have points."""
    keys = PLOTS[filename][2]
    if filename == "eval_accuracy.png":
        keys = keys + tuple(sorted(k for k in metrics.series if k.startswith(TASK_ACCURACY)))
    if filename == "update_ratio.png":
        keys = keys + tuple(sorted(k for k in metrics.series if k.startswith(GROUP_RATIO)))
    return [k for k in keys if metrics.series.get(k)]


def svg_charts(metrics: Metrics, entropy_warn: float | None = None, *, clip: float | None = None) -> list[str]:
    """The plots of ``PLOTS`` that have data, as inline SVG charts (the HTML page's)."""
    from pgs.runtime.tools.report_html import svg_chart

    charts = []
    for filename, (title, ylabel, _, log) in PLOTS.items():
        present = plot_keys(filename, metrics)
        if not present:
            continue
        lines: tuple[tuple[float, str], ...] = ()
        if filename == "entropy.png" and entropy_warn:
            lines = ((entropy_warn, "entropy_warn"),)
        if filename == "grad_norm.png" and clip:
            lines = ((clip, f"clip = {clip:g}"),)
        charts.append(svg_chart(title, {k: metrics.series[k] for k in present}, ylabel=ylabel, lines=lines,
                                log=log or filename == "loss.png"))
    return charts


def _draw(ax, metrics: Metrics, keys: list[str], after: float | None = None) -> None:
    for key in keys:
        points = [(x, y) for x, y in metrics.series[key] if after is None or x > after]
        if not points:
            continue
        xs, ys = zip(*points)
        style = {"marker": "o", "markersize": 3} if key.startswith("eval") else {"linewidth": 1.2}
        ax.plot(xs, ys, label=key, **style)


def draw_plots(metrics: Metrics, out_dir: str, entropy_warn: float | None = None, *,
               clip: float | None = None, warmup: int = 0) -> list[str]:
    """Write one PNG per plot that has data; returns the file names written.

    ``loss.png``: the whole run on a log axis (the warm-up's drop would squeeze a linear one)
    and, beside it, the steps past warm-up on a linear axis.  ``eval_accuracy.png`` has the
    per-task accuracies too; ``grad_norm.png`` the clip threshold (``clip``), ``entropy.png``
    the warning floor (``entropy_warn``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, (title, ylabel, _, log) in PLOTS.items():
        present = plot_keys(filename, metrics)
        if not present:
            continue
        positive = all(v > 0 for k in present for _, v in metrics.series[k])
        zoom = _zoom_start(metrics, warmup) if filename == "loss.png" else None
        if zoom is not None:
            fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4))
            _draw(right, metrics, present, after=zoom)
            right.set(title=f"{title} after step {zoom:g} (past warm-up)", xlabel="step", ylabel=ylabel)
            right.grid(alpha=0.3)
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
        _draw(ax, metrics, present)
        extra = False
        if filename == "entropy.png" and entropy_warn:
            ax.axhline(entropy_warn, color="red", linestyle="--", linewidth=1, label="entropy_warn")
            extra = True
        if filename == "grad_norm.png" and clip:
            ax.axhline(clip, color="red", linestyle="--", linewidth=1, label=f"clip = {clip:g}")
            extra = True
        if (log or filename == "loss.png") and positive:
            ax.set_yscale("log")
            title = f"{title} (log scale)" if filename == "loss.png" else title
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(present) > 1 or extra:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, filename), dpi=110)
        plt.close(fig)
        written.append(filename)
    return written


def _spec_text(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, "spec.resolved.toml"), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _samples_table(samples, console) -> None:
    """The newest evaluation's sample replies (``[eval] samples``) as a table on the console."""
    from rich.table import Table

    from pgs.runtime.tools.report_html import prompt_text

    step, rows = samples[0]
    table = Table(title=f"samples at step {step} (samples/step_{step}.jsonl)", title_justify="left")
    for name in ("#", "prompt", "reply", "reference"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(str(row.get("index", "")), prompt_text(row), str(row.get("reply", "")),
                      str(row.get("reference", "")))
    console.print(table)


def write_report(run_dir: str, console=None) -> list[tuple[str, str]]:
    """Read ``RUN_DIR/metrics.jsonl``; write ``RUN_DIR/report/`` (``report.html``: one
    self-contained page; PNGs where matplotlib is installed; ``summary.md``); print the table
    and the newest sample replies."""
    from rich.table import Table

    from pgs.runtime import output
    from pgs.runtime.tools.report_html import read_samples, render, write_html

    console = console or output.console()
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such run folder")
    path = os.path.join(run_dir, "metrics.jsonl")
    why = userpath.problem(path)
    if why not in (None, userpath.MISSING):  # a folder, a FIFO, unreadable, ...
        raise ReportError(f"{path}: {'a folder' if why == userpath.FOLDER else why}, expected the run's metrics file")
    metrics = read_metrics(path)
    if metrics.records == 0:
        raise ReportError(f"{path}: no metrics records yet")
    out_dir = os.path.join(run_dir, "report")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ReportError(f"{out_dir}: a file is in the way of the report folder; move it, then run pgs report again")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise ReportError(f"{out_dir}: cannot be made ({err.strerror or err})") from None
    spec = _resolved_spec(run_dir)
    entropy_warn, clip = _entropy_floor(run_dir, spec), _clip_threshold(spec)
    try:
        plots = draw_plots(metrics, out_dir, entropy_warn, clip=clip, warmup=_warmup(spec))
    except ImportError:
        plots = []
    rows = summary_rows(metrics)
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(rows, run_dir, plots))
    samples = read_samples(run_dir)
    page = os.path.join(out_dir, "report.html")
    write_html(page, render(run_dir, rows, svg_charts(metrics, entropy_warn, clip=clip), _spec_text(run_dir),
                            samples))
    table = Table(title=f"pgs report: {run_dir}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    if samples and samples[0][1]:
        _samples_table(samples, console)
    console.print(f"wrote {page} (open it in a browser: one file, works offline), {out_dir}/summary.md"
                  + (f" and {len(plots)} PNG plots" if plots else " (no PNG plots: matplotlib is not installed, "
                     "pip install 'pgs[plot]')"), markup=False)  # [plot] is text, not rich markup
    return rows
