"""A ``[distill]`` run on several processes (FSDP2, gloo on the CPU) against one process.

tests/integration/test_distill_run.py's spec (a tiny Qwen3 student, a random-init teacher, λ = 0.5,
6 new tokens a sample) with ``batch_size = 6`` and one row per micro-batch: one process with
``grad_accum = 6``, ``pgs run --nproc 2`` with 3 and ``--nproc 3`` with 2, so every rank
trains on micro-batches one process trains on (rank r's m-th micro-batch is row ``m·N + r`` of
the global batch).  With ``train.seed = 7`` the coins are off, on, off, off, on, on.

What "the same result" means here (the module docstring of ``pgs/runtime/loop/distill.py``):
the same coins, the same samples (the generated-token counts and the trained completion
tokens are equal, and the on-policy steps' losses agree as closely as the off-policy ones,
which a single different sample would break), the per-step losses to 1e-5 relative and the
final weights to 1e-5.  Measured: losses to 2.3e-7 relative and max |Δw| = 6.3e-7 with 2 ranks,
2.5e-7 and 2.1e-7 with 3 (the one-process run here is in the test's process, whose kernels may
use several threads; tests/integration/test_train_distributed.py explains the drift and holds
1e-6 with bit-equal losses, comparing child processes of one thread each; the 3-rank
reduce-scatter sums in another order).  Resume at the same world size is bit for bit; the control plane's stop and
halt are decided on agreed flags, so every rank stops or halts at the same step.

Processes: the 3-rank run through ``pgs run --nproc 3``; the 2-rank runs in starts of 2 ranks
shared by several runs (tests/integration/runs_harness.py, each rank running ``pgs run`` as a
worker of ``pgs run --nproc 2`` does): the NaN run, the uninterrupted run and the stopped one in
one start, each resume in a fresh one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pgs.runtime.loop.faults import Faults
from pgs.runtime.loop.train import run
from pgs.runtime.spec.load import load_spec
from helpers import (assert_same_weights, end_runs, final_weights, launch, records, run_outcome, start_runs,
                     step_records, stopped_checkpoint, sigterm_rank_one_at_the_gate)
from test_distill_run import write_spec

pytestmark = pytest.mark.slow  # several launches of 2 and 3 ranks

STEPS = 6
TIMEOUT_S = 300


def spec_for(tmp_path: Path, name: str, *, ranks: int, **fields) -> Path:
    """The distillation spec with 6 rows a step, one row per micro-batch on every rank."""
    fields = {"steps": STEPS, "eval_every": STEPS, "every": 2, "export": "true", **fields}
    path = write_spec(tmp_path, name, **fields)
    text = path.read_text().replace("batch_size = 4", "batch_size = 6")
    path.write_text(text.replace("grad_accum = 2", f"grad_accum = {6 // ranks}"))
    return path


def on_ranks(spec: Path, ranks: int, resume: str | None = None, **env):
    """``pgs run SPEC --nproc ranks`` (the launcher's exit code is the run's)."""
    return launch(spec, resume, timeout=TIMEOUT_S, args=("--nproc", str(ranks)), PGS_PG_TIMEOUT_S=60, **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One process (in this process) and, in one folder, one start of 2 ranks
    (tests/integration/runs_harness.py: each rank runs ``pgs run`` as a worker of ``pgs run
    --nproc 2`` does) running one after the other: NaN losses on rank 1 (``nan``), the
    uninterrupted run (``two``), and last the run that holds after step 2 until SIGTERM, sent to
    rank 1 only, has reached it (``cut``).  Outcomes: ``helpers.run_outcome(FOLDER / "ranks", ...)``."""
    tmp = tmp_path_factory.mktemp("distill_ranks")
    nan = spec_for(tmp, "nan", ranks=2, every=0, eval_every=0)
    nan.write_text(nan.read_text().replace("seed = 7\n", "seed = 7\nmax_consecutive_skips = 1\n"))
    gate = tmp / "gate"
    gate.mkdir()
    plan = [{"name": "nan", "argv": [str(nan)], "faults": Faults(nan_steps={2, 3}, nan_rank=1).env()},
            {"name": "two", "argv": [str(spec_for(tmp, "two", ranks=2))]},
            {"name": "cut", "argv": [str(spec_for(tmp, "cut", ranks=2))],
             "faults": Faults(pause_at=(2, str(gate))).env()}]
    one = spec_for(tmp, "one", ranks=1)
    procs = start_runs(tmp / "ranks", plan, 2)
    try:
        code = run(load_spec(one))
        sigterm_rank_one_at_the_gate(procs, gate, TIMEOUT_S)
    finally:
        ranks = end_runs(procs, 3 * TIMEOUT_S)
    assert code == 0
    codes, logs = run_outcome(tmp / "ranks", "two", 2)
    assert codes == [0, 0] and ranks == [0, 0], logs[-4000:]
    return tmp


