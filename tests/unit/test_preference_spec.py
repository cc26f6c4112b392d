"""``[preference]`` in the spec: defaults, every field's refusal named by field, the round trip,
and ``pgs validate`` of a preference spec (its data through the pair pipeline)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pgs.errors import DataError, SpecError
from pgs.runtime.spec.load import PreferenceSpec, load_spec, spec_from_dict
from pgs.runtime.spec.preflight import check_resources
from helpers import model_toml, write_toml

SPEC = model_toml(init_seed=None, num_hidden_layers=1, max_position_embeddings=256,
                  tie_word_embeddings=None) + """[data]
sources = ["{train}"]
eval = "pgs:quickstart/pairs_eval.jsonl"
max_seq_len = 256
[train]
steps = 2
batch_size = 2
[checkpoint]
dir = "{run_dir}"
[preference]
{preference}
"""


def write(tmp_path: Path, preference: str = "", train: str = "pgs:quickstart/pairs_train.jsonl") -> Path:
    return write_toml(tmp_path / "spec.toml", SPEC, preference=preference, train=train, run_dir=tmp_path / "run")


def test_defaults_and_round_trip(tmp_path):
    spec = load_spec(write(tmp_path))
    assert spec.preference == PreferenceSpec()
    assert (spec.preference.kind, spec.preference.beta, spec.preference.reference) == ("dpo", 0.1, "cached")
    assert spec.checkpoint.best_metric == "eval_preference_accuracy"  # not SFT's eval_loss
    assert spec_from_dict(tomllib.loads(spec.to_toml()), "/") == spec
    assert load_spec(write(tmp_path, "")).preference is not None
    plain = write(tmp_path).read_text().replace("[preference]\n", "")
    (tmp_path / "sft.toml").write_text(plain)
    assert load_spec(tmp_path / "sft.toml").preference is None


@pytest.mark.parametrize("line,message", [
    ('kind = "sigmoid"', "preference.kind: 'sigmoid' is not one of 'dpo', 'ipo', 'hinge', 'dpop', 'simpo', 'orpo'"),
    ('kind = "dpoo"', "(did you mean dpo?)"),
    ("beta = 0", "preference.beta: expected a number > 0, got a number (0.0)"),
    ("beta = true", "preference.beta: expected a number > 0"),
    ("label_smoothing = 0.5", "preference.label_smoothing: expected a number in [0, 0.5)"),
    ('kind = "ipo"\nlabel_smoothing = 0.1', "preference.label_smoothing: 0.1 has no effect with kind = 'ipo'"),
    ("gamma = 1.0", "preference.gamma: 1.0 has no effect with kind = 'dpo' (only kind = 'simpo' reads it)"),
    ("lam = -1", "preference.lam: expected a number >= 0.0"),
    ("nll_weight = -0.5", "preference.nll_weight: expected a number >= 0.0"),
    ('reference = "precomputed"', "preference.reference: 'precomputed' is not one of 'cached', 'live'"),
    ('reference_path = "nowhere"', "preference.reference_path: no such folder"),
    ('kind = "simpo"\nreference_path = "."', "preference.reference_path: kind = 'simpo' uses no reference model"),
    ("betta = 0.2", "preference.betta: unknown key (did you mean beta?)"),
])
def test_each_field_is_checked_by_name(tmp_path, line, message):
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, line))
    assert message in str(err.value)


def test_validate_reads_pairs_and_names_a_bad_one(tmp_path):
    facts = check_resources(load_spec(write(tmp_path, 'kind = "simpo"\ngamma = 0.5')), records=50)
    assert facts["pairs"].startswith("50 pairs checked") and "simpo" in facts["preference"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "chosen": "a", "rejected": "a"}\n')
    with pytest.raises(DataError, match=rf"^{bad}:2: 'chosen' and 'rejected' are identical$"):
        check_resources(load_spec(write(tmp_path, "", train=str(bad))))
    weighted = write(tmp_path).read_text().replace(f'sources = ["pgs:quickstart/pairs_train.jsonl"]',
                                                  'sources = [{ path = "pgs:quickstart/pairs_train.jsonl", weight = 2 }]')
    (tmp_path / "w.toml").write_text(weighted)
    with pytest.raises(SpecError, match=r"data.sources\[0\].weight: a preference run reads every pair"):
        check_resources(load_spec(tmp_path / "w.toml"))


def test_data_inspect_shows_both_arms_with_their_scored_tokens(tmp_path, capsys):
    from pgs.cli import main

    assert main(["data", "inspect", str(write(tmp_path)), "-n", "1", "--records", "20"]) == 0
    out = capsys.readouterr().out
    assert "pairs_train.jsonl:1 chosen" in out and "pairs_train.jsonl:1 rejected" in out
    assert "[[78<|im_end|>]]" in out and "[[48<|im_end|>]]" in out
    assert "preference data statistics" in out
