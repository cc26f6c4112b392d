"""bench/moe.py (``python -m bench moe``) without a GPU: its overrides, its ratios, and the smoke
run of the whole call at a tiny MoE shape (``--small``): ``pgs run`` per expert implementation
and HF's own step with the same implementations, each built with the implementation asked
for, the same step-1 loss under every implementation on each side."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import moe  # noqa: E402


def test_registered_and_default_impls():
    from bench.suites import SUITES

    assert SUITES["moe"].script == "moe.py" and os.path.exists(SUITES["moe"].path)
    assert moe.available_impls() == ["eager", "grouped_mm"]  # what transformers 5.x offers, batched_mm left out


def test_pgs_overrides_set_the_implementation_and_no_checkpoint_inside_the_run(tmp_path):
    class Args:
        spec, steps, small, set = moe.SPEC, 3, True, ["train.seed=5"]

    sets = moe.pgs_overrides("grouped_mm", Args, str(tmp_path))
    assert sets[0] == "model.experts_implementation=grouped_mm"
    assert {"train.steps=3", "checkpoint.every=0", "schedule.warmup=2", f"checkpoint.dir={tmp_path}"} <= set(sets)
    assert set(moe.SMALL) <= set(sets) and sets[-1] == "train.seed=5"  # the caller's overrides last: they win
    # a record every step, the health summary (the update ratio's weight samples) at the spec's
    # own interval (its log_every, 10), not every step
    assert "train.log_every=1" in sets and "train.health_every=10" in sets
    Args.set = ["train.log_every=4"]
    assert "train.health_every=4" in moe.pgs_overrides("eager", Args, str(tmp_path))


def test_profile_steps_refused_past_the_run(capsys):
    for bad, why in (("5:9", "past --steps 6"), ("3", "is not A:B")):
        with pytest.raises(SystemExit) as exit_:
            moe.main(["--profile", bad, "--steps", "6", "--impls", "eager"])
        assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_ratios_against_eager_and_hf():
    rows = [{"side": "pgs", "experts_implementation": "eager", "mean_tok_s": 100.0},
            {"side": "pgs", "experts_implementation": "grouped_mm", "mean_tok_s": 300.0},
            {"side": "hf", "experts_implementation": "eager", "mean_tok_s": 50.0},
            {"side": "hf", "experts_implementation": "grouped_mm", "error": "OutOfMemoryError: ..."}]
    moe.compare(rows)
    assert rows[1]["vs_eager"] == 3.0 and rows[0]["vs_eager"] == 1.0
    assert rows[0]["vs_hf"] == 2.0 and "vs_hf" not in rows[1]  # its HF row failed
    assert "vs_hf" not in rows[2] and "vs_eager" not in rows[3]
    table = moe.product.markdown_table([{"setup": "x", **r} for r in rows], moe.COLUMNS)
    assert "error: OutOfMemoryError" in table and "| 3.00 |" in table


@pytest.mark.slow
def test_small_run_of_the_whole_call(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "bench", "moe", "--small", "--steps", "2", "--skip", "0",
                           "--profile", "2:2", "--workdir", str(tmp_path), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["side"], r["experts_implementation"]) for r in results] == [
        ("pgs", "eager"), ("pgs", "grouped_mm"), ("hf", "eager"), ("hf", "grouped_mm")]
    for r in results:
        assert not r.get("error") and r["mean_tok_s"] > 0 and r["median_step_s"] > 0
    for side in ("pgs", "hf"):
        eager, grouped = [r for r in results if r["side"] == side]
        assert grouped["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
        assert grouped["vs_eager"] == pytest.approx(grouped["mean_tok_s"] / eager["mean_tok_s"])
    # the same batches on both sides: both inits seed the CPU generator with 0 (the spec's
    # init_seed, sft_step.build's seed), so step 1 sees the same weights and the same tokens
    # (pgs's chunked loss and HF's differ in summation order only)
    assert results[2]["first_loss"] == pytest.approx(results[0]["first_loss"], rel=1e-4)
    assert results[0]["vs_hf"] == pytest.approx(results[0]["mean_tok_s"] / results[2]["mean_tok_s"])
    for r in results[:2]:
        assert r["status"] == "ok" and len(r["step_s"]) == 2 and 0 < r["moe/utilization"] <= 1
        assert "model.experts_implementation=" + r["experts_implementation"] in r["command"]
        assert (tmp_path / f"metrics_{r['experts_implementation']}.jsonl").exists()
        assert not (tmp_path / f"run_{r['experts_implementation']}").exists()  # its checkpoint removed
        # --profile: pgs run --profile 2:2, its operator table kept beside the JSON (streams.txt: CUDA only)
        assert "--profile 2:2" in r["command"]
        ops = tmp_path / f"moe-{r['experts_implementation']}-ops.txt"
        assert r["profile"] == [str(ops)] and "aten::" in ops.read_text()
    assert json.loads(out.read_text())["profile"] == "2:2" and "profile" not in results[2]
    assert done.stdout.count("| pgs run ") == 2 and done.stdout.count("| HF ") == 2
