"""A ``[preference]`` run end to end on the CPU: a tiny Qwen3 (random init) trained with DPO on
the quickstart's pairs; the reference cache (miss, hit, stale refusal), SIGKILL + resume bit
for bit, the metrics, the held-out preference accuracy, ``pgs report``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pgs.runtime.loop.faults import Faults
from pgs.runtime.loop.train import run
from pgs.runtime.spec.load import load_spec
from pgs.runtime.store import reference as cache
from pgs.runtime.tools.report import write_report
from helpers import (LOOP, QUICKSTART, assert_same_checkpoint, launch, loop_fields, model_toml, quickstart_head,
                     records, run_here, run_plain_and_released, step_records, write_toml)

pytestmark = pytest.mark.slow  # ~3 minutes on two busy CPU cores

SPEC = model_toml(max_position_embeddings=256) + """
[data]
sources = ["{train}"]
eval = "{eval}"
max_seq_len = 192
seed = 1

[preference]
kind = "{kind}"
beta = 0.5
reference = "{reference}"
""" + LOOP


def write_spec(tmp_path: Path, name: str = "run", **fields) -> Path:
    train, held = (tmp_path / "pairs_train.jsonl", tmp_path / "pairs_eval.jsonl")
    if not train.exists():
        quickstart_head("pairs_train.jsonl", 48, train)
        quickstart_head("pairs_eval.jsonl", 16, held)
    values = loop_fields(kind="dpo", reference="cached", steps=8, every=4, train=train, eval=held,
                         run_dir=tmp_path / name)
    values.update(fields)
    return write_toml(tmp_path / f"{name}.toml", SPEC, **values)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pref")
    spec = load_spec(write_spec(tmp, "ref", eval_every=4))
    assert run(spec) == 0
    return tmp


def test_metrics_eval_and_cache(uninterrupted):
    run_dir = uninterrupted / "ref"
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9))
    for r in steps:
        for key in ("loss", "reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy",
                    "logp_chosen", "logp_rejected", "pairs", "lr", "grad_norm"):
            assert key in r, key
        assert r["logp_chosen"] < 0 and 0 <= r["preference_accuracy"] <= 1
        assert r["reward_margin"] == pytest.approx(r["reward_chosen"] - r["reward_rejected"])
    # step 1: the policy is the reference (cached from other rows: equal to float rounding)
    first = steps[0]
    assert abs(first["reward_chosen"]) < 1e-4 and abs(first["reward_rejected"]) < 1e-4
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)
    evals = [r for r in records(run_dir) if "eval_preference_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert evals[0]["eval_preference_accuracy"] == pytest.approx(0.5, abs=0.05)  # ties count half
    assert evals[0]["eval_pairs"] == 16
    assert steps[-1]["reward_margin"] > 0.1 and steps[-1]["loss"] < 0.6  # the training pairs are being learnt
    tensors = cache.load(cache.cache_path(str(run_dir)), json.loads(_meta(run_dir)))
    assert tensors["train"].shape == (48, 2) and tensors["eval"].shape == (16, 2)
    assert (tensors["train"] < 0).all()
    rows = dict(write_report(str(run_dir)))
    assert "best eval_preference_accuracy" in rows
    assert (run_dir / "report" / "preference.png").exists()


def _meta(run_dir: Path) -> str:
    from safetensors import safe_open

    with safe_open(cache.cache_path(str(run_dir)), framework="pt") as f:
        return f.metadata()["fingerprint"]


def test_sigkill_then_resume_is_bit_exact_and_reuses_the_cache(uninterrupted, tmp_path, capfd):
    for name in ("pairs_train.jsonl", "pairs_eval.jsonl"):
        (tmp_path / name).write_bytes((uninterrupted / name).read_bytes())
        os.utime(tmp_path / name, ns=(os.stat(uninterrupted / name).st_mtime_ns,) * 2)
    spec = write_spec(tmp_path, "cut", eval_every=4)
    first = launch(spec, **Faults(crash_at=("step", 6)).env())
    assert first.returncode != 0 and "computed 48 + 16 pairs" in first.stderr
    capfd.readouterr()
    assert run_here(spec, "--resume", "auto") == 0  # in this process, one thread
    assert "reference log-probs: reused" in capfd.readouterr().err
    assert_same_checkpoint(uninterrupted / "ref" / "step_8", tmp_path / "cut" / "step_8")
    a = [r["loss"] for r in step_records(uninterrupted / "ref")]
    b = [r["loss"] for r in step_records(tmp_path / "cut")]
    assert a == b


def test_stale_cache_is_refused_naming_what_changed(uninterrupted, tmp_path):
    spec_path = write_spec(tmp_path, "stale", steps=1)
    assert run(load_spec(spec_path)) == 0
    path = cache.cache_path(str(tmp_path / "stale"))
    before = os.stat(path).st_mtime_ns
    with open(tmp_path / "pairs_train.jsonl", "a") as f:  # one more pair: other data
        f.write((QUICKSTART / "pairs_train.jsonl").read_text().splitlines()[100] + "\n")
    with pytest.raises(cache.StaleReference, match=r"another data than this run's"):
        run(load_spec(spec_path), resume="auto")
    assert os.stat(path).st_mtime_ns == before  # refused, not overwritten


def test_cache_miss_hit_and_fingerprint_parts(tmp_path):
    path = str(tmp_path / "reference" / cache.CACHE_FILE)
    print_ = {"model": "m", "data": "d", "template": "t", "tokenizer": "k", "max_seq_len": "192"}
    assert cache.load(path, print_) is None
    tensors = {"train": torch.randn(5, 2), "eval": torch.randn(2, 2)}
    cache.save(path, tensors, print_)
    assert os.listdir(tmp_path / "reference") == [cache.CACHE_FILE]  # no temporary left
    got = cache.load(path, print_)
    assert torch.equal(got["train"], tensors["train"]) and torch.equal(got["eval"], tensors["eval"])
    with pytest.raises(cache.StaleReference, match="another model, max_seq_len than"):
        cache.load(path, {**print_, "model": "other", "max_seq_len": "256"})


def test_live_reference_and_reference_free_kinds(uninterrupted, tmp_path):
    live = load_spec(write_spec(tmp_path, "live", reference="live", steps=2))
    assert run(live) == 0
    assert not os.path.exists(cache.cache_path(str(tmp_path / "live")))
    a = step_records(uninterrupted / "ref")[:2]
    b = step_records(tmp_path / "live")
    for x, y in zip(a, b):  # the same numbers as the cached reference, to float rounding
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-4)
        assert x["reward_margin"] == pytest.approx(y["reward_margin"], abs=1e-4)
    simpo = load_spec(write_spec(tmp_path, "simpo", kind="simpo", steps=2))
    assert run(simpo) == 0
    assert not os.path.exists(tmp_path / "simpo" / cache.CACHE_DIR)
    assert all(r["pairs"] > 0 for r in step_records(tmp_path / "simpo"))


def test_gradient_release_trains_the_same_objective(tmp_path):
    """With the chain inside backward (``memory.gradient_release``) the step agrees on the pair
    loss before backward and steps as the plain binder does (to float rounding)."""
    a, b = run_plain_and_released(tmp_path, write_spec(tmp_path, "plain", steps=3).read_text())
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["pairs"] == y["pairs"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
        assert x["reward_margin"] == pytest.approx(y["reward_margin"], abs=1e-4)


def release_spec(tmp_path: Path, name: str, memory: str, steps: int = 3) -> Path:
    """DPO with fp32 AdamW stepped inside backward (one micro-batch a step, no clip) and ``memory``
    added to its ``[memory]`` section."""
    text = write_spec(tmp_path, name, steps=steps).read_text()
    text = text.replace("grad_accum = 2", "grad_accum = 1").replace('alias = "adamw"', 'alias = "adamw"\nclip = 0.0')
    path = tmp_path / f"{name}.toml"
    path.write_text(text + "\n[memory]\ngradient_release = true\n" + memory)
    return path


def test_the_loop_defers_the_tied_head_gradient(tmp_path):
    """With gradient release and ``memory.defer_head_grad`` the forward leaves the tied head's
    gradient to the embedding's hook (``bound.before_step``), which the backward consumes: no
    parameter keeps a gradient.  ``"auto"`` defers with tied slabs (or checkpointing) only."""
    from pgs.runtime.loop.train import _forward, setup

    for name, memory, want in (("chk", "defer_head_grad = true\n", True),
                               ("auto_plain", "", False), ("auto_slabs", "tied_slabs = 16\n", True),
                               ("off", "defer_head_grad = false\ntied_slabs = 16\n", False)):
        r = setup(load_spec(release_spec(tmp_path, name, memory)))
        embed = r.model.get_input_embeddings().weight
        assert r.model.get_output_embeddings().weight is embed
        assert r.objective.defers_head_grad(r, embed) is want, name
        if name != "chk":
            r.loader.close()
            continue
        r.loader.close()  # the stream is read here directly
        loss_sum, _ = _forward(r, r.loader.stream.next_batch(r.micro_batch), False)
        assert list(r.bound._before) == [n for n, p in r.bound.params.items() if p is embed]
        (head_grad,) = r.bound._before[list(r.bound._before)[0]]
        assert not head_grad.__self__.ready  # the gates (∂L/∂logp_sum) are known in backward only
        loss_sum.backward()
        assert head_grad.__self__.done and r.bound._before == {}
        assert all(p.grad is None for p in r.model.parameters())


def test_deferred_head_grad_and_tied_slabs_train_as_autograd(tmp_path):
    """DPO stepped inside backward with the head's gradient through autograd (``defer_head_grad =
    false``, a dense V×D gradient), deferred into the embedding's hook, and deferred slab by slab
    (``tied_slabs``, no V×D gradient): the same losses and weights after 3 steps, up to
    summation order."""
    from safetensors.torch import load_file

    cases = {"autograd": "defer_head_grad = false\n", "deferred": "defer_head_grad = true\n",
             "slabs": "defer_head_grad = true\ntied_slabs = 16\n"}
    for name, memory in cases.items():
        assert run(load_spec(release_spec(tmp_path, name, memory))) == 0
    ref = load_file(tmp_path / "autograd" / "step_3" / "model.safetensors")
    losses = [r["loss"] for r in step_records(tmp_path / "autograd")]
    assert len(losses) == 3
    for name in ("deferred", "slabs"):
        got = load_file(tmp_path / name / "step_3" / "model.safetensors")
        assert sorted(got) == sorted(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"{name}: {k}")
        assert [r["loss"] for r in step_records(tmp_path / name)] == pytest.approx(losses, rel=1e-5)
    assert losses[-1] != losses[0]  # the runs trained


MEMORY_CASES = {
    # an 8-bit chain bound as usual, two micro-batches a step (block-wise state on most tensors)
    "lion8bit": ('alias = "lion8bit"\nargs = { min_8bit_size = 256 }', "grad_accum = 2", "", 1e-3),
    # an 8-bit chain stepping inside backward: gradient release takes one micro-batch and no clip
    "adamw8bit_release": ('alias = "adamw8bit"\nclip = 0.0\nargs = { min_8bit_size = 256 }', "grad_accum = 1",
                          "\n[memory]\ngradient_release = true\n", 3e-3),
}


def memory_spec(tmp_path: Path, name: str, case: str) -> Path:
    optimizer, accum, memory, peak = MEMORY_CASES[case]
    text = write_spec(tmp_path, name, steps=8, eval_every=8).read_text()
    text = text.replace('alias = "adamw"\nargs = { weight_decay = 0.0 }', optimizer)
    text = text.replace("grad_accum = 2", accum).replace("peak = 3e-3", f"peak = {peak}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text + memory)
    return path


@pytest.mark.parametrize("case", sorted(MEMORY_CASES))
def test_8bit_chains_and_gradient_release_train_and_resume_exactly(tmp_path, case, capfd):
    """DPO with an 8-bit optimizer chain (and with gradient release): the pair loss falls, the
    accuracy is logged, and a SIGKILL after step 6 + ``--resume auto`` (from step 4) ends with the
    uninterrupted run's weights, 8-bit chain state and losses bit for bit."""
    assert run_here(memory_spec(tmp_path, "whole", case)) == 0  # one thread, as the children
    steps = step_records(tmp_path / "whole")
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(0 <= r["preference_accuracy"] <= 1 and r["pairs"] > 0 for r in steps)
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert sum(r["loss"] for r in steps[-3:]) / 3 < steps[0]["loss"] - 0.02
    evals = [r for r in records(tmp_path / "whole") if "eval_preference_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 8]
    optimizer = (tmp_path / "whole" / "step_8" / "optimizer.safetensors")
    from safetensors.torch import load_file

    assert any(t.dtype in (torch.int8, torch.uint8) for t in load_file(optimizer).values())  # 8-bit state

    cut = memory_spec(tmp_path, "cut", case)
    first = launch(cut, **Faults(crash_at=("step", 6)).env())
    assert first.returncode != 0
    capfd.readouterr()
    assert run_here(cut, "--resume", "auto") == 0  # in this process, one thread
    err = capfd.readouterr().err
    assert "resumed from" in err and "reference log-probs: reused" in err
    assert_same_checkpoint(tmp_path / "whole" / "step_8", tmp_path / "cut" / "step_8")
    assert [r["loss"] for r in step_records(tmp_path / "cut")] == [r["loss"] for r in steps]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_reference_gathers_where_the_batch_lives():
    """The loader puts a batch (pair ids included) on the training device; the cached table is
    gathered there (copied once), never indexed on the host with device ids."""
    from types import SimpleNamespace

    from pgs.runtime.loop.preference import Reference

    table = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    ref = Reference("cached", train=table, eval=table[:4])
    cuda = torch.device("cuda")
    got = ref.logps(SimpleNamespace(pair_ids=torch.tensor([3, 0, 7], device=cuda)), cuda, 128)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), table[[3, 0, 7]])
    again = ref.logps(SimpleNamespace(pair_ids=torch.tensor([1], device=cuda)), cuda, 128)
    assert torch.equal(again.cpu(), table[[1]])
    assert torch.equal(ref.logps(SimpleNamespace(pair_ids=torch.tensor([2])), cuda, 128, split="eval").cpu(), table[[2]])
