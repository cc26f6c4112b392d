"""A model folder's weights are judged before anything trains: ``pgs validate`` reads their
headers (pgs.runtime.spec.weights) and refuses, in one line with exit 2, weights that are
missing, cut short, corrupt in the header, of another shape than the config, or lacking
tensors; ``pgs run`` refuses the same folders when it loads them (pgs.runtime.model.build:
transformers would initialise a missing tensor at random and the run would train it as loaded).

The folders are built here: a tiny random-init Qwen3 saved with ``save_pretrained`` beside the
quickstart tokenizer, then damaged.  No network."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import QUICKSTART, cli_error, cpu_spec
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pgs.cli import main
from pgs.errors import SpecError
from pgs.runtime.spec.weights import check_weights, read_headers


def _folder(path: Path, shards: bool = False) -> Path:
    config = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=512,
                                  max_position_embeddings=512, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="60KB" if shards else "5GB")
    AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer").save_pretrained(path)
    return path


def _spec(tmp_path: Path, folder: Path) -> Path:
    """A CPU spec training ``folder`` (its tokenizer is the quickstart's, which the spec names)."""
    return cpu_spec(tmp_path, model=f'path = "{folder.as_posix()}"')


def _truncate(folder: Path) -> str:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return "is not a whole safetensors file"


def _missing(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    return "has neither model.safetensors nor model.safetensors.index.json"


def _bad_header(folder: Path) -> str:
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:9] = b"]"  # the JSON header's opening brace
    weights.write_bytes(bytes(raw))
    return "is not a whole safetensors file"


def _wrong_shape(folder: Path) -> str:
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.zeros(48, 32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return f"{name} has shape [48, 32], but the config's architecture makes it [64, 32]"


def _lacking(folder: Path) -> str:
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return "the weights lack 1 of the architecture's"


@pytest.mark.parametrize("damage", [_truncate, _missing, _bad_header, _wrong_shape, _lacking],
                         ids=["truncated", "missing", "corrupt-header", "wrong-shape", "lacking-a-tensor"])
def test_validate_refuses_damaged_weights_in_one_line(tmp_path, capsys, damage):
    folder = _folder(tmp_path / "model")
    spec = _spec(tmp_path, folder)
    capsys.readouterr()  # what saving the folder printed
    assert main(["validate", str(spec)]) == 0  # whole, the folder validates
    assert "shapes match the config" in capsys.readouterr().out
    expected = damage(folder)
    code, line = cli_error(["validate", str(spec)], capsys)
    assert code == 2 and line.startswith("pgs: error: model.path: ") and expected in line, line


@pytest.mark.parametrize("damage", [_wrong_shape, _lacking], ids=["wrong-shape", "lacking-a-tensor"])
def test_run_refuses_weights_it_cannot_load_whole(tmp_path, capsys, damage):
    """What validate reads from the headers, the load itself refuses too (a run started without
    validate): a lacking tensor would otherwise be a random init trained as if loaded."""
    folder = _folder(tmp_path / "model")
    damage(folder)
    capsys.readouterr()  # what saving the folder printed
    code, line = cli_error(["run", str(_spec(tmp_path, folder))], capsys)
    assert code == 2 and line.startswith("pgs: error: model.path: the weights in "), line
    assert ("pgs validate names which" if damage is _wrong_shape else "lack 1 of the model's tensors") in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sharded_weights_are_read_through_their_index(tmp_path):
    folder = _folder(tmp_path / "model", shards=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert set(read_headers(str(folder))) == set(index["weight_map"])
    shapes = {n: tuple(s) for n, (_, s) in read_headers(str(folder)).items()}
    assert check_weights(str(folder), shapes, tied=True).endswith("shapes match the config")
    (folder / files[-1]).unlink()
    with pytest.raises(SpecError, match=f"{files[-1]} is missing"):
        read_headers(str(folder))


def test_an_index_that_maps_a_tensor_to_a_file_without_it_is_refused(tmp_path):
    folder = _folder(tmp_path / "model", shards=True)
    where = folder / "model.safetensors.index.json"
    index = json.loads(where.read_text())
    name, file = next(iter(index["weight_map"].items()))
    other = next(f for f in set(index["weight_map"].values()) if f != file)
    index["weight_map"][name] = other
    where.write_text(json.dumps(index))
    with pytest.raises(SpecError, match="whose header does not list it"):
        read_headers(str(folder))


def test_weights_of_another_architecture_are_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"encoder.block.0.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    with pytest.raises(SpecError, match="none of the 1 tensors in the weights is a parameter"):
        check_weights(str(folder), {"model.embed_tokens.weight": (4, 2)}, tied=True)
    # an 8-byte length that promises more header than the file holds
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(SpecError, match="not a whole safetensors file"):
        read_headers(str(folder))
