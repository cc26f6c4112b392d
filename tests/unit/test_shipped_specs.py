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


#: Specs that name the user's own model (a hub name as shipped, which tests may not download):
#: validated with a tiny model folder saved here, with its own tokenizer beside it, and the
#: quickstart's chats as the user's data (tests/integration/test_finetune_spec.py trains it).
OWN_MODEL = {"finetune.toml"}


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 folder (weights, config.json) with the quickstart tokenizer as its own."""
    from transformers import AutoTokenizer

    from tiny import from_config, tiny_config

    folder = tmp_path_factory.mktemp("own_model")
    tokenizer = AutoTokenizer.from_pretrained(SPECS[0].parents[1] / "pgs" / "assets" / "quickstart" / "tokenizer")
    from_config(tiny_config("qwen3", vocab_size=512, max_position_embeddings=4096)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_shipped_spec_validates(path, capsys, request):
    standins = list(STANDINS.get(path.name, []))
    if path.name in OWN_MODEL:
        # the user's model, and short chats of the user's (the bundled long ones take 200
        # conversations' templating to sample, tens of seconds on a busy CPU)
        standins += ["--set", f"model.path={request.getfixturevalue('own_model').as_posix()}",
                     "--set", 'data.sources=["pgs:quickstart/train.jsonl"]']
    assert main(["validate", str(path), *standins]) == 0, capsys.readouterr().err


def test_finetune_spec_refuses_a_missing_model_in_one_line(tmp_path, capsys):
    """Validation of the plain recipe is about the user's model: a folder that is not there is
    one line naming model.path, exit 2."""
    spec = next(p for p in SPECS if p.name == "finetune.toml")
    assert main(["validate", str(spec), "--set", f"model.path={(tmp_path / 'nowhere').as_posix()}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0], err


def test_there_are_shipped_specs():
    assert any(p.name == "quickstart.toml" for p in SPECS)
