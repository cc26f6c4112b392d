"""``memory.seco_chunk`` / ``memory.spaco_keep`` in a spec: what ``pgs validate`` refuses, in one line."""

from __future__ import annotations

import pytest

from pgs.runtime.optim.config import MemorySpec
from tests.helpers import cli_error, tiny_spec

REFUSED = [
    (["memory.spaco_keep=0.5"], "memory.spaco_keep = 0.5: SpaCO is the sparse variant"),
    (["memory.seco_chunk=32", "memory.spaco_keep=0"], "memory.spaco_keep: 0 would run no chunk"),
    (["memory.seco_chunk=32", "memory.spaco_keep=1.5"], "memory.spaco_keep"),
    (["memory.seco_chunk=32", "memory.compile_layers=true"],
     "memory.seco_chunk: memory.compile_layers does not compose"),
    (["memory.seco_chunk=32", "memory.gradient_release=true", "train.grad_accum=1", "optimizer.clip=0",
      "memory.tied_slabs=64"], "memory.seco_chunk: memory.tied_slabs does not compose"),
    (["memory.seco_chunk=32", "loss.objective=\"cadft\""], "memory.seco_chunk: loss.objective 'cadft'"),
    (["memory.seco_chunk=32", "loss.neftune_alpha=5"], "memory.seco_chunk: embedding noise"),
    (["memory.seco_chunk=-1"], "memory.seco_chunk"),
]


@pytest.mark.parametrize("sets, line", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refused_in_one_line(tmp_path, capsys, sets, line):
    spec = tiny_spec(tmp_path)
    code, got = cli_error(["validate", str(spec), *[x for s in sets for x in ("--set", s)]], capsys)
    assert code != 0 and line in got, got


def test_accepted_and_the_head_gradient_is_not_deferred():
    mem = MemorySpec(seco_chunk=4096, spaco_keep=0.25, gradient_release=True, activation_checkpointing="full")
    assert mem.refusal() is None
    assert not mem.head_grad_deferred()  # each chunk's loss is back-propagated on its own
    assert MemorySpec(gradient_release=True, activation_checkpointing="full").head_grad_deferred()


def test_models_that_chunks_would_change_are_refused():
    from pgs.runtime.model import seco
    from tests.tiny import tiny_config

    assert seco.refusal(tiny_config("qwen3")) is None
    assert "experts" in seco.refusal(tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2))
    assert "sliding" in seco.refusal(tiny_config("qwen3", use_sliding_window=True, sliding_window=8))
