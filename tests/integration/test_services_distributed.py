"""The loop's services on several processes (FSDP2, gloo on the CPU) against one process.

- ``[averaging]``: the EMA and a SLERP merge-back on each rank's shards, the EMA in the DCP
  checkpoint, ``final-ema`` gathered; ``pgs run`` on 3 ranks gives one process's losses,
  weights, EMA and EMA evals (eval loss and accuracy by generation), and a SIGKILL +
  ``--resume auto`` on 3 ranks (checkpoints written in the background) ends bit for bit where
  the uninterrupted 3-rank run ends (weights, EMA, losses).
- ``data.msft_round``: per-source eval losses reduced over the ranks; 2 ranks exclude the same
  sources at the same steps as one process, with the same losses; a SIGKILL + ``--resume auto``
  on 2 ranks, between a round's revert and the next one, ends bit for bit where the
  uninterrupted 2-rank run ends (records, exclusions, the rounds' state, final weights).
- Eval generation: ``task_accuracy`` on 3 ranks (each its share of the batches, padded) gives
  one process's verdicts on the very same replies, and ``generate(synced=True)`` keeps ranks
  whose batches stop at different steps in step (a hang would fail the test's timeout).

Processes: one start of 3 ranks (tests/integration/runs_harness.py: torchrun's environment, each
rank running ``pgs run`` as a worker of ``pgs run --nproc 3`` does) runs the uninterrupted 3-rank
averaging run, the generation scenario and the killed run, one after the other; the resume runs
in a fresh start of 3 ranks.  The same for mSFT on 2 ranks.  The one-process references run in
the test's process.  (``pgs run --nproc N --resume auto`` after a SIGKILL, the launcher included:
tests/integration/test_fsdp_offload.py.)

Tolerances are tests/integration/test_train_distributed.py's (it explains them): one process with
``grad_accum = N`` and N ranks with ``grad_accum = 1`` train on the same micro-batches; losses to
1e-6 relative, weights to 1e-6 absolute.  The EMA and the linear merge are elementwise (exact on
shards); SLERP's norms and dot product are shard sums all-reduced (the same to rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pgs.runtime.loop.averaging import EXPORT_DIR
from pgs.runtime.loop.faults import Faults
from helpers import (QUICKSTART, assert_same_weights, end_runs, final_weights, records, run_here, run_outcome,
                     start_runs, step_records, tiny_spec)
from test_echo_msft import _msft_spec

pytestmark = pytest.mark.slow  # several launches of 2 and 3 processes

TIMEOUT_S = 300
STEPS = 6
AVERAGING = """
[averaging]
ema = 0.75
merge = "slerp"
merge_weight = 0.3
merge_period = 0.5
"""


def _averaging_spec(tmp_path: Path, name: str, *, ranks: int, background: bool = False) -> Path:
    """The tiny spec with ``[averaging]``, 6 rows a step: one process takes them as 3
    micro-batches of 2, 3 ranks 2 rows each (the tiny model's widths do not divide by 3: uneven
    FSDP2 shards, the EMA's too)."""
    evals = tmp_path / "eval.jsonl"  # 12 records with a task checker: eval loss and accuracy by generation
    evals.write_text("\n".join((QUICKSTART / "eval.jsonl").read_text().splitlines()[:12]) + "\n")
    path = tiny_spec(tmp_path, name, steps=STEPS, every=2, export="true", eval_every=STEPS)
    text = path.read_text().replace('eval = "pgs:quickstart/eval.jsonl"', f'eval = "{evals}"') + AVERAGING
    text = text.replace("batch_size = 4", "batch_size = 6").replace("grad_accum = 2", f"grad_accum = {4 - ranks}")
    if background:
        text = text.replace('best_metric = ""', 'best_metric = ""\nbackground = true')
    path.write_text(text)
    return path


def resume_on_ranks(spec: Path, out: Path, world: int) -> tuple[list[int | None], str]:
    """``pgs run SPEC --resume auto`` on ``world`` ranks of a fresh start (the processes a
    killed run left are gone): each rank's exit code and the ranks' logs."""
    ranks = end_runs(start_runs(out, [{"name": "resumed", "argv": [str(spec), "--resume", "auto"]}], world), TIMEOUT_S)
    codes, log = run_outcome(out, "resumed", world)
    return (codes if ranks == [0] * world else ranks), log


def _ema(run_dir: Path) -> dict:
    return load_file(run_dir / EXPORT_DIR / "model.safetensors")


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> tuple[Path, int, list[int]]:
    """One start of 3 ranks (tests/integration/runs_harness.py) shared by the 3-rank tests below:
    the uninterrupted averaging run (``pgs run`` on each rank, as a worker of ``pgs run --nproc 3``
    runs it), the eval generation scenario (tests/integration/generate_harness.py), and last the
    averaging run with background checkpoints SIGKILLed after step 5 (the kill ends the ranks).
    The one process meanwhile in this process.  Returns the folder, the one process's exit code
    and the ranks' exit codes."""
    folder = tmp_path_factory.mktemp("three")
    single = _averaging_spec(folder, "single", ranks=1)
    runs = [{"name": "three", "argv": [str(_averaging_spec(folder, "three", ranks=3))]},
            {"name": "generate", "call": "generate_harness:main"},
            {"name": "killed", "argv": [str(_averaging_spec(folder, "killed", ranks=3, background=True))],
             "faults": Faults(crash_at=("step", 5)).env()}]
    procs = start_runs(folder / "ranks", runs, 3)
    try:
        code = run_here(single)
    finally:
        codes = end_runs(procs, 3 * TIMEOUT_S)
    return folder, code, codes


def test_averaging_on_three_ranks_equals_one_process_and_resumes_exactly(three_ranks):
    folder, code, ranks = three_ranks
    assert code == 0
    codes, logs = run_outcome(folder / "ranks", "three", 3)
    assert codes == [0, 0, 0], logs[-4000:]
    single, three = folder / "single", folder / "three"

    one_log, three_log = step_records(single), step_records(three)
    assert [r["step"] for r in three_log] == list(range(1, STEPS + 1))
    for a, b in zip(one_log, three_log):
        assert b["valid_tokens"] == a["valid_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0)
    assert_same_weights(final_weights(single), final_weights(three), "final, 1 vs 3 ranks", atol=1e-6)
    assert_same_weights(_ema(single), _ema(three), "final-ema, 1 vs 3 ranks", atol=1e-6)
    moved = max((a - b).abs().max().item() for a, b in zip(_ema(three).values(), final_weights(three).values()))
    assert moved > 1e-4  # the EMA is not the last weights
    assert json.loads((three / EXPORT_DIR / "pgs_export.json").read_text()) == {"step": STEPS, "ema": 0.75}
    info = json.loads((three / f"step_{STEPS}" / "dcp.json").read_text())
    assert info["services"] == ["averaging"] and info["world_size"] == 3

    one_eval = [r for r in records(single) if "eval_loss" in r]
    three_eval = [r for r in records(three) if "eval_loss" in r]
    assert [r["step"] for r in three_eval] == [0, STEPS] and "ema_eval_loss" in three_eval[1]
    assert "eval_accuracy" in three_eval[0] and "ema_eval_accuracy" in three_eval[1]
    for a, b in zip(one_eval, three_eval):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(("eval_accuracy", "ema_eval_accuracy")) or key.endswith(("_correct", "_tokens")):
                assert b[key] == a[key], key  # generation on 3 ranks: the same verdicts
            elif key.endswith("eval_loss"):
                assert b[key] == pytest.approx(a[key], rel=1e-6), key

    # SIGKILL after step 5 on 3 ranks, checkpoints written in the background (the EMA staged by
    # DCP's async save with the rest), --resume auto from the newest complete one: the same bits
    killed = folder / "killed.toml"
    codes, logs = run_outcome(folder / "ranks", "killed", 3)
    assert 0 not in codes and -9 in ranks, (codes, ranks, logs[-4000:])  # killed during the run
    assert not (folder / "killed" / f"step_{STEPS}").exists()
    resumed, log = resume_on_ranks(killed, folder / "resume", 3)
    assert resumed == [0, 0, 0], log[-4000:]
    # step 4's save may still have been on its thread when the kill came: then step 2's is the newest
    assert any(f"resumed from {folder / 'killed' / f'step_{s}'}" in log for s in (2, 4)), log[-2000:]
    again = folder / "killed"
    assert_same_weights(final_weights(three), final_weights(again), "final, resumed vs uninterrupted")
    assert_same_weights(_ema(three), _ema(again), "final-ema, resumed vs uninterrupted")
    assert [r["loss"] for r in step_records(again)] == [r["loss"] for r in three_log]


def _msft_ranks_spec(folder: Path, ranks: int) -> Path:
    """test_echo_msft's mSFT spec (rounds of 4 steps, an eval every 2) in ``folder``, 8 rows a
    step: one process as 2 micro-batches of 4, 2 ranks 4 rows each.  A checkpoint every 2 steps,
    and a learning rate high enough that both rounds revert: round 1 at step 4 to step 0's
    snapshot, round 2 at step 8 to step 6's."""
    folder.mkdir(exist_ok=True)
    spec = _msft_spec(folder)
    text = spec.read_text().replace("batch_size = 4", f"batch_size = 4\ngrad_accum = {3 - ranks}")
    spec.write_text(text.replace("peak = 3e-3", "peak = 0.2").replace("every = 4", "every = 2"))
    return spec


@pytest.fixture(scope="module")
def msft_two_ranks(tmp_path_factory) -> Path:
    """The run folder of one uninterrupted 2-rank mSFT run (shared by the tests below); the same
    start of the 2 ranks (tests/integration/runs_harness.py) then runs, in ``../killed``, the same
    spec SIGKILLed after step 7 (the kill ends the ranks)."""
    folder = tmp_path_factory.mktemp("msft")
    uninterrupted, killed = _msft_ranks_spec(folder / "ranks2", 2), _msft_ranks_spec(folder / "killed", 2)
    runs = [{"name": "ranks2", "argv": [str(uninterrupted)]},
            {"name": "killed", "argv": [str(killed)], "faults": Faults(crash_at=("step", 7)).env()}]
    end_runs(start_runs(folder / "ranks", runs, 2), 2 * TIMEOUT_S)
    codes, logs = run_outcome(folder / "ranks", "ranks2", 2)
    assert codes == [0, 0], logs[-4000:]
    return uninterrupted.parent / "run"


def _exclusions(run_dir: Path) -> list[dict]:
    """The run's ``msft_exclude`` records, without their wall-clock time."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records(run_dir) if r.get("event") == "msft_exclude"]


def test_msft_on_two_ranks_excludes_what_one_process_excludes(tmp_path, msft_two_ranks):
    assert run_here(_msft_ranks_spec(tmp_path / "ranks1", 1)) == 0
    runs = {1: records(tmp_path / "ranks1" / "run"), 2: records(msft_two_ranks)}
    events = {n: [r for r in log if r.get("event") == "msft_exclude"] for n, log in runs.items()}
    assert len(events[1]) == 2
    assert [(e["step"], e["source"], e["best_step"], e["active"]) for e in events[2]] == \
        [(e["step"], e["source"], e["best_step"], e["active"]) for e in events[1]]
    for a, b in zip(events[1], events[2]):
        assert b["best_loss"] == pytest.approx(a["best_loss"], rel=1e-5)
    evals = {n: [r for r in log if "eval_loss_add" in r] for n, log in runs.items()}
    assert [r["step"] for r in evals[2]] == [r["step"] for r in evals[1]]
    for a, b in zip(evals[1], evals[2]):
        for key in ("eval_loss_add", "eval_loss_weather"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    steps = {n: [r for r in log if "loss" in r and "event" not in r] for n, log in runs.items()}
    assert [r["step"] for r in steps[2]] == [r["step"] for r in steps[1]]
    for a, b in zip(steps[1], steps[2]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]


def test_msft_on_two_ranks_killed_and_resumed_ends_as_uninterrupted(msft_two_ranks):
    """SIGKILL on 2 ranks after step 7: the newest checkpoint (step 6) holds the rounds after the
    first exclusion (step 4, reverted to step 0) and round 2's best so far (step 6, its snapshot on
    disk); --resume auto must restore the active set, the round and its bests, and revert at step 8
    to that snapshot: the same records, state and final weights, bit for bit."""
    events = _exclusions(msft_two_ranks)
    assert [(e["step"], e["best_step"]) for e in events] == [(4, 0), (8, 6)]  # both rounds revert
    folder = msft_two_ranks.parent.parent
    spec, killed = folder / "killed" / "spec.toml", folder / "killed" / "run"
    codes, logs = run_outcome(folder / "ranks", "killed", 2)  # killed during the run (the fixture's start)
    assert 0 not in codes and not (killed / "step_8").exists(), (codes, logs[-4000:])
    assert _exclusions(killed) == events[:1]  # the first decision was made before the kill
    at_kill = json.loads((killed / "step_6" / "trainer.json").read_text())["msft"]
    assert at_kill["excluded"] == [{k: events[0][k] for k in ("step", "source", "best_step", "best_loss")}]
    assert [v[0] for v in at_kill["best"].values()] == [6] and (killed / "msft" / "step_6").is_dir()
    resumed, log = resume_on_ranks(spec, folder / "resume", 2)
    assert resumed == [0, 0], log[-4000:]
    assert f"resumed from {killed / 'step_6'}" in log, log[-2000:]

    assert _exclusions(killed) == events  # steps, sources, best steps and losses, active sets
    assert [r["loss"] for r in step_records(killed)] == [r["loss"] for r in step_records(msft_two_ranks)]
    evals = [{k: v for k, v in r.items() if k.startswith("eval_loss")} for r in records(killed) if "eval_loss_add" in r]
    assert evals == [{k: v for k, v in r.items() if k.startswith("eval_loss")}
                     for r in records(msft_two_ranks) if "eval_loss_add" in r]
    state = [json.loads((run / "step_8" / "trainer.json").read_text())["msft"] for run in (msft_two_ranks, killed)]
    assert state[0] == state[1] and state[0]["finished"] and not state[0]["active"]
    assert_same_weights(final_weights(msft_two_ranks), final_weights(killed), "final, resumed vs uninterrupted")


def test_eval_generation_on_three_ranks_equals_one_process(three_ranks):
    folder, _, _ = three_ranks
    world, out = 3, folder / "ranks"
    codes, logs = run_outcome(out, "generate", world)
    assert codes == [0] * world, logs[-6000:]
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(world)]
    reference = results[0]["reference"]
    assert reference["eval_correct"] not in (0, 10)  # the verdicts depend on the replies
    for r in results:
        assert r["accuracy"] == reference  # every rank returns one process's record
        assert r["synced"] == r["synced_reference"]  # each rank's own prompts, as on one process
    seen = sorted(tuple(x) for r in results for x in r["seen"])
    assert seen == sorted(tuple(x) for x in results[0]["seen_reference"])  # the same replies, each once
    assert {x[1] for x in seen} == {0, 1}  # second turns (the weather task) were generated too
    lengths = [n for r in results for n in r["stop_lengths"]]
    assert min(lengths) < max(lengths)  # the ranks' rows stopped at different steps
