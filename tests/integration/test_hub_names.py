"""Hub names (``model.path = "org/name"``) resolve through huggingface_hub's cache: a cache folder
laid out here in the hub's own layout (``models--org--name/snapshots/<commit>/...``,
``refs/main``), ``HF_HUB_CACHE`` pointed at it and ``HF_HUB_OFFLINE=1``.  No network: the one
test of an unreachable hub points ``HF_ENDPOINT`` at a closed local port."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import QUICKSTART, cli_error, cpu_spec, records
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

COMMIT = "a" * 40
NEWER = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str = COMMIT, *, branch: str | None = "main") -> Path:
    """A tiny Qwen3 with the quickstart tokenizer as the cache holds a downloaded repository."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    folder = root / "snapshots" / commit
    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=512,
                                  max_position_embeddings=512, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer").save_pretrained(folder)
    if branch is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / branch).write_text(commit)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def _spec(tmp_path: Path, model: str, extra: str = "") -> Path:
    spec = cpu_spec(tmp_path, model=f'path = "{model}"\n{extra}')
    text = spec.read_text()
    return _write(spec, text.replace(f'tokenizer = "{(QUICKSTART / "tokenizer").as_posix()}"\n', ""))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_hub_name_resolves_to_the_cached_snapshot(tmp_path, cache):
    from pgs.runtime.spec.load import load_spec, read_toml, spec_from_dict

    folder = _snapshot(cache, "org/tiny")
    spec = load_spec(_spec(tmp_path, "org/tiny"))
    assert spec.model.path == str(folder) and spec.model.tokenizer == str(folder)
    assert spec.hub["model.path"].revision == COMMIT and spec.hub["model.path"].repo == "org/tiny"
    text = spec.to_toml()
    assert f'path = "org/tiny@{COMMIT}"' in text and f'tokenizer = "org/tiny@{COMMIT}"' in text
    (tmp_path / "resolved.toml").write_text(text)
    again = spec_from_dict(read_toml(tmp_path / "resolved.toml"), tmp_path)
    assert again == spec and again.hub["model.path"].revision == COMMIT
    # a commit or a branch named after @
    assert load_spec(_spec(tmp_path, f"org/tiny@{COMMIT}")).model.path == str(folder)


def test_validate_and_run_from_the_cache(tmp_path, cache, capsys):
    from pgs.cli import main

    _snapshot(cache, "org/tiny")
    spec = _spec(tmp_path, "org/tiny")
    capsys.readouterr()
    assert main(["validate", str(spec)]) == 0
    out = capsys.readouterr().out
    assert f"org/tiny at revision {COMMIT[:12]}" in out and "ok: the spec is runnable" in out
    assert main(["run", str(spec)]) == 0
    err = capsys.readouterr().err
    assert f"pgs: model.path: org/tiny at revision {COMMIT} (" in err
    assert f'path = "org/tiny@{COMMIT}"' in (tmp_path / "run" / "spec.resolved.toml").read_text()
    assert f'path = "org/tiny@{COMMIT}"' in (tmp_path / "run" / "step_1" / "spec.resolved.toml").read_text()


def test_what_the_cache_lacks_is_one_line(tmp_path, cache, capsys):
    code, line = cli_error(["validate", str(_spec(tmp_path, "org/absent"))], capsys)
    assert code == 2
    assert line == (f"pgs: error: model.path: org/absent is not a local folder and the Hugging Face cache {cache} "
                    "does not hold it; offline (HF_HUB_OFFLINE=1): download it where there is network "
                    "(hf download org/absent) into that cache"), line
    code, line = cli_error(["validate", str(_spec(tmp_path, "org/absent@v2"))], capsys)
    assert code == 2 and "org/absent@v2 is not a local folder" in line and "--revision v2" in line, line


def test_a_missing_shard_is_named(tmp_path, cache, capsys):
    folder = _snapshot(cache, "org/tiny")
    weights = folder / "model.safetensors"
    weights.rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    code, line = cli_error(["validate", str(_spec(tmp_path, "org/tiny"))], capsys)
    assert code == 2
    assert line == (f"pgs: error: model.path: org/tiny at revision {COMMIT[:12]} in the Hugging Face cache {cache} "
                    "lacks model-00002-of-00002.safetensors; offline (HF_HUB_OFFLINE=1) nothing is downloaded: "
                    f"hf download org/tiny --revision {COMMIT} fetches them"), line


def test_a_local_folder_wins_over_a_hub_name(tmp_path, cache):
    """``org/tiny`` that exists beside the spec is that folder; the cache is not asked."""
    from pgs.runtime.spec.load import load_spec

    local = tmp_path / "org" / "tiny"
    shutil.copytree(_snapshot(cache, "other/tiny"), local)
    spec = load_spec(_spec(tmp_path, "org/tiny"))
    assert spec.model.path == str(local) and spec.hub == {}


def test_teacher_reference_and_tokenizer_names(tmp_path, cache):
    from pgs.runtime.spec.load import load_spec

    teacher = _snapshot(cache, "org/teacher")
    ref = _snapshot(cache, "org/ref", NEWER)
    student = _snapshot(cache, "org/tiny")
    spec = cpu_spec(tmp_path, model='path = "org/tiny"\n')
    text = spec.read_text().replace(f'"{(QUICKSTART / "tokenizer").as_posix()}"', '"org/teacher"')
    distill = load_spec(_write(spec, text + '\n[distill]\nteacher_path = "org/teacher"\n'))
    assert distill.distill.teacher_path == str(teacher) and distill.model.tokenizer == str(teacher)
    assert {f: s.revision for f, s in distill.hub.items()} == {
        "model.path": COMMIT, "model.tokenizer": COMMIT, "distill.teacher_path": COMMIT}
    assert distill.model.path == str(student)
    pref = load_spec(_write(spec, text + '\n[preference]\nkind = "dpo"\nreference_path = "org/ref"\n'))
    assert pref.preference.reference_path == str(ref) and pref.hub["preference.reference_path"].revision == NEWER


def test_an_unreachable_hub_uses_the_cache(tmp_path, cache, monkeypatch, capsys):
    """Online but no network (a closed local port as the endpoint): the cache's snapshot is used,
    and a name it lacks is one line."""
    from pgs.runtime.spec.load import load_spec

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    folder = _snapshot(cache, "org/tiny")
    assert load_spec(_spec(tmp_path, "org/tiny")).model.path == str(folder)
    code, line = cli_error(["validate", str(_spec(tmp_path, "org/absent"))], capsys)
    assert code == 2 and "does not hold it; the hub cannot be reached" in line, line


def test_resume_refuses_another_revision_and_takes_a_pinned_one(tmp_path, cache, capsys):
    from pgs.cli import main

    _snapshot(cache, "org/tiny")
    spec = _spec(tmp_path, "org/tiny")
    assert main(["run", str(spec)]) == 0
    _snapshot(cache, "org/tiny", NEWER)  # main moved on
    capsys.readouterr()
    code, line = cli_error(["run", str(spec), "--resume", "auto"], capsys)
    assert code == 2
    assert line == (f"pgs: error: --resume: model.path: org/tiny is revision {NEWER[:12]} now, the checkpoint "
                    f"was trained from {COMMIT[:12]}; set model.path = \"org/tiny@{COMMIT}\" to continue from the "
                    "same files, or start a new run"), line
    assert main(["run", str(spec), "--resume", "auto", "--set", f"model.path=org/tiny@{COMMIT}"]) == 0
    assert [r["event"] for r in records(tmp_path / "run") if "event" in r][-2:] == ["resume", "done"]
