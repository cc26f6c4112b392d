"""A model folder's own tokenizer is what a run uses unless the spec names another, and a named
tokenizer that does not fit the folder's model is refused by ``pgs validate`` and ``pgs run``
alike (one line naming ``model.tokenizer``) unless ``model.allow_tokenizer_mismatch = true``.

The model folders are built here: a tiny random-init Qwen3 saved with ``save_pretrained`` and a
tokenizer saved beside it (the quickstart tokenizer, or a variant of it).  No network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import QUICKSTART, ROOT, cli_error, cpu_spec
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

QUICKSTART_TOKENIZER = QUICKSTART / "tokenizer"


def _model_folder(path: Path, *, vocab_size: int = 512, tokenizer=None, **config_fields) -> Path:
    """A tiny Qwen3 folder (weights + config.json); ``tokenizer`` saved beside it when given."""
    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab_size,
                                  max_position_embeddings=512, tie_word_embeddings=True, **config_fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _quickstart_tokenizer():
    return AutoTokenizer.from_pretrained(QUICKSTART_TOKENIZER)


def _spec(tmp_path: Path, folder: Path, tokenizer: str | None = None, extra: str = "") -> Path:
    """``cpu_spec`` with ``path = folder`` and the ``tokenizer`` line (None: left out)."""
    spec = cpu_spec(tmp_path, model=f'path = "{folder.as_posix()}"\n{extra}')
    text = spec.read_text()
    line = f'tokenizer = "{QUICKSTART_TOKENIZER.as_posix()}"\n'
    assert line in text
    spec.write_text(text.replace(line, "" if tokenizer is None else f'tokenizer = "{tokenizer}"\n'))
    return spec


def _refused_by_both(spec: Path, capsys, sets: tuple[str, ...] = ()) -> str:
    capsys.readouterr()  # what building the folder printed
    overrides = [a for s in sets for a in ("--set", s)]
    code_v, line_v = cli_error(["validate", str(spec), *overrides], capsys)
    code_r, line_r = cli_error(["run", str(spec), *overrides], capsys)
    assert (code_v, code_r) == (2, 2), (line_v, line_r)
    assert line_v == line_r
    assert not (spec.parent / "run" / "metrics.jsonl").exists()  # nothing trained
    return line_v


def _other_tokenizer():
    """The quickstart tokenizer with one more special token: another vocabulary."""
    tok = _quickstart_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    return tok


def test_a_shipped_spec_with_only_model_path_changed_is_refused(tmp_path, capsys):
    """The issue's case: ``--set model.path=MYMODEL`` on a spec that names the quickstart tokenizer."""
    folder = _model_folder(tmp_path / "mine", tokenizer=_other_tokenizer())
    spec = ROOT / "specs" / "quickstart.toml"
    sets = (f"model.path={folder.as_posix()}", f"checkpoint.dir={(tmp_path / 'run').as_posix()}")
    line = _refused_by_both(spec, capsys, sets)
    assert line.startswith("pgs: error: model.tokenizer: pgs:quickstart/tokenizer is not the tokenizer of "
                           f"model.path {folder}"), line
    assert "(vocabulary differs at token id 485: model's '<|tool|>', spec's no token)" in line
    assert 'set it to "model"' in line and "model.allow_tokenizer_mismatch = true" in line
    # what the line says to do: the model's own tokenizer
    from pgs.cli import main

    assert main(["validate", str(spec), *[a for s in sets + ("model.tokenizer=model",) for a in ("--set", s)]]) == 0
    assert "486 tokens" in capsys.readouterr().out


def test_left_out_the_folder_tokenizer_is_used(tmp_path, capsys):
    folder = _model_folder(tmp_path / "mine", tokenizer=_other_tokenizer())
    from pgs.cli import main

    assert main(["validate", str(_spec(tmp_path, folder))]) == 0
    out = capsys.readouterr().out
    assert "486 tokens" in out and "ok: the spec is runnable" in out


def test_the_same_tokenizer_named_explicitly_fits(tmp_path, capsys):
    """A named tokenizer equal to the folder's own (another copy of the same files) is accepted."""
    folder = _model_folder(tmp_path / "mine", tokenizer=_quickstart_tokenizer())
    from pgs.cli import main

    assert main(["validate", str(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()))]) == 0
    assert "ok: the spec is runnable" in capsys.readouterr().out


def test_another_chat_template_is_refused(tmp_path, capsys):
    own = _quickstart_tokenizer()
    own.chat_template = own.chat_template.replace("<|im_start|>", "<|im_start|> ")
    folder = _model_folder(tmp_path / "mine", tokenizer=own)
    line = _refused_by_both(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()), capsys)
    assert "model.tokenizer: " in line and "chat rendering of sample conversation 0 differs" in line, line


