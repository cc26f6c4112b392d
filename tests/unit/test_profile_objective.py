"""``pgs profile`` for the objective the spec trains (pgs/runtime/tools/profile.py): ``--measure``
runs the ``[preference]`` step (pairs, the live reference's forward) and the ``[distill]`` step
(on-policy samples, the teacher's forward) through the objectives' own code, on the CPU with
``TensorMeter``; the prediction adds a live reference's weights and a teacher's."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from pgs.runtime.loop import distill as distill_mod, preference as preference_mod
from pgs.runtime.spec.load import load_spec
from pgs.runtime.tools.profile import (TensorMeter, measure_memory, model_bytes, plan_from_spec, predict_memory,
                                       profile)

MODEL = ('model_type = "qwen3", hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, '
         'num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8, tie_word_embeddings = true')
TEACHER = MODEL.replace("hidden_size = 32", "hidden_size = 48").replace("num_hidden_layers = 2", "num_hidden_layers = 1")

SPEC = """
[model]
config = {{ {model} }}
tokenizer = "pgs:quickstart/tokenizer"
dtype = "{dtype}"

[data]
max_seq_len = {seq}
sources = [{{ path = "pgs:quickstart/train.jsonl", weight = 1.0 }}]

[optimizer]
alias = "adamw"
clip = {clip}

[train]
steps = 10
batch_size = {batch}
device = "cpu"

[checkpoint]
dir = "{run_dir}"

{section}
"""

PREFERENCE = '[preference]\nkind = "dpo"\nreference = "{reference}"\n'
DISTILL = (f'[distill]\nteacher_config = {{ {TEACHER} }}\nteacher_dtype = "float32"\non_policy = 0.5\n\n'
           '[distill.generation]\nmax_new_tokens = 8\n')


def spec_of(tmp_path, section: str = "", batch: int = 2, seq: int = 64, dtype: str = "float32", model: str = MODEL):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "spec.toml"
    clip = 0 if "gradient_release" in section else 1.0  # release needs the chain without a global clip
    path.write_text(SPEC.format(model=model, batch=batch, seq=seq, dtype=dtype, clip=clip, run_dir=tmp_path / "run",
                                section=section))
    return load_spec(path)


def run_profile(spec) -> str:
    buf = io.StringIO()
    assert profile(spec, measure=True, console=Console(file=buf, width=200)) == 0
    return buf.getvalue()


def count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_tensor_meter_counts_live_storages_once():
    meter = TensorMeter(torch.device("cpu"))
    with meter:
        a = torch.zeros(1024, 256)  # 1 MiB
        view = a[:10]  # the same storage
        assert meter.current() == 2**20
        b = a + 1
        assert meter.current() == 2 * 2**20
        del a, view
        assert meter.current() == 2**20  # a's storage is gone
        meter.reset()
        c = b * 2
        del c
        assert meter.peak() == 2 * 2**20 and meter.current() == 2**20
        x = torch.ones(256, 256, requires_grad=True)
        (x * x).sum().backward()  # backward's tensors are counted too
        assert x.grad is not None and meter.current() >= 2**20 + 2 * 256 * 256 * 4
        del b, x


def test_measure_runs_the_preference_step_with_its_live_reference(tmp_path, monkeypatch):
    """The measured step is DPO's: rows of pairs, the live reference scored each step (its own
    model, not the policy), and a reference's weights more on the device than with the cache."""
    live = spec_of(tmp_path / "live", PREFERENCE.format(reference="live"))
    cached = spec_of(tmp_path / "cached", PREFERENCE.format(reference="cached"))
    logps = count_calls(monkeypatch, preference_mod, "pair_logps")
    text = run_profile(live)
    assert "the preference (dpo, reference live) step" in text and "2 rows × 64 tokens, 2 pairs" in text
    assert "sft" not in text.split("measured on")[1]
    models = {id(args[0]) for args in logps}
    assert len(models) == 2 and len(logps) == 2 * 3  # policy and reference, 3 steps
    assert not (tmp_path / "live" / "run").exists()  # nothing written: no reference cache

    measured = {s: measure_memory(sp, plan_from_spec(sp), steps=1)
                for s, sp in (("live", live), ("cached", cached))}
    assert "reference cached" in measured["cached"].objective
    weights = predict_memory(**_kw(live))["weights"]
    extra = measured["live"].phases["static"] - measured["cached"].phases["static"]
    assert abs(extra - weights) <= 0.02 * weights, (extra, weights)
    assert set(measured["live"].phases) == {"static", "forward", "backward", "step"}


