"""The ``pgs`` command line: dispatch, exit codes, one-line errors, light imports."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from pgs import cli
from pgs.errors import HaltError
from pgs.runtime.spec.load import Spec

SPEC = """\
[model]
config = { model_type = "qwen3", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, vocab_size = 0 }
tokenizer = "pgs:quickstart/tokenizer"
[data]
max_seq_len = 128
sources = [{ path = "pgs:quickstart/train.jsonl" }]
eval = "pgs:quickstart/eval.jsonl"
[train]
steps = 10
batch_size = 2
[checkpoint]
dir = "run"
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC, encoding="utf-8")
    return path


@pytest.fixture
def fake_train(monkeypatch):
    """A stand-in for ``pgs.runtime.loop.train`` that records its call and returns ``module.code``."""
    module = types.ModuleType("pgs.runtime.loop.train")
    module.calls = []
    module.code = 0

    def run(spec, *, resume, spec_path, profile=None, overwrite=False, faults=None):
        module.calls.append((spec, resume, spec_path))
        if isinstance(module.code, BaseException):
            raise module.code
        return module.code

    module.run = run
    monkeypatch.setitem(sys.modules, "pgs.runtime.loop.train", module)
    return module


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys, contextlib, io\nfrom pgs.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try: main(['--help'])\n    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'pgs --help imported torch'\nprint(out.getvalue())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "validate", "report", "data", "profile", "examples:"):
        assert command in proc.stdout


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "commands" in capsys.readouterr().err
    assert cli.main(["data"]) == 2


def test_validate_ok(spec_file: Path, capsys):
    assert cli.main(["validate", str(spec_file), "--records", "20"]) == 0
    out = capsys.readouterr().out
    assert "the spec is runnable" in out and "clip_by_global_norm(1) → adamw()" in out


def test_run_dispatches(spec_file: Path, fake_train, capsys):
    fake_train.code = 0
    assert cli.main(["run", str(spec_file), "--set", "train.steps=3", "--resume", "auto"]) == 0
    spec, resume, spec_path = fake_train.calls[0]
    assert isinstance(spec, Spec) and spec.train.steps == 3
    assert resume == "auto" and spec_path == str(spec_file)


@pytest.mark.parametrize("outcome, code", [(81, 81), (HaltError("tripwire: entropy collapsed", 80), 80),
                                           (KeyboardInterrupt(), 130)])
def test_run_exit_codes(spec_file: Path, fake_train, capsys, outcome, code):
    fake_train.code = outcome
    assert cli.main(["run", str(spec_file)]) == code
    err = capsys.readouterr().err
    if isinstance(outcome, HaltError):
        assert err == "pgs: error: tripwire: entropy collapsed\n"


def test_bugs_keep_their_traceback(spec_file: Path, fake_train):
    fake_train.code = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["run", str(spec_file)])


@pytest.mark.parametrize("argv, message", [
    (["run", "{spec}", "--resume", "/no/such/checkpoint"], "--resume: no such checkpoint"),
    (["run", "{spec}", "--set", "train.steps"], "expected KEY=VALUE"),
    (["validate", "{spec}", "--set", "train.stepz=3"], "train.stepz: unknown key (did you mean steps?)"),
    (["validate", "/no/such/spec.toml"], "no such spec file"),
    (["report", "/no/such/run"], "no such run folder"),
])
def test_user_errors_are_one_line(spec_file: Path, fake_train, capsys, argv, message):
    assert cli.main([a.format(spec=spec_file) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pgs: error: ") and message in err and err.count("\n") == 1


def test_data_inspect(spec_file: Path, capsys):
    assert cli.main(["data", "inspect", str(spec_file), "-n", "1", "--records", "30"]) == 0
    out = capsys.readouterr().out
    assert "data statistics" in out and "records read" in out
