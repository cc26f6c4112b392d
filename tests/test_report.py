"""``pgs report``: a synthetic metrics.jsonl in, PNGs and a summary out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pgs import cli
from pgs.runtime.report import ReportError, read_metrics, summary_rows, write_report


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
