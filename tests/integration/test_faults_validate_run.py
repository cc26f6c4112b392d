"""``pgs validate`` and ``pgs run`` agree (issue 29): one set of checks serves both.

Each case is a spec that used to pass ``validate`` and then fail in ``run`` (an OOM kill, an
SDPA traceback, exit 83, a ValueError traceback, an 11,954-character line).  Both commands
must now refuse it with the same exit code (2) and the same one ``pgs: error: ...`` line,
before ``run`` builds a model.  Also: ``--set optimizer.chain[i].name=...`` swaps a transform
for a new one with its own defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgs.cli import main
from pgs.runtime.spec.load import ChainEntry, load_spec
from helpers import ROOT, cli_error, cpu_spec
from tiny import tiny_config


def assert_both_refuse(spec: Path, expected: str, capsys, sets: tuple[str, ...] = ()) -> str:
    """``pgs validate`` and ``pgs run`` give exit 2 and the same one line containing ``expected``."""
    overrides = [a for s in sets for a in ("--set", s)]
    code_v, line_v = cli_error(["validate", str(spec), *overrides], capsys)
    code_r, line_r = cli_error(["run", str(spec), *overrides], capsys)
    assert (code_v, code_r) == (2, 2), (line_v, line_r)
    assert expected in line_v, (expected, line_v)
    assert line_r == line_v
    assert not (spec.parent / "run").exists() or not any((spec.parent / "run").iterdir())  # nothing ran
    return line_v


def _model_folder(tmp_path: Path, **fields) -> Path:
    """A local model folder holding only a config.json (the refusal comes before any weight is read)."""
    folder = tmp_path / "model"
    config = tiny_config("qwen3", num_hidden_layers=1, vocab_size=512)
    config.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(fields)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


# --------------------------------------------------------------------------- data.max_seq_len


def test_absurd_max_seq_len(tmp_path, capsys):
    line = assert_both_refuse(cpu_spec(tmp_path), "data.max_seq_len: 1000000000 is longer than the model's "
                              "max_position_embeddings = 128", capsys, ("data.max_seq_len=1000000000",))
    assert "set data.max_seq_len <= 128" in line


def test_max_seq_len_above_config_positions(tmp_path, capsys):
    assert_both_refuse(cpu_spec(tmp_path), "data.max_seq_len: 129 is longer than the model's "
                       "max_position_embeddings = 128 (model.config); set data.max_seq_len <= 128",
                       capsys, ("data.max_seq_len=129",))


def test_max_seq_len_above_folder_positions(tmp_path, capsys):
    folder = _model_folder(tmp_path, max_position_embeddings=64)
    assert_both_refuse(cpu_spec(tmp_path, model=f'path = "{folder.as_posix()}"'),
                       "data.max_seq_len: 96 is longer than the model's max_position_embeddings = 64 "
                       "(model.path's config.json); set data.max_seq_len <= 64", capsys)


def test_max_seq_len_at_the_limit_is_fine(tmp_path):
    from pgs.runtime.spec.preflight import check_seq_len, config_from_table, position_limit

    spec = load_spec(cpu_spec(tmp_path), ["data.max_seq_len=128"])
    config = config_from_table({**spec.model.config, "vocab_size": 512})
    check_seq_len(spec, config)
    assert position_limit(config) == (128, "max_position_embeddings = 128")


# --------------------------------------------------------------------------- architecture


def test_key_value_heads_do_not_divide(tmp_path, capsys):
    assert_both_refuse(cpu_spec(tmp_path), "model.config.num_key_value_heads: 3 does not divide "
                       "num_attention_heads = 4", capsys, ("model.config.num_key_value_heads=3",))


def test_key_value_heads_do_not_divide_in_a_folder(tmp_path, capsys):
    folder = _model_folder(tmp_path, num_key_value_heads=3)
    line = assert_both_refuse(cpu_spec(tmp_path, model=f'path = "{folder.as_posix()}"'),
                              "num_key_value_heads: 3 does not divide num_attention_heads = 4", capsys)
    assert "config.json" in line


def test_unknown_model_type_in_a_folder_is_short(tmp_path, capsys):
    folder = _model_folder(tmp_path, model_type="qwen99")
    line = assert_both_refuse(cpu_spec(tmp_path, model=f'path = "{folder.as_posix()}"'),
                              "model_type: unknown architecture 'qwen99' (did you mean qwen3?)", capsys)
    assert len(line) < 300, len(line)


# --------------------------------------------------------------------------- files and folders


def test_checkpoint_dir_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    spec = cpu_spec(tmp_path, run_dir=blocker / "run")
    assert_both_refuse(spec, f"checkpoint.dir: {blocker / 'run'} cannot be created: {blocker} is a file", capsys)


def test_checkpoint_dir_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    assert_both_refuse(cpu_spec(tmp_path, run_dir=blocker), f"checkpoint.dir: {blocker} is a file", capsys)


def test_empty_tokenizer_folder(tmp_path, capsys):
    empty = tmp_path / "tok"
    empty.mkdir()
    assert_both_refuse(cpu_spec(tmp_path, tokenizer=empty), f"model.tokenizer: {empty} holds no tokenizer", capsys)


def test_unreadable_tokenizer_folder(tmp_path, capsys):
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    assert_both_refuse(cpu_spec(tmp_path, tokenizer=broken), f"model.tokenizer: cannot load a tokenizer from {broken}",
                       capsys)


# --------------------------------------------------------------------------- --set a chain entry's name


RESEARCH = ROOT / "specs" / "research_stack.toml"



def test_swapping_a_transform_starts_from_its_defaults():
    spec = load_spec(RESEARCH, ["optimizer.chain[2].name=muon"])
    assert spec.optimizer.chain[2] == ChainEntry("muon", {})
    assert [e.name for e in spec.optimizer.chain] == ["adagc", "mona", "muon", "hyperball"]


def test_swapping_keeps_the_arguments_of_the_same_command_line():
    later = load_spec(RESEARCH, ["optimizer.chain[2].name=muon", "optimizer.chain[2].ns_steps=3"])
    assert later.optimizer.chain[2] == ChainEntry("muon", {"ns_steps": 3})
    earlier = load_spec(RESEARCH, ["optimizer.chain[2].ns_steps=3", "optimizer.chain[2].name=muon"])
    assert earlier.optimizer.chain[2] == ChainEntry("muon", {"ns_steps": 3})


def test_the_same_name_keeps_the_entry():
    spec = load_spec(RESEARCH, ["optimizer.chain[2].name=scale_by_lion8bit"])
    assert spec.optimizer.chain[2] == ChainEntry("scale_by_lion8bit", {"min_8bit_size": 1024})


def test_swap_validates(capsys):
    code = main(["validate", str(RESEARCH), "--set", "optimizer.chain[2].name=muon", "--records", "20"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "muon" in out


def test_position_limit_rope_factor_and_none(tmp_path):
    from types import SimpleNamespace

    from pgs.errors import SpecError
    from pgs.runtime.spec.preflight import MAX_SEQ_LEN_UNBOUNDED, check_seq_len, position_limit

    scaled = SimpleNamespace(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert position_limit(scaled) == (131072, "max_position_embeddings = 32768 x rope factor 4")
    unnamed = SimpleNamespace()
    assert position_limit(unnamed) == (None, "")
    check_seq_len(load_spec(cpu_spec(tmp_path), [f"data.max_seq_len={MAX_SEQ_LEN_UNBOUNDED}"]), unnamed)
    with pytest.raises(SpecError, match="names no max_position_embeddings and pgs refuses more than 1048576"):
        check_seq_len(load_spec(cpu_spec(tmp_path), ["data.max_seq_len=1000000000"]), unnamed)
