"""Context parallelism on the CPU (pgs.runtime.dist.context, docs/distributed.md): ring attention
over 2 gloo ranks equals the whole rows on one process, for the attention alone (both layouts,
grouped-query heads, packed documents) and for a tiny Qwen3 (fp64) and Qwen3-MoE (fp32) whose
sequence is split over the ranks: the summed shard losses and the summed gradients equal the
single-process loss and gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pgs.runtime.dist.context import SequenceShard, pad_width, ring_attention, shard_rows, unshard_rows
from pgs.runtime.documents import document_ids
from helpers import free_port

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "context_parallel_harness.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
        procs.append(subprocess.Popen([sys.executable, str(HARNESS), str(out)], env=env, cwd=str(HERE.parents[1]),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_equals_one_process(two_ranks, layout):
    for result in two_ranks:
        diffs = result[f"attention_{layout}"]
        assert max(diffs.values()) < 1e-12, diffs


@pytest.mark.slow
def test_model_with_split_sequence_equals_one_process(two_ranks):
    for result in two_ranks:
        dense, moe = result["qwen3_fp64"], result["qwen3_moe_fp32"]
        assert dense["loss"] < 1e-12 and dense["grad"] < 1e-12 * max(1.0, dense["grad_scale"]), dense
        assert moe["loss"] < 1e-5 and moe["grad"] < 1e-5 * max(1.0, moe["grad_scale"]), moe


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shards_cover_each_token_once(layout):
    for world in (1, 2, 3, 4):
        shards = [SequenceShard(r, world, layout) for r in range(world)]
        width = pad_width(29, shards[0])
        assert width >= 29 and width % shards[0].multiple == 0 and width - 29 < shards[0].multiple
        idx = torch.cat([s.indices(width) for s in shards])
        assert sorted(idx.tolist()) == list(range(width))
        x = torch.arange(2 * width).reshape(2, width)
        assert torch.equal(unshard_rows([shard_rows(x, s) for s in shards], shards[0]), x)


def test_zigzag_balances_causal_work():
    """Each rank's queries meet the same number of causal (query, key) pairs with zigzag."""
    world, width = 4, 64
    work = []
    for r in range(world):
        idx = SequenceShard(r, world).indices(width)
        work.append(int((idx + 1).sum()))
    assert len(set(work)) == 1


