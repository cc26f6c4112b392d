"""``[distill]`` in the spec: defaults, every field's refusal named by field, the round trip,
and ``pgs validate`` refusing a teacher whose tokenizer or vocabulary differs from the student's."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pgs.cli import main
from pgs.errors import SpecError
from pgs.runtime.spec.load import DistillSpec, load_spec, spec_from_dict
from pgs.runtime.spec.preflight import check_resources
from helpers import model_toml, write_toml
from tiny import tiny_config, tiny_table

SMALL = dict(num_hidden_layers=1, max_position_embeddings=256, tie_word_embeddings=None)
ARCH = tiny_table(**SMALL)
TOKENIZER = Path(__file__).resolve().parents[2] / "pgs" / "assets" / "quickstart" / "tokenizer"

SPEC = model_toml(init_seed=None, **SMALL) + """[data]
sources = ["pgs:quickstart/train.jsonl"]
eval = "pgs:quickstart/eval.jsonl"
max_seq_len = 256
[train]
steps = 2
batch_size = 2
[checkpoint]
dir = "{run_dir}"
[distill]
{distill}
"""

CONFIG_TEACHER = 'teacher_config = { model_type = "qwen3", hidden_size = 64, intermediate_size = 128, ' \
                 'num_hidden_layers = 2, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 32 }'


def write(tmp_path: Path, distill: str = CONFIG_TEACHER) -> Path:
    return write_toml(tmp_path / "spec.toml", SPEC, distill=distill, run_dir=tmp_path / "run")


def teacher_folder(tmp_path: Path, tokenizer=None, vocab_size: int | None = None) -> Path:
    """A local teacher folder: config.json and a tokenizer (no weights: validate reads none)."""
    folder = tmp_path / "teacher"
    tok = tokenizer or AutoTokenizer.from_pretrained(TOKENIZER)
    table = dict(ARCH)
    table.pop("model_type")
    tiny_config("qwen3", vocab_size=vocab_size or len(AutoTokenizer.from_pretrained(TOKENIZER)),
                **table).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_defaults_and_round_trip(tmp_path):
    spec = load_spec(write(tmp_path))
    d = spec.distill
    assert (d.kind, d.jsd_beta, d.temperature, d.on_policy, d.teacher_dtype) == ("jsd", 0.5, 1.0, 0.5, "bfloat16")
    assert d.generation_settings() == {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}
    assert spec.checkpoint.best_metric == "eval_distill_kl"
    assert spec_from_dict(tomllib.loads(spec.to_toml()), "/") == spec
    full = CONFIG_TEACHER + "\non_policy = 1\nkind = \"jsd\"\nbeta = 0.1\ntemperature = 2\n" \
                            "[distill.generation]\nmax_new_tokens = 8\ntemperature = 0\ntop_p = 0.9\n"
    spec = load_spec(write(tmp_path, full))
    assert spec.distill.jsd_beta == 0.1 and spec.distill.on_policy == 1.0
    assert spec.distill.generation_settings() == {"max_new_tokens": 8, "temperature": 0, "top_p": 0.9}
    assert spec_from_dict(tomllib.loads(spec.to_toml()), "/") == spec


@pytest.mark.parametrize("lines,message", [
    ("", "distill: set exactly one of distill.teacher_path (a local Hugging Face folder) or distill.teacher_config"),
    (CONFIG_TEACHER + '\nteacher_path = "x"', "distill: set exactly one of"),
    (CONFIG_TEACHER + '\nkind = "kl"', "distill.kind: 'kl' is not one of 'forward_kl', 'reverse_kl', 'jsd'"),
    (CONFIG_TEACHER + '\nkind = "reverse_kl"\nbeta = 0.3', "distill.beta: 0.3 has no effect with kind = 'reverse_kl'"),
    (CONFIG_TEACHER + "\nbeta = 1", "distill.beta: expected a number in (0, 1) (exclusive), got a number (1.0)"),
    (CONFIG_TEACHER + "\non_policy = 1.5", "distill.on_policy: expected a number in [0.0, 1.0]"),
    (CONFIG_TEACHER + "\ntemperature = 0", "distill.temperature: expected a number > 0"),
    (CONFIG_TEACHER + '\nteacher_dtype = "fp8"', "distill.teacher_dtype: 'fp8' is not one of"),
    (CONFIG_TEACHER + "\neval_prompts = -1", "distill.eval_prompts: expected an integer >= 0"),
    (CONFIG_TEACHER + "\nlambda = 0.5", "distill.lambda: unknown key"),
    (CONFIG_TEACHER + "\n[distill.generation]\nmax_new_tokens = 0", "distill.generation.max_new_tokens: expected an integer >= 1"),
    (CONFIG_TEACHER + "\n[distill.generation]\ntemperature = -1", "distill.generation.temperature: expected a number >= 0"),
    (CONFIG_TEACHER + "\n[distill.generation]\ntop_p = 0", "distill.generation.top_p: expected a number in (0, 1]"),
    (CONFIG_TEACHER + "\n[distill.generation]\ntop_k = 5", "distill.generation.top_k: unknown key (did you mean top_p?)"),
    ("teacher_config = { hidden_size = 8 }", "distill.teacher_config.model_type: needed"),
    ('teacher_path = "no/such/folder"', "distill.teacher_path: no such folder"),
])
def test_every_field_is_checked_by_name(tmp_path, lines, message):
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, lines))
    assert message in str(err.value), str(err.value)


def test_preference_and_distill_together_are_refused(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text() + "\n[preference]\nkind = \"dpo\"\n")
    with pytest.raises(SpecError, match="either preference optimization"):
        load_spec(path)


def test_validate_accepts_a_teacher_with_the_students_tokenizer(tmp_path, capsys):
    folder = teacher_folder(tmp_path)
    facts = check_resources(load_spec(write(tmp_path, f'teacher_path = "{folder}"')), records=20)
    assert facts["distill"].startswith(f"teacher {folder} (bfloat16); jsd, beta 0.5")
    assert main(["validate", str(write(tmp_path, CONFIG_TEACHER))]) == 0
    assert "random init (qwen3)" in capsys.readouterr().out


def test_validate_refuses_a_teacher_tokenizer_that_differs(tmp_path, capsys):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    folder = teacher_folder(tmp_path, tok)
    code = main(["validate", str(write(tmp_path, f'teacher_path = "{folder}"'))])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert ("pgs: error: distill.teacher_path: the teacher's tokenizer differs from the student's: "
            "chat rendering of sample conversation 0 differs at character 12") in err, err


def test_validate_refuses_a_teacher_head_of_another_size(tmp_path, capsys):
    folder = teacher_folder(tmp_path, vocab_size=1024)
    code = main(["validate", str(write(tmp_path, f'teacher_path = "{folder}"'))])
    err = capsys.readouterr().err
    assert code == 2 and "distill.teacher_path: the teacher's head has 1024 rows but the student's has" in err, err
    code = main(["validate", str(write(tmp_path, CONFIG_TEACHER.replace("head_dim = 32", "head_dim = 32, vocab_size = 999")))])
    err = capsys.readouterr().err
    assert code == 2 and "distill.teacher_config: the teacher's head has 999 rows" in err, err
