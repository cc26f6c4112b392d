"""Every spec shipped in specs/ passes `pgs validate` (model, tokenizer, data and chain)."""

from pathlib import Path

import pytest

from pgs.cli import main

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.toml"))


#: Specs that start from another spec's output (the DPO and KTO quickstarts tune the quickstart's
#: final/ folder; the distillation quickstart's teacher is that folder and its student a shorter
#: quickstart run's): validated with the quickstart's architecture as a random init instead.
QUICKSTART_MODEL = ('model.config={ model_type = "qwen3", hidden_size = 128, intermediate_size = 384, '
                    'num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32, '
                    'max_position_embeddings = 512, tie_word_embeddings = true }')
STANDINS = {"dpo_quickstart.toml": ["--set", QUICKSTART_MODEL, "--set", "model.tokenizer=pgs:quickstart/tokenizer"],
            "kto_quickstart.toml": ["--set", QUICKSTART_MODEL, "--set", "model.tokenizer=pgs:quickstart/tokenizer"],
            # the distillation quickstart's teacher is the quickstart's final/ folder, its student a
            # 400-step quickstart run's
            "distill_quickstart.toml": ["--set", QUICKSTART_MODEL, "--set", "model.tokenizer=pgs:quickstart/tokenizer",
                                        "--set", "distill." + QUICKSTART_MODEL.replace("model.config", "teacher_config")],
            # a 32B checkpoint is 92 GiB (two at the fullest): more disk than a test machine has
            # (the disk refusal itself: tests/unit/test_preflight_resources.py)
            "qwen3_32b_one_gpu.toml": ["--set", "checkpoint.every=0", "--set", "checkpoint.last=false"]}


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_shipped_spec_validates(path, capsys):
    assert main(["validate", str(path), *STANDINS.get(path.name, [])]) == 0, capsys.readouterr().err


def test_there_are_shipped_specs():
    assert any(p.name == "quickstart.toml" for p in SPECS)
