"""A mixture-of-experts model under ``pgs run`` with FSDP2 on 2 gloo CPU ranks (docs/moe.md).

Qwen3-MoE (4 experts, top-2) with both router losses on.  One process with ``grad_accum = 1``
(micro-batch of 4 rows) against two ranks with 2 rows each (rank r takes the r-th pair of
rows): the load ``f`` of the load-balancing loss is the global batch's in both, so the losses
and the telemetry agree to rounding (the single process sums 4 rows' token losses in one
reduction, the ranks 2 + 2), and so do the weights after 4 AdamW steps.  The stacked expert
tensors ``[E, 2I, D]`` are FSDP2 shards along the expert axis: the DCP checkpoint holds each
as 2 chunks that split dimension 0.
"""

from __future__ import annotations

import pytest
import torch

from pgs.runtime.model.moe import METRIC_KEYS
from helpers import assert_same_weights, final_weights, step_records, torchrun
from test_moe import moe_spec, run_spec

TIMEOUT_S = 300
STEPS = 4


def _spec(tmp_path, name):
    return moe_spec(tmp_path, name, steps=STEPS, grad_accum=1, load_balance=0.05, z_loss=0.01, export="true",
                    every=STEPS)


@pytest.mark.slow
def test_moe_two_ranks_equal_one_process_and_experts_are_sharded(tmp_path):
    single = run_spec(_spec(tmp_path, "single"))  # in this process, one thread
    two = _spec(tmp_path, "two")
    done = torchrun(two, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = step_records(tmp_path / "two")
    assert [r["step"] for r in ranks] == list(range(1, STEPS + 1))
    for a, b in zip(single, ranks):
        assert b["valid_tokens"] == a["valid_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        for key in METRIC_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key
    assert_same_weights(final_weights(tmp_path / "single"), final_weights(tmp_path / "two"), "1 vs 2 ranks",
                        atol=1e-5)

    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "two" / f"step_{STEPS}"
    candidates = [p.parent for p in folder.rglob(".metadata")]
    assert candidates, f"no DCP metadata under {folder}"
    meta = FileSystemReader(str(candidates[0])).read_metadata().state_dict_metadata
    experts = [k for k in meta if k.endswith("experts.gate_up_proj") and "model" in k]
    assert experts, sorted(meta)[:20]
    for key in experts:
        chunks = meta[key].chunks
        assert len(chunks) == 2 and sorted(c.offsets[0] for c in chunks) == [0, 2], (key, chunks)
        assert all(tuple(c.sizes)[1:] == tuple(meta[key].size)[1:] for c in chunks)
