"""``pgs report``: a synthetic metrics.jsonl in, PNGs and a summary out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pgs import cli
from pgs.runtime.tools.report import ReportError, read_metrics, summary_rows, write_report


def _write_metrics(run: Path) -> None:
    lines = []
    for step in range(1, 41):
        row = {"step": step, "loss": 3.0 / step, "lr": 1e-3 * min(1, step / 5), "grad_norm": 1.0 + 1 / step,
               "entropy": 2.0 - step / 40, "tokens_per_s": 1000.0 + step, "skipped": 0}
        if step == 7:
            row["loss"] = float("nan")  # json writes NaN: read as "no value"
            del row["grad_norm"]
        lines.append(json.dumps(row))
        if step % 10 == 0:
            lines.append(json.dumps({"step": step, "eval_loss": 2.0 - step / 100 + (0.5 if step == 40 else 0),
                                     "eval_accuracy": step / 50}))
    lines.append(json.dumps({"event": "halt", "reason": "none"}))  # no numbers: counted, nothing plotted
    lines.append('{"step": 41, "loss": 0.0')  # torn last line of a killed run
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (run / "spec.resolved.toml").write_text("[train]\nentropy_warn = 0.18\n", encoding="utf-8")


def test_read_metrics_is_tolerant(tmp_path: Path):
    _write_metrics(tmp_path)
    m = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert m.records == 45 and m.bad_lines == 1
    assert len(m.series["loss"]) == 39 and len(m.series["grad_norm"]) == 39
    assert all(math.isfinite(v) for _, v in m.series["loss"])
    assert m.best("eval_loss") == (30.0, pytest.approx(1.7))
    assert m.best("eval_accuracy", lowest=False)[0] == 40.0


def test_write_report(tmp_path: Path, capsys):
    _write_metrics(tmp_path)
    rows = dict(write_report(str(tmp_path)))
    report = tmp_path / "report"
    for name in ("loss.png", "lr.png", "grad_norm.png", "entropy.png", "tokens_per_s.png", "eval_accuracy.png"):
        assert (report / name).stat().st_size > 1000, name
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (report / "summary.md").read_text(encoding="utf-8")
    assert "| best eval_loss | 1.7 (step 30) |" in summary and "![loss](loss.png)" in summary
    assert rows["last step"] == "41" or rows["last step"] == "40"
    assert rows["unreadable lines"] == "1"
    assert "best eval_loss" in capsys.readouterr().out


def test_only_what_is_there(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"loss": 2.0}\n', encoding="utf-8")
    rows = dict(write_report(str(tmp_path)))
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == ["loss.png"]
    assert rows["last train loss"] == "2"


def test_report_errors(tmp_path: Path, capsys):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        write_report(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("\n", encoding="utf-8")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no metrics records yet" in capsys.readouterr().err
    assert summary_rows(read_metrics(str(tmp_path / "metrics.jsonl"))) == [("records", "0")]


# -- issue 29: only the latest run of a reused file; log/zoomed loss; per-task accuracy; clip
def _lines(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_only_the_latest_run_of_the_file_is_read(tmp_path: Path):
    """A second fresh run appended to the same file (step 0 again, as before pgs run refused
    a used folder) starts a new run; a resume continues its run."""
    first = [{"step": s, "loss": 5.0 - s / 100} for s in range(1, 801)]
    second = [{"step": 0, "eval_loss": 6.0}] + [{"step": s, "loss": 4.0 - s / 10} for s in range(1, 9)]
    resumed = [{"step": 4, "event": "resume", "from": "step_4"}] + [{"step": s, "loss": 1.0} for s in (5, 6)]
    (tmp_path / "metrics.jsonl").write_text(_lines(first + second[:5] + resumed), encoding="utf-8")
    m = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [x for x, _ in m.series["loss"]] == [1, 2, 3, 4, 5, 6]  # nothing from the 800-step run
    assert m.series["eval_loss"] == [(0, 6.0)]
    assert m.earlier_runs == 1 and m.earlier_records == 800
    rows = dict(summary_rows(m))
    assert rows["earlier runs in the file"] == "1 (800 records, not read)" and rows["last step"] == "6"


def test_a_start_event_begins_a_run(tmp_path: Path):
    rows = [{"step": 0, "event": "start"}, {"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.0},
            {"step": 0, "event": "start"}, {"step": 0, "eval_loss": 2.5}]
    (tmp_path / "metrics.jsonl").write_text(_lines(rows), encoding="utf-8")
    m = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert m.series == {"eval_loss": [(0, 2.5)]} and m.earlier_runs == 1


def test_loss_zoom_task_accuracies_and_clip_line(tmp_path: Path, monkeypatch):
    from pgs.runtime.tools import report

    rows = []
    for step in range(1, 101):
        rows.append({"step": step, "loss": 8.0 if step < 10 else 1.0 / step, "grad_norm": 0.5 + step / 50})
        if step % 25 == 0:
            rows.append({"step": step, "eval_loss": 1.0, "eval_accuracy": step / 100,
                         "eval_accuracy_add": step / 200, "eval_accuracy_weather": 1.0})
    (tmp_path / "metrics.jsonl").write_text(_lines(rows), encoding="utf-8")
    (tmp_path / "spec.resolved.toml").write_text("[optimizer]\nclip = 1.0\n[schedule]\nwarmup = 10\n",
                                                 encoding="utf-8")
    drawn = {}
    import matplotlib.figure

    real_savefig = matplotlib.figure.Figure.savefig

    def capture(fig, path, *a, **k):
        drawn[Path(path).name] = fig
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    out = dict(report.write_report(str(tmp_path)))
    assert out["best eval_accuracy_add"] == "0.5 (step 100)"
    loss_axes = drawn["loss.png"].axes
    assert len(loss_axes) == 2 and loss_axes[0].get_yscale() == "log"
    zoomed = [x for line in loss_axes[1].get_lines() for x in line.get_xdata()]
    assert min(zoomed) > 10  # past the warm-up
    labels = {line.get_label() for line in drawn["eval_accuracy.png"].axes[0].get_lines()}
    assert {"eval_accuracy", "eval_accuracy_add", "eval_accuracy_weather"} <= labels
    grad = drawn["grad_norm.png"].axes[0]
    clip_lines = [line for line in grad.get_lines() if line.get_label() == "clip = 1"]
    assert clip_lines and set(clip_lines[0].get_ydata()) == {1.0}


def test_no_clip_line_without_a_clip(tmp_path: Path):
    from pgs.runtime.tools.report import _clip_threshold

    assert _clip_threshold({"optimizer": {"clip": 0.0}}) is None
    assert _clip_threshold({}) is None
    assert _clip_threshold({"optimizer": {"chain": [{"name": "clip_by_global_norm", "max_norm": 0.5}]}}) == 0.5
    assert _clip_threshold({"optimizer": {"chain": [{"name": "clip_by_global_norm", "args": {"max_norm": 2}}]}}) == 2


def test_memory_peaks_and_the_release_host_time_in_the_summary(tmp_path: Path):
    rows = [{"step": s, "loss": 1.0, "mem_gib": 10.0 + s, "reserved_gib": 12.0 + s, "release/host_ms": 2.0 * s,
             "offload/host_ms": 1.0, "offload/unannounced": 3 if s == 1 else 0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text(_lines(rows), encoding="utf-8")
    got = dict(summary_rows(read_metrics(str(tmp_path / "metrics.jsonl"))))
    assert got["peak allocated GiB"] == "13.000" and got["peak reserved GiB"] == "15.000"
    assert got["mean host ms in release group steps"] == "4.0"
    assert got["mean host ms in optimizer offload staging"] == "1.0"
    assert got["offload groups fetched on demand"] == "3 (all steps)"


def test_a_background_checkpoint_logged_late_does_not_start_a_run(tmp_path: Path):
    """``[checkpoint] background``: step 4's checkpoint event is logged when the save ends, after
    step 6's record; in a file with start records only a start record begins a run."""
    rows = ([{"step": 0, "event": "start"}] + [{"step": s, "loss": 5.0 - s} for s in range(1, 7)]
            + [{"step": 4, "event": "checkpoint", "background": True, "checkpoint_seconds": 0.07,
                "logged_at_step": 6}] + [{"step": s, "loss": 1.0} for s in (7, 8)])
    (tmp_path / "metrics.jsonl").write_text(_lines(rows), encoding="utf-8")
    m = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [x for x, _ in m.series["loss"]] == [1, 2, 3, 4, 5, 6, 7, 8] and m.earlier_runs == 0
    assert m.series["checkpoint_seconds"] == [(4, 0.07)]
