"""A ``kind = "kto"`` run under torchrun: FSDP2 on the CPU with 2 gloo ranks against one process.

tests/integration/test_kto_run.py's tiny KTO spec, ``batch_size = 4``.  One process with
``grad_accum = 2`` and two ranks with ``grad_accum = 1`` train on the same micro-batches (rank r
takes the r-th pair of rows of each global batch), each micro-batch with its own reference point
z_ref (the paper's per-micro-batch estimate, on the rank that holds it), each divided by the same
global record count, against the reference log-probs rank 0 computed and wrote into the run
folder.  The per-step losses, z_ref means and rewards agree to the tolerance of FSDP's reduction
(tests/integration/test_train_distributed.py), the held-out numbers too, and the cache rank 0
wrote is the one-process run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pgs.runtime.store import reference as cache
from helpers import records, run_here, step_records, torchrun
from test_kto_run import HELD, TRAIN, write_spec

pytestmark = pytest.mark.slow  # two launches, ~1 minute on two busy CPU cores

STEPS = 4


def spec_for(tmp_path: Path, name: str, *, ranks: int) -> Path:
    path = write_spec(tmp_path, name, steps=STEPS, eval_every=STEPS)
    if ranks > 1:
        path.write_text(path.read_text().replace("grad_accum = 2", "grad_accum = 1"))
    return path


def test_two_ranks_train_the_records_one_process_trains(tmp_path):
    assert run_here(spec_for(tmp_path, "single", ranks=1)) == 0
    done = torchrun(spec_for(tmp_path, "two", ranks=2))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stderr.count(f"reference log-probs: computed {TRAIN} + {HELD} pairs") == 1  # rank 0 only

    one_log, two_log = step_records(tmp_path / "single"), step_records(tmp_path / "two")
    assert [r["step"] for r in two_log] == list(range(1, STEPS + 1))
    for a, b in zip(one_log, two_log):
        assert (b["records"], b["desirable"], b["valid_tokens"]) == (a["records"], a["desirable"], a["valid_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        for key in ("kl", "reward_desirable", "reward_undesirable"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key
        assert b["preference_accuracy"] == a["preference_accuracy"]

    one_eval = [r for r in records(tmp_path / "single") if "eval_reward_margin" in r]
    two_eval = [r for r in records(tmp_path / "two") if "eval_reward_margin" in r]
    assert [r["step"] for r in two_eval] == [0, STEPS]
    for a, b in zip(one_eval, two_eval):
        assert b["eval_records"] == a["eval_records"] == HELD
        assert b["eval_preference_loss"] == pytest.approx(a["eval_preference_loss"], rel=1e-5)
        assert b["eval_reward_margin"] == pytest.approx(a["eval_reward_margin"], rel=1e-4, abs=1e-5)

    from safetensors.torch import load_file

    a = load_file(cache.cache_path(str(tmp_path / "single")))
    b = load_file(cache.cache_path(str(tmp_path / "two")))
    assert torch.equal(a["train"], b["train"]) and torch.equal(a["eval"], b["eval"])