def test_other_special_tokens_are_refused(tmp_path, capsys):
    own = _quickstart_tokenizer()
    own.pad_token = own.eos_token  # the same vocabulary, another pad
    folder = _model_folder(tmp_path / "mine", tokenizer=own)
    line = _refused_by_both(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()), capsys)
    assert "special token pad_token differs: model's '<|im_end|>' (id 2), spec's '<|endoftext|>' (id 0)" in line, line


def test_a_folder_without_tokenizer_is_checked_against_its_config(tmp_path, capsys):
    """No tokenizer beside the weights: the named one must give the ids config.json names."""
    folder = _model_folder(tmp_path / "bare", eos_token_id=7)
    line = _refused_by_both(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()), capsys)
    assert line == (f"pgs: error: model.tokenizer: pgs:quickstart/tokenizer does not fit model.path {folder} "
                    "(the tokenizer's eos_token '<|im_end|>' is id 2, the model's config.json ends a reply "
                    "with id 7); name the model's own tokenizer, or set model.allow_tokenizer_mismatch = true "
                    "to keep this one"), line
    # generation_config.json's ids end a reply too
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    from pgs.cli import main

    assert main(["validate", str(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()))]) == 0
    capsys.readouterr()
    shutil.rmtree(folder)
    _model_folder(folder, eos_token_id=2, pad_token_id=1)
    line = _refused_by_both(_spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix()), capsys)
    assert "the tokenizer's pad_token '<|endoftext|>' is id 0, the model's config.json says pad_token_id = 1" in line


def test_a_folder_without_tokenizer_needs_one_named(tmp_path, capsys):
    folder = _model_folder(tmp_path / "bare")
    code, line = cli_error(["validate", str(_spec(tmp_path, folder))], capsys)
    assert code == 2 and line.startswith(f"pgs: error: model.tokenizer: {folder} holds no tokenizer"), line


def test_the_allowance_says_so_and_runs(tmp_path, capsys):
    folder = _model_folder(tmp_path / "mine", tokenizer=_other_tokenizer())
    spec = _spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix(), extra="allow_tokenizer_mismatch = true")
    from pgs.cli import main

    assert main(["validate", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "warning: model.tokenizer: pgs:quickstart/tokenizer is not the tokenizer of model.path" in out
    assert "trained with it as model.allow_tokenizer_mismatch = true says" in out
    assert "ok: the spec is runnable" in out
    assert main(["run", str(spec)]) == 0
    err = capsys.readouterr().err
    assert "pgs: warning: model.tokenizer: pgs:quickstart/tokenizer is not the tokenizer of model.path" in err


def test_vocabulary_beyond_the_embeddings_is_refused_even_when_allowed(tmp_path, capsys):
    folder = _model_folder(tmp_path / "small", vocab_size=400)
    spec = _spec(tmp_path, folder, QUICKSTART_TOKENIZER.as_posix(), extra="allow_tokenizer_mismatch = true")
    line = _refused_by_both(spec, capsys)
    assert line == "pgs: error: model.path: the model has 400 embeddings but the tokenizer has 485 tokens", line


def test_model_keyword_needs_a_model_folder(tmp_path, capsys):
    spec = cpu_spec(tmp_path)
    code, line = cli_error(["validate", str(spec), "--set", "model.tokenizer=model"], capsys)
    assert code == 2 and line.startswith("pgs: error: model.tokenizer: needed when the model comes from "
                                         "model.config"), line


def test_a_run_trains_with_the_folder_tokenizer(tmp_path, capsys):
    """``pgs run`` with the tokenizer left out: the export carries the folder's own tokenizer."""
    folder = _model_folder(tmp_path / "mine", tokenizer=_other_tokenizer())
    spec = _spec(tmp_path, folder)
    spec.write_text(spec.read_text().replace("export = false", "export = true"))
    from pgs.cli import main

    assert main(["run", str(spec)]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert len(exported) == 486 and "<|tool|>" in exported.all_special_tokens


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "specs").glob("*.toml")))
def test_shipped_spec_headers_say_how_to_use_the_model_tokenizer(name):
    """A shipped spec that names a pgs tokenizer and tells users to swap in their model says how
    to take the model's own tokenizer along."""
    text = (ROOT / "specs" / name).read_text()
    if "--set model.path=" in text:  # the header says to take the model's tokenizer, or the spec already does
        assert "model.tokenizer=model" in text or '\ntokenizer = "model"' in text, name
