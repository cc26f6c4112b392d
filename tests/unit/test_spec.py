"""Spec loading, overrides, the TOML round trip, and building chains and schedules."""

from __future__ import annotations

import math
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

import pgs.func as pf
from pgs.errors import SpecError
from pgs.runtime.spec.load import ASSETS_DIR, Spec, apply_override, dumps, load_spec, parse_value, spec_from_dict
from pgs.runtime.spec.chain import alias_names, compile_mask, transform_names

SPEC = """\
[model]
config = { model_type = "qwen3", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, vocab_size = 0 }
tokenizer = "pgs:quickstart/tokenizer"
[data]
max_seq_len = 128
sources = [{ path = "train.jsonl", weight = 2 }]
eval = "pgs:quickstart/eval.jsonl"
[optimizer]
chain = [
  { name = "clip_by_global_norm", max_norm = 1.0 },
  { name = "scale_by_adam", b2 = 0.95 },
  { name = "add_decayed_weights", weight_decay = 0.1, mask = "ndim>=2" },
  { name = "scale_by_learning_rate" },
]
[schedule]
name = "cosine"
peak = 1e-3
warmup = 10
[train]
steps = 100
batch_size = 4
[checkpoint]
dir = "runs/x"
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    shutil.copy(ASSETS_DIR / "quickstart" / "train.jsonl", tmp_path / "train.jsonl")
    path = tmp_path / "spec.toml"
    path.write_text(SPEC, encoding="utf-8")
    return path


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _step(opt, n=3):
    params = _params()
    state = opt.init(params)
    out = []
    for i in range(n):
        grads = {k: torch.full_like(v, 0.1 * (i + 1)) for k, v in params.items()}
        updates, state = opt.update(grads, state, params)
        params = pf.apply_updates(params, updates)
        out.append(params)
    return out


def test_paths_resolve_against_the_spec_folder_and_the_assets(spec_file: Path):
    spec = load_spec(spec_file)
    assert spec.data.sources[0].path == str(spec_file.parent / "train.jsonl")
    assert spec.data.sources[0].weight == 2.0
    assert spec.data.eval == str(ASSETS_DIR / "quickstart" / "eval.jsonl")
    assert spec.model.tokenizer == str(ASSETS_DIR / "quickstart" / "tokenizer")
    assert spec.checkpoint.dir == str(spec_file.parent / "runs" / "x")
    assert spec.source == str(spec_file)
    assert isinstance(spec.schedule.peak, float) and spec.train.device == "auto"


def test_defaults_adamw_with_clipping(spec_file: Path):
    spec = load_spec(spec_file, ["optimizer.alias=adamw"])  # drops the chain: the command line wins
    assert spec.optimizer.chain is None and spec.optimizer.alias == "adamw" and spec.optimizer.clip == 1.0
    names = [c.name for c in spec.build_chain().children]
    assert names[0] == "clip_by_global_norm"


def test_overrides(spec_file: Path):
    spec = load_spec(spec_file, [
        "train.steps=20", 'optimizer.chain[1].b2=0.9', "schedule.warmup=2",
        'model.dtype="bfloat16"', "data.sources[0].weight=0.5", "log.wandb=true",
    ])
    assert spec.train.steps == 20 and spec.schedule.warmup == 2 and spec.model.dtype == "bfloat16"
    assert spec.optimizer.chain[1].args == {"b2": 0.9}
    assert spec.data.sources[0].weight == 0.5 and spec.log.wandb is True
    spec = load_spec(spec_file, ["train.epochs=2"])  # drops train.steps
    assert spec.train.steps is None and spec.train.epochs == 2


@pytest.mark.parametrize("assignment, message", [
    ("train.steps", "expected KEY=VALUE"),
    ("optimizer.chain[9].b2=1", "optimizer.chain has 4 entries, no [9]"),
    ("train.steps=[1,", "cannot read"),
    ("train..steps=1", "is not a key name"),
    ("train.stepz=1", "train.stepz: unknown key (did you mean steps?)"),
])
def test_bad_overrides(spec_file: Path, assignment: str, message: str):
    with pytest.raises(SpecError, match=re.escape(message)):
        load_spec(spec_file, [assignment])


def test_parse_value():
    assert parse_value("20") == 20 and parse_value("3e-4") == 3e-4 and parse_value("true") is True
    assert parse_value('"lion"') == "lion" and parse_value("lion") == "lion"
    assert parse_value("[1, 2]") == [1, 2] and parse_value("{ a = 1 }") == {"a": 1}
    raw = {"optimizer": {"chain": [{"name": "x"}]}}
    apply_override(raw, "optimizer.alias=lion")
    assert raw == {"optimizer": {"alias": "lion"}}


def test_round_trip(spec_file: Path, tmp_path: Path):
    spec = load_spec(spec_file, ['model.freeze=["q_proj\\\\.\\"weight", "\\u00e9"]'])
    out = tmp_path / "spec.resolved.toml"
    text = spec.to_toml(out)
    assert out.read_text(encoding="utf-8") == text
    again = load_spec(out)
    assert again == spec
    assert again.model.freeze == ('q_proj\\."weight', "é")
    for alias in ("lion", "sgd"):
        s = load_spec(spec_file, [f"optimizer.alias={alias}", "optimizer.args={ weight_decay = 0.1 }",
                                  'schedule.name="wsd"', 'schedule.shape="1-sqrt"', "train.epochs=1"])
        assert spec_from_dict(tomllib.loads(s.to_toml()), "/") == s


def test_dumps_values():
    tables = {"a": {"s": 'q"\\\n\t\x01', "f": 1.5, "i": -3, "b": False, "inf": math.inf,
                    "l": [1, "x", [2.0]], "d": {"k y": 1, "n": {"m": "z"}}, "e": {}}}
    assert tomllib.loads(dumps(tables)) == tables


def test_toml_syntax_error_names_file_and_line(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\npath = 'x'\n[train]\nsteps = \n", encoding="utf-8")
    with pytest.raises(SpecError, match=r"bad\.toml:4:\d+: invalid TOML"):
        load_spec(path)
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "missing.toml")


def test_alias_gets_the_schedule(spec_file: Path):
    spec = load_spec(spec_file, ["optimizer.alias=adamw", "optimizer.args={ b2 = 0.95, weight_decay = 0.1 }",
                                 "optimizer.clip=0"])
    schedule = pf.cosine_schedule(1e-3, 10, 100)
    want = pf.adamw(learning_rate=schedule, b2=0.95, weight_decay=0.1)
    for a, b in zip(_step(spec.build_chain()), _step(want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chain_learning_rate_step_gets_the_schedule(spec_file: Path):
    spec = load_spec(spec_file)
    schedule = pf.cosine_schedule(1e-3, 10, 100)
    want = pf.chain(
        pf.clip_by_global_norm(1.0), pf.scale_by_adam(b2=0.95),
        pf.add_decayed_weights(0.1, mask=lambda path, p: p.ndim >= 2), pf.scale_by_learning_rate(schedule),
    )
    for a, b in zip(_step(spec.build_chain()), _step(want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_schedule_goes_where_it_is_declared_not_where_a_signature_has_it(monkeypatch):
    from pgs.runtime.spec.chain import make_transform

    schedule = pf.constant_schedule(0.5)

    def lr_of(name: str, args: dict) -> float:
        t = make_transform(name, args, where="optimizer.chain[0]", learning_rate=schedule)
        return float(t.init({"w": torch.ones(2)}).lr)

    assert lr_of("scale_by_learning_rate", {}) == 0.5
    assert lr_of("scale_by_learning_rate", {"learning_rate": 0.25}) == 0.25  # the entry's own wins

    declared = pf.scale_by_learning_rate

    def undeclared(learning_rate=0.125) -> pf.Transform:  # the same factory, without the declaration
        return declared(learning_rate)

    monkeypatch.setattr(pf, "scale_by_learning_rate", undeclared)
    assert lr_of("scale_by_learning_rate", {}) == 0.125


def test_compiled_optimizer(spec_file: Path):
    spec = load_spec(spec_file, ["optimizer.compile=true", "optimizer.jit=false"])
    opt = spec.build_optimizer()
    assert isinstance(opt, pf.FlatChain)
    for a, b in zip(_step(opt), _step(spec.build_chain())):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("sets, points", [
    (['schedule.name="constant"'], {0: 1e-3, 50: 1e-3}),
    (['schedule.name="linear_warmup"'], {0: 0.0, 5: 5e-4, 60: 1e-3}),
    ([], {10: 1e-3, 100: 0.0}),
    (['schedule.name="wsd"'], {10: 1e-3, 82: 1e-3, 100: 0.0}),  # decay 0 -> 20% of (100 - 10) = 18
    (['schedule.name="power_decay"', "schedule.gamma=1.0"], {10: 1e-3, 55: 5e-4}),
])
def test_schedules(spec_file: Path, sets, points):
    schedule = load_spec(spec_file, sets).build_schedule()
    for step, value in points.items():
        assert float(schedule(step)) == pytest.approx(value, abs=1e-12)


def test_epochs_need_the_length(spec_file: Path):
    spec = load_spec(spec_file, ["train.epochs=3"])
    with pytest.raises(SpecError, match="schedule.total"):
        spec.build_schedule()
    assert spec.total_steps(steps_per_epoch=40) == 120
    assert float(spec.build_schedule(total_steps=120)(120)) == 0.0
    assert len(spec.build_chain(total_steps=120).children) == 4


def test_masks():
    w, v = torch.zeros(2, 2), torch.zeros(2)
    assert compile_mask("all")("x", v) and compile_mask("ndim>=2")("x", w) and not compile_mask("ndim>=2")("x", v)
    keep = compile_mask("no_bias_no_norm")
    assert keep("model.layers.0.mlp.up_proj.weight", w)
    assert not keep("model.layers.0.mlp.up_proj.bias", v)
    assert not keep("model.layers.0.input_layernorm.weight", v) and not keep("model.norm.weight", v)
    assert not keep("transformer.ln_f.weight", v)
    assert compile_mask("re:embed")("model.embed_tokens.weight", w)
    assert not compile_mask("!re:embed")("model.embed_tokens.weight", w)
    with pytest.raises(SpecError, match="did you mean ndim>=2"):
        compile_mask("ndim>2")


def test_transforms_are_looked_up_dynamically(spec_file: Path, monkeypatch):
    assert {"adamw", "lion", "sgd"} <= set(alias_names())
    names = set(transform_names())
    assert {"scale_by_adam", "clip_by_global_norm", "scale_by_learning_rate"} <= names
    assert not names & {"chain", "masked", "partition", "accumulate", "compile", "apply_updates"}

    def scale_by_half(factor: float = 0.5) -> pf.Transform:
        return pf.Transform(lambda params, **extra: (),
                            lambda u, s, params=None, **extra: ({k: factor * g for k, g in u.items()}, s),
                            name="scale_by_half")

    monkeypatch.setattr(pf, "scale_by_half", scale_by_half, raising=False)
    monkeypatch.setattr(pf, "__all__", [*pf.__all__, "scale_by_half"])
    spec = load_spec(spec_file, ['optimizer.chain=[{ name = "scale_by_half", factor = 0.25 }, '
                                 '{ name = "scale_by_learning_rate", learning_rate = 1.0 }]'])
    params = _params()
    updates, _ = spec.build_chain().update({k: torch.ones_like(v) for k, v in params.items()},
                                           spec.build_chain().init(params), params)
    assert torch.equal(updates["w"], torch.full((4, 3), -0.25))


def test_loss_objective(spec_file: Path):
    spec = load_spec(spec_file, ['loss.objective="deformed_log"', "loss.args={ alpha = 0.5 }"])
    assert spec.build_token_loss().alpha == 0.5
    with pytest.raises(SpecError, match="loss.z_loss"):
        load_spec(spec_file, ['loss.backend="cce"', "loss.z_loss=1e-4"])


@pytest.mark.parametrize("assignment, message", [
    ('model.freeze="all"', "model.freeze: 'all' is not one of"),
    ("model.freeze=[1]", r"model.freeze\[0\]: expected a regular expression"),
    ("model.config.vocab_size=-1", "model.config.vocab_size: expected an integer >= 0"),
    ('data.sources=["train.jsonl", 3]', r"data.sources\[1\]: expected a table"),
    ('data.sources=[{ path = "train.jsonl", wieght = 1 }]', r"data.sources\[0\].wieght: unknown key \(did you mean weight\?\)"),
    ('data.truncation="cut"', "data.truncation: 'cut' is not one of"),
    ('optimizer.args={ b2 = 0.9 }', "optimizer.args: only for an alias"),
    ('optimizer.chain=[]', "optimizer.chain: expected a non-empty array"),
    ('optimizer.chain=[{ b2 = 0.9 }]', r"optimizer.chain\[0\].name: needed"),
    ('optimizer.chain[1].mu_dtype="bf16"', r"optimizer.chain\[1\].mu_dtype: 'bf16' is not one of .* \(did you mean bfloat16\?\)"),
    ('schedule.peak=-1.0', "schedule.peak: expected a number >= 0.0"),
    ('schedule.name="wsd"', None),
    ('schedule.name="wsd"\x00', None),
    ('train.device="tpu"', "train.device: 'tpu' is not one of"),
    ('checkpoint.keep=-1', "checkpoint.keep: expected an integer >= 0"),
    ('log="yes"', "log: expected a table"),
])
def test_field_errors(spec_file: Path, assignment: str, message):
    if message is None:
        if "\x00" in assignment:
            with pytest.raises(SpecError):
                load_spec(spec_file, [assignment])
        else:
            assert isinstance(load_spec(spec_file, [assignment]), Spec)
        return
    with pytest.raises(SpecError, match=message):
        load_spec(spec_file, [assignment])