def assert_like_one_process(one: Path, many: Path) -> None:
    a, b = step_records(one), step_records(many)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))  # rank 0 logs each step once
    assert [r["on_policy"] for r in a] == [r["on_policy"] for r in b] == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    for x, y in zip(a, b):
        assert y["generated_tokens"] == x["generated_tokens"] and y["valid_tokens"] == x["valid_tokens"], y["step"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=0), y["step"]
    evals = [[r for r in records(d) if "eval_distill_kl" in r] for d in (one, many)]
    assert [r["step"] for r in evals[1]] == [0, STEPS]
    for x, y in zip(*evals):
        assert y["eval_tokens"] == x["eval_tokens"] and y["eval_distill_tokens"] == x["eval_distill_tokens"]
        for key in ("eval_loss", "eval_distill_kl", "eval_distill_loss"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), key
        assert y["on_policy_share"] == x["on_policy_share"]
    assert_same_weights(final_weights(one), final_weights(many), f"1 process vs {many.name}", atol=1e-5)


def test_two_ranks_sample_and_train_what_one_process_does(runs):
    assert_like_one_process(runs / "one", runs / "two")
    assert json.loads((runs / "two" / f"step_{STEPS}" / "dcp.json").read_text())["world_size"] == 2


def test_three_ranks_sample_and_train_what_one_process_does(runs):
    temp = runs / "temp"  # the launcher's and the workers' temp folder
    temp.mkdir()
    done = on_ranks(spec_for(runs, "three", ranks=3), 3, TMPDIR=str(temp))
    assert done.returncode == 0, done.stderr[-4000:]
    assert_like_one_process(runs / "one", runs / "three")
    # nothing left behind in it: torchrun's log folder (torchelastic_*), the launcher's exit-code
    # folder (pgs-exit-*) and each worker's multiprocessing folder (pymp-*: its data worker's
    # fork-server socket) are removed; compiler caches (torchinductor_*) may stay
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], left


def test_stop_then_sigkill_then_resume_on_two_ranks_is_bit_exact(runs, tmp_path):
    """SIGTERM to rank 1 only: both ranks stop at one step with one checkpoint (exit 143).  Resumed,
    both are SIGKILLed after step 5 (a periodic checkpoint at step 4); ``--resume auto`` then
    ends on the uninterrupted 2-rank run's weights bit for bit, its on-policy steps 5 and 6
    sampled from the restored generators."""
    spec = runs / "cut.toml"
    run_dir = runs / "cut"
    codes, logs = run_outcome(runs / "ranks", "cut", 2)  # the fixture's start of the ranks
    assert codes == [143, 143], logs[-4000:]
    stopped = stopped_checkpoint(run_dir, 2, 4, world_size=2)

    # resumed in a fresh start of the 2 ranks, SIGKILLed after step 5 (the kill ends them)
    crash = {"name": "killed", "argv": [str(spec), "--resume", "auto"], "faults": Faults(crash_at=("step", 5)).env()}
    ranks = end_runs(start_runs(tmp_path / "killed", [crash], 2), TIMEOUT_S)
    codes, log = run_outcome(tmp_path / "killed", "killed", 2)
    assert 0 not in codes and -9 in ranks and f"resumed from {stopped}" in log, (codes, ranks, log[-3000:])
    assert (run_dir / "step_4" / "COMPLETE").exists() and not (run_dir / "step_6").exists()

    # and again in a fresh start, to the end
    done = {"name": "resumed", "argv": [str(spec), "--resume", "auto"]}
    ranks = end_runs(start_runs(tmp_path / "resumed", [done], 2), TIMEOUT_S)
    codes, log = run_outcome(tmp_path / "resumed", "resumed", 2)
    assert codes == [0, 0] and ranks == [0, 0], log[-4000:]
    assert f"resumed from {run_dir / 'step_4'}" in log
    assert_same_weights(final_weights(runs / "two"), final_weights(run_dir), "resumed vs uninterrupted")
    key = lambda r: (r["step"], r["loss"], r["on_policy"], r["generated_tokens"], r["valid_tokens"])  # noqa: E731
    assert [key(r) for r in step_records(run_dir)][-2:] == [key(r) for r in step_records(runs / "two")][-2:]


def test_a_nan_on_one_rank_halts_both(runs):
    """NaN losses on rank 1 only at steps 2 and 3: both ranks skip them (agreed flags), reach the
    skip cap at step 3 and exit 81 with one ``HALT.json``."""
    tmp_path = runs
    codes, logs = run_outcome(runs / "ranks", "nan", 2)  # the fixture's start of the ranks
    assert codes == [81, 81], logs[-4000:]
    marker = json.loads((tmp_path / "nan" / "HALT.json").read_text())
    assert marker["exit_code"] == 81 and marker["step"] == 3
    logged = step_records(tmp_path / "nan")
    assert [r["skipped"] for r in logged] == [0, 1, 1]  # rank 0's own losses were finite
    assert logged[1]["on_policy"] == 1.0  # a skipped on-policy step: both ranks sampled, then dropped it
