"""Exports users can ship: weights sharded as ``save_pretrained`` shards them (with the index),
every end-of-turn id kept in ``generation_config``, and ``model.trust_remote_code`` honoured by
the model ``pgs run`` builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pgs.errors import SpecError
from pgs.runtime.model.build import build_model
from pgs.runtime.model.loading import load_tokenizer
from pgs.runtime.spec.load import ASSETS_DIR, load_spec
from pgs.runtime.common import parse_size
from pgs.runtime.store.export import INDEX, WEIGHTS, end_of_turn_ids, export_hf, shard
from tiny import shape_table, tiny_model

TOKENIZER = ASSETS_DIR / "quickstart" / "tokenizer"
CONFIG = shape_table(vocab_size=None, max_position_embeddings=128, tie_word_embeddings=True)  # the tokenizer's vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


@pytest.fixture
def model(tokenizer):
    return build_model(config=dict(CONFIG), dtype="float32", attn_implementation="sdpa", vocab_size=len(tokenizer))


def test_sizes_read_as_transformers_writes_them():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size(4096) == 4096
    for bad in ("5 parsecs", "", "GB", 0, "-1GB"):
        with pytest.raises(SpecError, match="checkpoint.max_shard_size"):
            parse_size(bad)


def test_a_bad_max_shard_size_is_refused_at_load(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('[model]\ntokenizer = "pgs:quickstart/tokenizer"\n[model.config]\nmodel_type = "qwen3"\n'
                    '[data]\nsources = [{ path = "pgs:quickstart/train.jsonl" }]\n[train]\nsteps = 1\n')
    with pytest.raises(SpecError, match="checkpoint.max_shard_size: '5 GBs'"):
        load_spec(spec, ['checkpoint.max_shard_size="5 GBs"'])
    assert load_spec(spec, []).checkpoint.max_shard_size == "5GB"


def test_shards_hold_every_tensor_once_in_order_and_under_the_limit():
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5, 5])}  # 4 B each
    parts = shard(tensors, 80)
    assert [list(p) for p in parts] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [list(p) for p in shard(tensors, 10)] == [[k] for k in tensors]  # too big: a file each


def test_default_export_is_one_file(tmp_path, model, tokenizer):
    out = export_hf(model, tokenizer, str(tmp_path / "final"))
    assert (Path(out) / WEIGHTS).exists() and not (Path(out) / INDEX).exists()


def test_sharded_export_loads_and_matches_save_pretrained(tmp_path, model, tokenizer):
    from transformers import AutoModelForCausalLM

    out = Path(export_hf(model, tokenizer, str(tmp_path / "final"), max_shard_size="40KB"))
    index = json.loads((out / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / WEIGHTS).exists()
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    written = {}
    for f in files:
        part = load_file(out / f)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        written.update(part)
    assert set(written) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    # transformers' own sharded folder of the same model names the same tensors
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    theirs = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert set(theirs["weight_map"]) == set(index["weight_map"])
    assert theirs["metadata"]["total_size"] == index["metadata"]["total_size"]
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ours = model.state_dict()
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, ours[name]), name


def test_generation_config_keeps_every_end_of_turn_id(tmp_path, model, tokenizer):
    model.generation_config.eos_token_id = [1, 5, 4]
    ids = end_of_turn_ids(model, tokenizer)
    assert ids[:3] == [1, 5, 4] and tokenizer.eos_token_id in ids and len(set(ids)) == len(ids)
    out = Path(export_hf(model, tokenizer, str(tmp_path / "final")))
    saved = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert saved == ids
    # a chat template whose turn ends in one special token contributes it, beside another eos
    other = load_tokenizer(str(TOKENIZER))
    other.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = None
    assert end_of_turn_ids(model, other) == [other.convert_tokens_to_ids("<|endoftext|>"),
                                             other.convert_tokens_to_ids("<|im_end|>")]


REMOTE_CONFIG = '''\
from transformers import Qwen3Config


class TinyRemoteConfig(Qwen3Config):
    model_type = "tiny_remote"
'''

REMOTE_MODEL = '''\
from transformers import Qwen3ForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(Qwen3ForCausalLM):
    config_class = TinyRemoteConfig
'''


def _remote_folder(tmp_path: Path, vocab: int) -> Path:
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny.py").write_text(REMOTE_MODEL)
    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    tiny_model(seed=None, mode=None, **fields, vocab_size=vocab).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
               auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                         "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_trust_remote_code_reaches_the_model_pgs_run_builds(tmp_path, tokenizer):
    folder = _remote_folder(tmp_path, len(tokenizer))
    with pytest.raises(Exception, match="trust_remote_code"):
        build_model(path=str(folder), dtype="float32", attn_implementation="sdpa")
    model = build_model(path=str(folder), dtype="float32", attn_implementation="sdpa", trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForCausalLM"


def test_pgs_run_trains_a_remote_code_model(tmp_path, tokenizer, capsys):
    from pgs.cli import main

    folder = _remote_folder(tmp_path, len(tokenizer))
    from helpers import cpu_spec

    model = f'path = "{folder.as_posix()}"\ntrust_remote_code = true\nattn_implementation = "sdpa"\ndtype = "float32"'
    sets = ["train.steps=2", "checkpoint.export=true", 'checkpoint.best_metric=""', 'checkpoint.max_shard_size="40KB"']
    assert main(["run", str(cpu_spec(tmp_path, model=model)), *[a for x in sets for a in ("--set", x)]]) == 0, \
        capsys.readouterr().err
    final = tmp_path / "run" / "final"
    assert (final / INDEX).exists()
    assert json.loads((final / "config.json").read_text())["model_type"] == "tiny_remote"
