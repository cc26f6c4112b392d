"""Golden regression: what pinned tiny runs produce on the CPU, compared with a committed record.

Three short runs of tiny random-init models on the quickstart data — SFT (cosine schedule,
AdamW with weight decay, two micro-batches a step), DPO (a cached reference) and on-policy
distillation (the student samples half the steps) — and greedy decodes of the SFT run's
exported model through transformers.  Each step's loss and gradient norm (and the objective's
own numbers: rewards, margins, the on-policy flag) must equal ``tests/integration/golden/golden.json``;
the decoded token ids must equal it exactly.  A change that moves any of them — the loss
normalisation, the schedule, the data order, the chain, the sampler, the export — fails here
even when every property test still holds.

The runs use one intra-op thread (the sums are then ordered the same on every run of a
machine); floats are compared to a relative 1e-5, far below what any behavioural change moves
(a step's loss moves by 1e-3 or more) and above the last-bit differences of another CPU's
vector kernels.

Re-record after an intended change (and say why in the commit):

    PGS_GOLDEN_RECORD=1 python -m pytest tests/integration/test_golden.py

which rewrites the record and then fails, so a re-record never passes silently in CI.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from helpers import LOOP, inline_table, loop_fields, model_toml, quickstart_head, step_records, write_toml
from tiny import tiny_table

GOLDEN = Path(__file__).resolve().parent / "golden" / "golden.json"
RECORD = os.environ.get("PGS_GOLDEN_RECORD") == "1"
RTOL = 1e-5

SFT = model_toml(max_position_embeddings=256) + """
[data]
sources = ["{train}"]
max_seq_len = 128
seed = 1
""" + LOOP

DPO = model_toml(max_position_embeddings=256) + """
[data]
sources = ["{train}"]
max_seq_len = 192
seed = 1

[preference]
kind = "dpo"
beta = 0.5
reference = "cached"
""" + LOOP

DISTILL = """
[model]
tokenizer = "pgs:quickstart/tokenizer"
init_seed = 3
config = {student}

[data]
sources = ["{train}"]
max_seq_len = 192
seed = 1

[distill]
teacher_config = {teacher}
teacher_init_seed = 0
teacher_dtype = "float32"
on_policy = 0.5
kind = "jsd"
eval_prompts = 0

[distill.generation]
max_new_tokens = 6
temperature = 1.0
top_p = 0.95
""" + LOOP

#: what each run's step records keep (those present in the record)
KEYS = ("loss", "grad_norm", "lr", "entropy", "reward_chosen", "reward_rejected", "reward_margin",
        "preference_accuracy", "on_policy", "valid_tokens", "trained_tokens", "pairs")


def _train(spec_path: Path) -> list[dict]:
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run(load_spec(spec_path)) == 0
    finally:
        torch.set_num_threads(threads)
    run_dir = Path(load_spec(spec_path).checkpoint.dir)
    return [{k: r[k] for k in ("step", *KEYS) if k in r} for r in step_records(run_dir)]


def _decode(model_dir: Path, prompts: list[str], new_tokens: int = 12) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by the exported model, through transformers alone
    (``new_tokens`` each: a model this briefly trained would otherwise stop at once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            tokens = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id or 0)
            out.append(tokens[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def produced(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("golden")
    sft_data, pairs, chats = tmp / "train.jsonl", tmp / "pairs.jsonl", tmp / "chats.jsonl"
    quickstart_head("train.jsonl", 96, sft_data)
    quickstart_head("pairs_train.jsonl", 48, pairs)
    quickstart_head("train.jsonl", 64, chats)
    weight_decay_cosine = dict(weight_decay=0.1, schedule='name = "cosine"\npeak = 3e-3\nwarmup = 3')
    sft = write_toml(tmp / "sft.toml", SFT, **loop_fields(
        **weight_decay_cosine, steps=10, train=sft_data, run_dir=tmp / "sft", export="true"))
    dpo = write_toml(tmp / "dpo.toml", DPO, **loop_fields(steps=6, train=pairs, run_dir=tmp / "dpo"))
    distill = write_toml(tmp / "distill.toml", DISTILL, **loop_fields(
        steps=6, train=chats, run_dir=tmp / "distill",
        student=inline_table(tiny_table(max_position_embeddings=256)),
        teacher=inline_table(tiny_table(max_position_embeddings=256, hidden_size=48, num_hidden_layers=1))))
    out = {"sft": _train(sft), "dpo": _train(dpo), "distill": _train(distill)}
    prompts = ["<|im_start|>user\nWhat is 47 + 58?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWhat is the weather in Oslo?<|im_end|>\n<|im_start|>assistant\n"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out["decode"] = {"prompts": prompts, "tokens": _decode(tmp / "sft" / "final", prompts)}
    finally:
        torch.set_num_threads(threads)
    return out


def _mismatches(name: str, got, want, path: str = "") -> list[str]:
    """Every place where ``got`` differs from ``want`` (floats to ``RTOL``), as readable lines."""
    where = f"{name}{path}"
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}"]
        return [m for k in want for m in _mismatches(name, got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [m for i, (g, w) in enumerate(zip(got, want)) for m in _mismatches(name, g, w, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)):
        if math.isclose(got, want, rel_tol=RTOL, abs_tol=1e-9) or (math.isnan(got) and math.isnan(want)):
            return []
        return [f"{where}: {got!r} != {want!r} (relative {abs(got - want) / max(abs(want), 1e-30):.2e})"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


@pytest.mark.parametrize("name", ["sft", "dpo", "distill", "decode"])
def test_golden(produced, name):
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        record = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        record[name] = produced[name]
        GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"re-recorded {name} into {GOLDEN} (PGS_GOLDEN_RECORD=1): commit it with the reason")
    want = json.loads(GOLDEN.read_text())[name]
    problems = _mismatches(name, produced[name], want)
    assert not problems, "the pinned run moved from tests/integration/golden/golden.json:\n" + "\n".join(problems[:20])


def test_the_record_holds_every_run_and_is_not_trivial():
    """The committed record is what the test compares against: every run present, losses that move."""
    record = json.loads(GOLDEN.read_text())
    assert set(record) == {"sft", "dpo", "distill", "decode"}
    for name in ("sft", "dpo", "distill"):
        losses = [r["loss"] for r in record[name]]
        assert len(losses) >= 6 and all(math.isfinite(x) for x in losses)
        assert len(set(losses)) > 1, f"{name}: every step's loss the same"
    assert any(record["distill"][i].get("on_policy") for i in range(len(record["distill"])))
    tokens = record["decode"]["tokens"]
    assert all(len(t) == 12 for t in tokens) and tokens[0] != tokens[1]


def test_mismatches_names_what_moved():
    """The comparison itself: a loss moved by 1e-3 and a changed token are both reported."""
    want = {"a": [{"loss": 1.0, "step": 1}], "t": [[1, 2, 3]]}
    assert _mismatches("x", {"a": [{"loss": 1.0 + 5e-7, "step": 1}], "t": [[1, 2, 3]]}, want) == []
    moved = _mismatches("x", {"a": [{"loss": 1.001, "step": 1}], "t": [[1, 2, 4]]}, want)
    assert len(moved) == 2 and "x.a[0].loss" in moved[0] and "x.t[0][2]" in moved[1]
