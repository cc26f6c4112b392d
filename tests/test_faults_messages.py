"""Issue 29, items 4b, 4c, 5, 6 and 7: what was silently accepted or said badly, one test each.

CLI paths run in-process (``pgs.cli.main``) and assert the exit code and the one line; library
errors assert the exact message.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pgs.cli import main
from pgs.errors import DataError, InvalidArgument

SPEC = """\
[model]
config = {{ model_type = "qwen3", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16 }}
tokenizer = "pgs:quickstart/tokenizer"
[data]
max_seq_len = 128
sources = [{{ path = "{data}" }}]
[train]
steps = 10
batch_size = 2
[checkpoint]
dir = "run"
{extra}
"""


def _spec(tmp_path: Path, extra: str = "", data: str = "pgs:quickstart/train.jsonl") -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(extra=extra, data=data), encoding="utf-8")
    return path


def _cli(args: list[str], capsys) -> subprocess.CompletedProcess:
    code = main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pgs", *args], code, out, err)


def _one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pgs: error: "), proc.stderr
    return lines[0]


# ------------------------------------------------------------------------- 5. messages


def test_string_learning_rate_names_the_alias_argument():
    import pgs.func as pf

    with pytest.raises(InvalidArgument) as err:
        pf.adamw("1e-3")
    assert str(err.value) == ("adamw: learning_rate must be a number, got the string '1e-3' "
                              "(write the number without quotes)")
    for alias in (pf.lion, pf.sgd, pf.sage, pf.adamc, pf.adamh, pf.muon, pf.muonh, pf.adamw8bit, pf.lion8bit):
        with pytest.raises(InvalidArgument, match=f"^{alias.__name__}: learning_rate must be a number"):
            alias("1e-3")


def test_betas_in_optimizer_args_says_b1_and_b2(tmp_path, capsys):
    spec = _spec(tmp_path, '[optimizer]\nalias = "adamw"\nargs = { betas = [0.9, 0.95] }')
    line = _one_line(_cli(["validate", str(spec)], capsys))
    assert line == ("pgs: error: optimizer.args.betas: unknown argument of adamw "
                    "(pgs uses b1 and b2 (betas=(b1, b2)): write b1 = 0.9, b2 = 0.95)")


def test_malformed_json_line_gives_the_whole_reason_with_its_column(tmp_path):
    from pgs.runtime.data.records import parse_line

    with pytest.raises(DataError) as err:
        parse_line('{"messages": "a\tb"}', "data.jsonl:3")
    assert str(err.value) == "data.jsonl:3: malformed JSON (Invalid control character '\\t' at column 16)"
    with pytest.raises(DataError) as err:
        parse_line('{"messages": [1, 2] x', "data.jsonl:4")
    assert str(err.value) == "data.jsonl:4: malformed JSON (Expecting ',' delimiter at column 21)"
