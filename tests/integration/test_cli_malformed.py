"""Malformed specs and data files through ``pgs validate``.

Every one must give exactly one line on stderr (``pgs: error: ...`` naming the field or
file:line), exit code 2, and no traceback.  A spec fixture states its expected message on
its first line (``# expect: ...``); the data fixtures are listed below.

Every fixture runs in-process (cheap); 20 specs and 10 data files also run as a real
``python -m pgs validate`` subprocess, which is what a user sees (each costs an interpreter
start with torch, so the subprocess set is kept at the required size).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pgs.cli import main

HERE = Path(__file__).resolve().parent
SPECS = sorted((HERE / "malformed" / "specs").glob("*.toml"))
DATA_DIR = HERE / "malformed" / "data"

DATA = {
    "bad_json.jsonl": "bad_json.jsonl:3: malformed JSON",
    "bad_role.jsonl": "bad_role.jsonl:1: message 1: unknown role 'robot'",
    "bad_tool_call.jsonl": "bad_tool_call.jsonl:1: message 1 tool_calls[0]",
    "content_not_text.jsonl": "content_not_text.jsonl:1: message 1 (assistant): content must be a string",
    "empty.jsonl": "empty.jsonl: no records (data.sources[0] is empty)",
    "empty_messages.jsonl": "empty_messages.jsonl:1: the conversation must be a non-empty list",
    "invalid_utf8.jsonl": "invalid_utf8.jsonl:2: malformed JSON",
    "messages_not_list.jsonl": "messages_not_list.jsonl:1: the conversation must be a non-empty list",
    "no_assistant.jsonl": "no_assistant.jsonl:1: the conversation has no assistant turn",
    "not_an_object.jsonl": "not_an_object.jsonl:2: expected a JSON object per line",
    "prompt_not_text.jsonl": "prompt_not_text.jsonl:1: 'prompt' must be a string",
    "sharegpt_bad_speaker.jsonl": "sharegpt_bad_speaker.jsonl:1: turn 1: unknown speaker 'alien'",
    "truncated_last_line.jsonl": "truncated_last_line.jsonl:1: malformed JSON",
    "unknown_format.jsonl": "unknown_format.jsonl:1: unknown record shape",
}

DATA_SPEC = """\
[model]
config = {{ model_type = "qwen3", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, vocab_size = 0 }}
tokenizer = "pgs:quickstart/tokenizer"
[data]
max_seq_len = 128
sources = [{{ path = "{path}" }}]
[train]
steps = 10
batch_size = 2
"""


#: Spec fixtures whose error needs the tokenizer or model config: in-process only (slower to start).
DEEP = {"all_too_long", "freeze_matches_nothing", "unknown_model_type", "vocab_too_small"}
SUBPROCESS_SPECS = [p for p in SPECS if p.stem not in DEEP][:20]
SUBPROCESS_DATA = sorted(DATA)[:10]


def _expected(spec: Path) -> str:
    first = spec.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# expect: "), f"{spec.name}: first line must state the expected message"
    return first[len("# expect: "):]


def _data_spec(name: str, tmp_path: Path) -> Path:
    spec = tmp_path / "spec.toml"
    spec.write_text(DATA_SPEC.format(path=(DATA_DIR / name).as_posix()), encoding="utf-8")
    return spec


def _validate_in_process(spec: Path, capsys) -> subprocess.CompletedProcess:
    code = main(["validate", str(spec)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pgs"], code, out, err)


def _validate(spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pgs", "validate", str(spec)],
        capture_output=True, text=True, cwd=spec.parent, timeout=120,
    )


def _assert_one_clear_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    err = proc.stderr
    assert "Traceback" not in err, err
    assert proc.returncode == 2, (proc.returncode, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pgs: error: "), err
    assert expected in lines[0], (expected, lines[0])


def test_fixture_counts():
    assert len(SPECS) >= 20 and len(DATA) >= 10
    assert len(SUBPROCESS_SPECS) == 20 and len(SUBPROCESS_DATA) == 10
    assert sorted(DATA) == sorted(p.name for p in DATA_DIR.glob("*.jsonl"))


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.stem)
def test_malformed_spec_in_process(spec: Path, capsys):
    _assert_one_clear_line(_validate_in_process(spec, capsys), _expected(spec))


@pytest.mark.parametrize("name", sorted(DATA))
def test_malformed_data_in_process(name: str, tmp_path: Path, capsys):
    _assert_one_clear_line(_validate_in_process(_data_spec(name, tmp_path), capsys), DATA[name])


@pytest.mark.parametrize("spec", SUBPROCESS_SPECS, ids=lambda p: p.stem)
def test_malformed_spec_subprocess(spec: Path):
    _assert_one_clear_line(_validate(spec), _expected(spec))


@pytest.mark.parametrize("name", SUBPROCESS_DATA)
def test_malformed_data_subprocess(name: str, tmp_path: Path):
    _assert_one_clear_line(_validate(_data_spec(name, tmp_path)), DATA[name])