def _kw(spec) -> dict:
    plan = plan_from_spec(spec)
    return {"model_config": plan["config"], **plan["kwargs"]}


def test_measure_runs_the_distill_step_sampling_and_the_teacher(tmp_path, monkeypatch):
    """The measured step is on-policy distillation: prompts sampled from (a ``prepare`` phase),
    the teacher built and run on the sampled rows, the divergence over the sampled tokens."""
    spec = spec_of(tmp_path, DISTILL)
    teachers = count_calls(monkeypatch, distill_mod, "load_teacher")
    scored = count_calls(monkeypatch, distill_mod.DistillObjective, "teacher_hidden")
    sampled = count_calls(monkeypatch, distill_mod, "generate")
    text = run_profile(spec)
    assert "the distill (jsd, teacher" in text and "every step on-policy" in text
    assert len(teachers) == 1 and len(scored) == 3 and len(sampled) == 3
    # 2 rows, prompts of 64 − 8 tokens, 8 sampled tokens each (a stop token may end one early)
    assert "2 rows × 64 tokens" in text and "tokens sampled" in text
    lines = [line for line in text.splitlines() if "│" in line]
    assert any(line.split("│")[1].strip() == "prepare" for line in lines)
    measured = measure_memory(spec, plan_from_spec(spec), steps=1)
    teacher = model_bytes(distill_mod.load_teacher(spec, _tokenizer(spec), torch.device("cpu")))
    sft = measure_memory(spec_of(tmp_path / "sft"), plan_from_spec(spec_of(tmp_path / "sft")), steps=1)
    extra = measured.phases["static"] - sft.phases["static"]
    assert abs(extra - teacher) <= 0.02 * teacher, (extra, teacher)


def _tokenizer(spec):
    from pgs.runtime.model.loading import load_tokenizer

    return load_tokenizer(spec.model.tokenizer)


def test_measure_of_an_sft_spec_names_sft(tmp_path):
    text = run_profile(spec_of(tmp_path))
    assert "the sft (ce) step" in text and "2 rows × 64 tokens, 126 trained tokens" in text
    assert "prepare" not in text


#: Qwen3-0.6B's shape (sized on the meta device only: nothing is built)
QWEN3_06B = ('model_type = "qwen3", hidden_size = 1024, intermediate_size = 3072, num_hidden_layers = 28, '
             'num_attention_heads = 16, num_key_value_heads = 8, head_dim = 128, vocab_size = 151936, '
             'tie_word_embeddings = true')


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_prediction_of_a_live_reference_adds_its_weights(tmp_path, checkpointing):
    """At Qwen3-0.6B's shape (bf16, 1×2048), a live reference costs one more copy of the policy's
    weights at the peak, within 5%; a cached one costs what SFT costs (its scoring pass before
    the first step is not the peak)."""
    memory = f'\n[memory]\nactivation_checkpointing = "{checkpointing}"\n'
    pred = {}
    for name, section in (("live", PREFERENCE.format(reference="live")),
                          ("cached", PREFERENCE.format(reference="cached")), ("sft", "")):
        spec = spec_of(tmp_path / name, section + memory, batch=1, seq=2048, dtype="bfloat16", model=QWEN3_06B)
        pred[name] = predict_memory(**_kw(spec))
    weights = pred["live"]["weights"]
    assert pred["live"]["frozen_models"] == weights and pred["cached"]["frozen_models"] == 0
    assert pred["cached"]["peak"] == pred["sft"]["peak"]
    assert weights <= pred["live"]["peak"] - pred["cached"]["peak"] <= 1.05 * weights, (pred, weights)


