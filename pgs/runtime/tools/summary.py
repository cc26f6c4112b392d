"""The lines ``pgs run`` ends with on stdout (progress and events go to stderr): what was
trained, where the exported model, the best export, the last checkpoint, the metrics and the
report are, and the commands that draw the report or continue the run (docs/cli.md)."""

from __future__ import annotations

import json
import os
import shlex

from pgs.errors import EXIT_OK, EXIT_WALL_BUDGET

#: Eval metrics the summary shows, when the run reports them (``checkpoint.best_metric`` first).
SHOWN_EVALS = ("eval_loss", "eval_accuracy", "eval_preference_accuracy", "eval_reward_margin", "eval_distill_kl")


def _where(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _what(spec) -> str:
    m = spec.model
    source = spec.hub.get("model.path")
    if source is not None:
        model = source.ref
    elif m.path is not None:
        model = _where(m.path)
    else:
        model = f"a random init ({(m.config or {}).get('model_type', '?')})"
    if spec.preference is not None:
        return f"{spec.preference.kind} preference optimization of {model}"
    if spec.distill is not None:
        d = spec.distill
        teacher = spec.hub["distill.teacher_path"].ref if "distill.teacher_path" in spec.hub else (
            _where(d.teacher_path) if d.teacher_path else "a random-init teacher")
        return f"distillation ({d.kind}) of {model} from {teacher}"
    return f"SFT of {model}"


def _export_info(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "pgs_export.json"), encoding="utf-8") as handle:
            info = json.load(handle)
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _newest_checkpoint(run_dir: str) -> str | None:
    steps = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
        if name.startswith("step_") and name[5:].isdigit() and os.path.exists(os.path.join(run_dir, name, "COMPLETE")):
            steps.append(int(name[5:]))
    return os.path.join(run_dir, f"step_{max(steps)}") if steps else None


def run_summary(spec, code: int, command: list[str]) -> list[str]:
    """The closing lines of ``pgs run`` that ended with exit ``code`` (0: done; 82 or 128 + a
    signal: stopped after a checkpoint); ``command``: the ``pgs run`` arguments that continue it.
    Empty for other codes (a halt or an error has said its own line)."""
    from pgs.runtime.tools.report import ReportError, read_metrics

    stopped = code == EXIT_WALL_BUDGET or code > 128
    if code != EXIT_OK and not stopped:
        return []
    run_dir = spec.checkpoint.dir
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    try:
        metrics = read_metrics(metrics_file)
    except ReportError:
        return []
    losses = metrics.series.get("loss") or []
    steps = int(losses[-1][0]) if losses else 0
    tokens = metrics.last("trained_tokens")
    head = "pgs run: done" if not stopped else f"pgs run: stopped at step {steps}"
    lines = [f"{head}: {_what(spec)}, {steps} steps" + (f", {int(tokens):,} tokens trained" if tokens else "")]
    rows: list[tuple[str, str]] = []
    final = os.path.join(run_dir, "final")
    if not stopped and os.path.isdir(final):
        rows.append(("model", f"{_where(final)}  (Hugging Face folder: AutoModelForCausalLM.from_pretrained)"))
    best = os.path.join(run_dir, "best")
    metric = spec.checkpoint.best_metric
    if metric and os.path.isdir(best):
        info = _export_info(best)
        rows.append(("best", f"{_where(best)}  "
                             f"(step {info.get('step', '?')}, {metric} {_number(info.get(metric, '?'))})"))
    checkpoint = _newest_checkpoint(run_dir)
    if checkpoint is not None:
        rows.append(("checkpoint", _where(checkpoint)))
    shown = [metric] if metric and metric.startswith("eval_") else []
    shown += [k for k in SHOWN_EVALS if k not in shown]
    evals = [(k, metrics.series[k][-1]) for k in shown if metrics.series.get(k)]
    if evals:
        at = int(max(step for _, (step, _) in evals))
        rows.append(("last eval", ", ".join(f"{k} {_number(v)}" for k, (_, v) in evals) + f"  (step {at})"))
    rows.append(("metrics", _where(metrics_file)))
    rows.append(("report", f"pgs report {shlex.quote(_where(run_dir))}"))
    if stopped:
        rows.append(("continue", shlex.join(["pgs", "run", *command, "--resume", "auto"])))
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name.ljust(width)}  {value}" for name, value in rows]
    return lines