def test_one_rank_is_packed_attention():
    """With a ring of one the function is the ordinary packed causal attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])
    doc = document_ids(pos)
    i = torch.arange(10)
    mask = (doc[:, :, None] == doc[:, None, :]) & (i <= i[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    torch.testing.assert_close(ring_attention(q, k, v, doc, SequenceShard(0, 1, "contiguous")), ref)
    with pytest.raises(ValueError, match="does not split"):
        SequenceShard(0, 2).indices(6)


@pytest.mark.slow
def test_pgs_run_with_context_parallel_equals_one_process(tmp_path):
    """``pgs run --nproc 2`` with ``[parallel] context = 2`` (each row split over both ranks,
    FSDP2 over the same ranks, full activation checkpointing so that the ring also runs in the
    recompute of backward) against one process: the same rows, the same losses and eval losses
    to fp32 rounding, the same weights after 4 AdamW steps to 1e-5."""
    from helpers import assert_same_weights, final_weights, launch, records, step_records, tiny_spec

    single = tiny_spec(tmp_path, "single", steps=4, every=0, export="true", eval_every=4)
    split = tiny_spec(tmp_path, "split", steps=4, every=0, export="true", eval_every=4)
    split.write_text(split.read_text() + '\n[memory]\nactivation_checkpointing = "full"\n\n[parallel]\ncontext = 2\n')
    for spec, extra in ((single, []), (split, ["--nproc", "2"])):
        done = launch(spec, timeout=300, args=extra, PGS_PG_TIMEOUT_S=60)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    one, two = step_records(tmp_path / "single"), step_records(tmp_path / "split")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert (a["valid_tokens"], a["tokens"]) == (b["valid_tokens"], b["tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    evals = [[r["eval_loss"] for r in records(tmp_path / d) if "eval_loss" in r] for d in ("single", "split")]
    assert evals[1] == pytest.approx(evals[0], rel=1e-6) and len(evals[0]) == 2
    assert_same_weights(final_weights(tmp_path / "single"), final_weights(tmp_path / "split"), "1 vs context 2",
                        atol=1e-5)


def test_context_must_divide_the_processes_and_the_rows_split_over_data_ranks(tmp_path, monkeypatch):
    from pgs.errors import SpecError
    from pgs.runtime.spec.load import check_world_size, load_spec
    from helpers import tiny_spec

    spec = load_spec(tiny_spec(tmp_path, "cp"), ["parallel.context=2"])
    assert (spec.parallel.context, spec.parallel.layout) == (2, "zigzag")
    check_world_size(spec.train, 4, 2)  # 2 data ranks x grad_accum 2 = 4 rows
    check_world_size(spec.train, 2, 2)
    with pytest.raises(SpecError, match="parallel.context: 3 ranks per sequence do not divide 4 processes"):
        check_world_size(spec.train, 4, 3)
    with pytest.raises(SpecError, match="train.batch_size"):
        check_world_size(spec.train, 8, 2)  # 4 data ranks x 2 micro-batches > 4 rows
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SpecError, match="do not divide 4 processes"):
        load_spec(tiny_spec(tmp_path, "cp3"), ["parallel.context=3"])
    with pytest.raises(SpecError, match="parallel.layout"):
        load_spec(tiny_spec(tmp_path, "bad"), ['parallel.layout="ring"'])


def test_context_on_one_process_is_refused(tmp_path, capsys):
    from helpers import run_here, tiny_spec

    spec = tiny_spec(tmp_path, "one")
    spec.write_text(spec.read_text() + "\n[parallel]\ncontext = 2\n")
    capsys.readouterr()
    assert run_here(spec) == 2
    assert "parallel.context: 2 ranks per sequence need pgs run --nproc N" in capsys.readouterr().err


@pytest.mark.parametrize("section", ["preference", "distill", "neftune", "cadft"])
def test_context_refused_for_an_objective_that_needs_whole_sequences(tmp_path, section):
    """``splits_rows``: a [preference] run (log-probs summed over whole arms) and a [distill] run
    (sampling from whole prompts) refuse rows split over context ranks in one line naming the
    section and why, as embedding noise and a token objective over whole samples (CADFT's
    per-sample compatibility) do, before anything is built and before the process count is
    looked at."""
    from pgs.errors import SpecError
    from pgs.runtime.loop.train import setup
    from pgs.runtime.spec.load import load_spec
    from helpers import tiny_spec

    path = tiny_spec(tmp_path, section)
    text = path.read_text()
    if section == "preference":
        text = text.replace('sources = [{ path = "pgs:quickstart/train.jsonl" }]',
                            'sources = [{ path = "pgs:quickstart/pairs_train.jsonl" }]')
        text = text.replace('eval = "pgs:quickstart/eval.jsonl"', 'eval = "pgs:quickstart/pairs_eval.jsonl"')
        text += '\n[preference]\nkind = "dpo"\n'
        want = r"parallel.context: a \[preference\] run needs whole sequences on each rank: a pair's loss is a "
    elif section == "distill":
        from helpers import inline_table
        from tiny import tiny_table

        text += f"\n[distill]\nteacher_config = {inline_table(tiny_table())}\n"
        want = (r"parallel.context: a \[distill\] run needs whole sequences on each rank: the student samples its "
                r"completions from whole prompts through a KV cache")
    elif section == "cadft":
        want = "parallel.context: loss.objective 'cadft' reads statistics over the whole row or sample"
    else:
        want = "parallel.context: not with embedding noise"
    path.write_text(text + "\n[parallel]\ncontext = 2\n")
    sets = {"neftune": ["loss.neftune_alpha=5.0"], "cadft": ['loss.objective="cadft"']}.get(section, [])
    with pytest.raises(SpecError, match=want):
        setup(load_spec(str(path), sets))