def test_prediction_adds_the_teacher(tmp_path):
    """The teacher's weights (as ``load_teacher`` builds them) join a distill spec's, and its
    peak is above SFT's by at least them."""
    spec = spec_of(tmp_path / "d", DISTILL)
    distill = predict_memory(**_kw(spec))
    sft = predict_memory(**_kw(spec_of(tmp_path / "s")))
    teacher = model_bytes(distill_mod.load_teacher(spec, _tokenizer(spec), torch.device("cpu")))
    assert distill["frozen_models"] == teacher
    assert distill["peak"] >= sft["peak"] + teacher


@pytest.mark.parametrize("reference", ["live", "cached"])
def test_prediction_title_names_the_objective(tmp_path, reference):
    buf = io.StringIO()
    assert profile(spec_of(tmp_path, PREFERENCE.format(reference=reference)),
                   console=Console(file=buf, width=200)) == 0
    assert f"predicted memory of the preference (dpo, reference {reference}) step" in buf.getvalue()


def test_measure_under_release_defers_the_pair_head_gradient(tmp_path, monkeypatch):
    """With gradient release, checkpointing and a tied head the measured preference step hands
    the head's gradient to the optimizer as ``pgs run`` does (``PreferenceObjective.forward`` →
    ``GradientRelease.before_step``) once a micro-batch."""
    from pgs.runtime.optim.release import GradientRelease

    section = (PREFERENCE.format(reference="live")
               + '\n[memory]\ngradient_release = true\nactivation_checkpointing = "full"\n')
    spec = spec_of(tmp_path, section, dtype="bfloat16")
    handed = count_calls(monkeypatch, GradientRelease, "before_step")
    measured = measure_memory(spec, plan_from_spec(spec), steps=2)
    assert len(handed) == 2 and "reference live" in measured.objective
    assert measured.phases["backward"] > measured.phases["static"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type, inter, kv_heads, exact", [("qwen3", 240, 1, True), ("llama", 16, 4, False)])
def test_a_no_grad_forward_holds_what_layer_working_bytes_says(model_type, inter, kv_heads, exact, dtype):
    """A frozen model's no-grad forward (a reference's, a teacher's, the scoring pass) counted by
    ``TensorMeter``: with the MLP's phase the largest (Qwen3's shapes) the bound is the live
    bytes exactly; where attention's is (a tiny MLP, no GQA) an upper bound within 15%."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pgs.runtime.model.build import base_hidden
    from pgs.runtime.tools.profile import layer_working_bytes

    cfg = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64, intermediate_size=inter, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32,
                               attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    n = 128
    ids, positions = torch.randint(0, 96, (1, n)), torch.arange(n)[None]
    with torch.no_grad(), TensorMeter(torch.device("cpu")) as meter:
        base_hidden(model, ids, positions)
        measured = meter.peak()
    bound = layer_working_bytes(cfg, n, dtype)
    assert measured <= bound <= (1.0 if exact else 1.15) * measured, (measured, bound)


def test_dpo_on_the_4b_recipe_is_sized_by_its_step_not_its_scoring_pass():
    """The 4B 12 GiB recipe with a cached DPO reference (4096-token rows of two pairs): the scoring
    pass (8 rows of 4096 tokens through the weights alone, before the optimizer's state exists)
    holds a dense layer's no-grad working set, not what the layers would keep for backward, so
    the peak is the step's, equal to SFT's on the same rows, and within the recipe's 12.5 GiB cap
    (its run measured 11.94 GiB allocated, 12.16 reserved on an H100: docs/performance.md).  The
    parts the preflight names are the peak's phase and sum to it."""
    from pgs.runtime.tools.resources import PreflightRefused, check_memory, predict

    sets = ['data.eval=""', 'preference.kind="dpo"', 'preference.reference="cached"', 'checkpoint.best_metric=""']
    spec = load_spec("specs/qwen3_4b_12gib.toml", sets)
    plan = plan_from_spec(spec)
    kwargs = dict(plan["kwargs"], loss_kernels=True)
    b, h, inter, d, tokens = 2, 2560, 9728, 128, 8 * 4096
    assert kwargs["scoring_pass"] == tokens * (b * h + 2 * b * d + 3 * b * h + 3 * b * inter)  # the MLP's phase
    dpo = predict_memory(plan["config"], **kwargs)
    step = predict_memory(plan["config"], **{**kwargs, "scoring_pass": 0})  # SFT's figure: nothing else is added
    assert dpo["peak"] == step["peak"] == sum(dpo["peak_parts"].values())
    assert dpo["weights"] + kwargs["scoring_pass"] < dpo["peak"] < 12.0 * 2**30
    assert set(dpo["peak_parts"]) == {"weights", "optimizer_state", "activations", "loss", "gradients"}
    prediction = predict(spec, torch.device("cuda"))
    check_memory(spec, prediction, torch.device("cuda"), available=16 * 2**30)  # under the 12.5 GiB cap: no refusal
    low = load_spec("specs/qwen3_4b_12gib.toml", sets + ["memory.device_limit_gib=11"])
    with pytest.raises(PreflightRefused) as refused:
        check_memory(low, prediction, torch.device("cuda"), available=16 * 2**30)
    line = str(refused.value)
    named = line.split(" GiB at the peak (")[1].split(" GiB; the largest")[0]
    shown = {k: float(v) for k, v in (part.rsplit(" ", 1) for part in named.split(", "))}
    assert set(shown) == {k for k, v in prediction.parts.items() if v}
    assert sum(shown.values()) == pytest.approx(prediction.peak / 2**30, abs=0.01 * len(shown))


@pytest.mark.parametrize("reference", ["cached", "live"])
def test_a_preference_evaluation_is_a_phase_beside_the_state(tmp_path, reference):
    """Held-out pairs are scored 8 rows of ``max_seq_len`` a forward (``eval_batches``) while the
    weights and the optimizer's state live: with ``data.eval`` and ``eval_every`` the prediction
    has that phase (the scoring pass's working set), and at 8 rows of 512 tokens against a
    micro-batch of one row it is the peak, named ``evaluation``; without them, none."""
    spec_of(tmp_path, PREFERENCE.format(reference=reference), batch=1, seq=512)
    plain = load_spec(tmp_path / "spec.toml")
    held = load_spec(tmp_path / "spec.toml", ['data.eval="pgs:quickstart/train.jsonl"', "train.eval_every=5"])
    without, kw = predict_memory(**_kw(plain)), _kw(held)
    assert "eval_pass" not in _kw(plain) and kw["eval_pass"] > 0
    with_eval = predict_memory(**kw)
    static = sum(with_eval[k] for k in ("weights", "frozen_models", "master_weights", "optimizer_state"))
    assert with_eval["peak"] == static + kw["eval_pass"] > without["peak"]
    assert with_eval["peak_parts"]["evaluation"] == kw["eval_pass"]
    if reference == "cached":
        assert kw["eval_pass"] == kw["scoring_pass"]


def test_profile_names_the_peak_phase_parts_that_sum_to_it(tmp_path):
    """``pgs profile`` prints the parts live at the peak's phase and their sum, the figure of its
    "peak" row."""
    import re

    spec_of(tmp_path, PREFERENCE.format(reference="cached"), batch=1, seq=512)
    held = load_spec(tmp_path / "spec.toml", ['data.eval="pgs:quickstart/train.jsonl"', "train.eval_every=5"])
    buf = io.StringIO()
    assert profile(held, console=Console(file=buf, width=200)) == 0
    text = buf.getvalue()
    line = next(x for x in text.splitlines() if x.startswith("the peak's phase: "))
    named, total = line[len("the peak's phase: "):].rsplit(" = ", 1)
    parts = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in named.split(" + "))}
    assert {"weights", "optimizer_state"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(float(total.split()[0]), abs=0.002 * len(parts))
    shown = float(re.search(r"peak \(what is live together at the worst phase\)\s*│\s*([\d.]+)", text).group(1))
    assert shown == float(total.split()[0])
