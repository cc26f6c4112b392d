"""``pgs run`` ends with a short summary on stdout (progress and events stay on stderr), and
tables and headings printed into a pipe are not cut at 80 columns."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import QUICKSTART, cpu_spec


def _spec(tmp_path: Path) -> Path:
    """Two steps with an eval of four held-out records, a best export and a final export."""
    held = tmp_path / "eval.jsonl"
    held.write_text("".join((QUICKSTART / "eval.jsonl").read_text().splitlines(keepends=True)[:4]))
    spec = cpu_spec(tmp_path)
    text = (spec.read_text().replace("steps = 1\n", "steps = 2\n").replace("eval_every = 0", "eval_every = 2")
            .replace("export = false", "export = true")
            .replace("max_seq_len = 96\n", f'max_seq_len = 96\neval = "{held.as_posix()}"\n'))
    spec.write_text(text)
    return spec


def test_a_run_ends_with_its_summary_on_stdout(tmp_path, capsys, monkeypatch):
    from pgs.cli import main

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    assert main(["run", str(spec)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("pgs run: done: SFT of a random init (qwen3), 2 steps, "), out
    assert lines[0].endswith(" tokens trained")
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == ["model", "best", "checkpoint", "last", "metrics", "report"], out
    assert rows["model"].split()[1] == "run/final" and "AutoModelForCausalLM.from_pretrained" in rows["model"]
    best = json.loads((tmp_path / "run" / "best" / "pgs_export.json").read_text())
    assert rows["best"].split()[1] == "run/best" and f"(step {best['step']}, eval_loss {best['eval_loss']:.4g})" in rows["best"]
    assert rows["checkpoint"].split()[1] == "run/step_2"
    last_eval = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                 if "eval_loss" in r][-1]
    assert f"eval_loss {last_eval['eval_loss']:.4g}" in rows["last"] and "(step 2)" in rows["last"]
    assert rows["metrics"].split()[1] == "run/metrics.jsonl"
    assert rows["report"] == "  report      pgs report run"
    assert "pgs run: done" not in err and "eval" in err  # progress and events on stderr only


def test_a_stopped_run_says_how_to_continue(tmp_path):
    """A run stopped by a signal or its wall budget: the checkpoint and the command that resumes."""
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.tools.summary import run_summary

    spec = load_spec(cpu_spec(tmp_path))
    run = tmp_path / "run"
    (run / "step_3").mkdir(parents=True)
    (run / "step_3" / "COMPLETE").write_text("{}")
    (run / "step_4").mkdir()  # incomplete: not offered
    records = [{"step": 0, "event": "start"}] + [{"step": s, "loss": 1.0, "trained_tokens": 10 * s} for s in (1, 2, 3)]
    records.append({"step": 3, "event": "stop", "reason": "signal 15", "exit_code": 143})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = run_summary(spec, 143, ["spec.toml", "--set", "train.steps=9"])
    assert lines[0] == "pgs run: stopped at step 3: SFT of a random init (qwen3), 3 steps, 30 tokens trained"
    assert lines[-1] == "  continue    pgs run spec.toml --set train.steps=9 --resume auto"
    assert any(line.startswith("  checkpoint  ") and line.endswith("step_3") for line in lines)
    assert not any("model" in line.split()[:1] for line in lines[1:])  # no final export after a stop
    assert run_summary(spec, 80, ["spec.toml"]) == []  # a halt said its own line


def test_headings_and_tables_into_a_pipe_are_whole(tmp_path, capsys, monkeypatch):
    """``pgs data inspect`` into a pipe (capsys is no terminal): the heading line keeps its
    counts however long the source path, and a table row is one line."""
    from pgs.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "data"
    deep.mkdir(parents=True)
    (deep / "train.jsonl").write_text((QUICKSTART / "train.jsonl").read_text().splitlines(keepends=True)[0])
    spec = cpu_spec(tmp_path)
    spec.write_text(spec.read_text().replace("pgs:quickstart/train.jsonl", (deep / "train.jsonl").as_posix()))
    assert main(["data", "inspect", str(spec), "-n", "1"]) == 0
    out = capsys.readouterr().out
    heading = next(line for line in out.splitlines() if line.startswith("── "))
    assert heading.startswith(f"── {deep / 'train.jsonl'}:1  (") and heading.endswith(" trained) ──"), heading
    assert len(heading) > 80 and "…" not in out
