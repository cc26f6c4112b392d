"""bench/product.py: the summary of a ``pgs run``'s step records, the figures of runs on several
processes, and a smoke run of ``--nproc`` on 2 gloo ranks."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.product import summarize  # noqa: E402


def _records():
    out = [{"event": "start"}]
    for step in range(1, 7):
        rec = {"step": step, "loss": 1.0, "tokens": 4096, "time": 10.0 + step, "step_seconds": 0.5 if step > 2 else 9.0,
               "mem_gib": 8.0 + step / 100, "reserved_gib": 9.0}
        if step > 1:
            rec.update({"release/host_ms": float(step), "offload/host_ms": 2.0, "offload/unannounced": 0})
        out.append(rec)
    return out


def test_summary_skips_warm_up_and_averages_the_host_times_over_the_timed_steps():
    out = summarize(_records(), skip=2)
    assert out["steps"] == 6
    assert out["mean_tok_s"] == pytest.approx(4096 / 0.5)
    assert out["median_step_s"] == 0.5 and out["max_over_median"] == 1.0
    assert out["mean release/host_ms"] == pytest.approx((3 + 4 + 5 + 6) / 4)  # steps 3-6, not 2
    assert out["mean offload/host_ms"] == 2.0 and out["mean offload/unannounced"] == 0
    assert "mean offload/fetches" not in out  # only what the run logged
    assert out["max_allocated_gib"] == pytest.approx(8.06) and out["max_reserved_gib"] == 9.0


def test_summary_of_too_few_steps_is_an_error_row():
    assert "error" in summarize(_records()[:3], skip=2)


def test_per_world_figures_are_global_and_per_gpu_and_read_every_ranks_peaks():
    from bench.product import per_world

    records = _records() + [{"step": 6, "event": "done", "mem_gib": 8.1, "reserved_gib": 9.0,
                             "mem_gib_per_rank": [8.1, 8.3], "reserved_gib_per_rank": [9.0, 9.5]}]
    summary = summarize(records, skip=2)
    out = per_world(summary, records, 2)
    # the loop's step record sums the tokens over the ranks: the summary's tok/s is global
    assert out["global_tok_s"] == summary["mean_tok_s"] and out["per_gpu_tok_s"] == summary["mean_tok_s"] / 2
    assert out["max_allocated_gib_per_rank"] == [8.1, 8.3] and out["max_reserved_gib_per_rank"] == [9.0, 9.5]
    one = per_world(summary, records[:-1] + [{"step": 6, "event": "done", "mem_gib": 8.1, "reserved_gib": 9.0}], 1)
    assert one["per_gpu_tok_s"] == one["global_tok_s"] and one["max_allocated_gib_per_rank"] == [8.1]


def test_scaling_is_each_setups_per_gpu_rate_against_its_own_one_process_row():
    from bench.ranks import add_scaling

    rows = [{"world_size": 1, "per_gpu_tok_s": 100.0}, {"world_size": 2, "per_gpu_tok_s": 90.0},
            {"world_size": 4, "error": "exit 1"}]
    add_scaling(rows, "per_gpu_tok_s")
    assert [r.get("scaling_efficiency") for r in rows] == [1.0, 0.9, None]


def test_world_sets_scale_the_global_batch_and_drop_the_one_gpu_options_for_several_processes():
    import argparse

    from bench.product import MULTI_PROCESS, SMALL, world_sets

    args = argparse.Namespace(small=True, set=["memory.device_limit_gib=0"])
    spec = os.path.join(os.path.dirname(__file__), "..", "..", "specs", "qwen3_4b_12gib.toml")
    assert world_sets(spec, args, 1) == ["checkpoint.every=0", "memory.device_limit_gib=0", "train.batch_size=1"]
    assert world_sets(spec, args, 2) == (["checkpoint.every=0"] + MULTI_PROCESS
                                         + ["memory.device_limit_gib=0", "train.batch_size=2"])
    assert "memory.tied_slabs=0" in MULTI_PROCESS and "memory.tied_slabs=0" in SMALL


@pytest.mark.slow
def test_nproc_runs_pgs_and_the_titan_peer_on_two_gloo_ranks(tmp_path, monkeypatch, capsys):
    """``python -m bench product --small --nproc 2 --peer titan_fsdp`` on the CPU (gloo): a row per
    setup, tok/s from the runs, every rank its own micro-batch.  (The one-process row is the plain
    ``pgs run`` the other product tests run, and the scaling arithmetic has its own test above:
    two torchrun launches here keep this under a minute and a half.)  ``python -m bench``'s
    command line for the suite is checked, and the script's ``main`` runs in this process (the
    launches are its children, with the environment the test's children get)."""
    import json

    from bench import suites
    from bench.product import main, spec_batch

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    out = tmp_path / "product.json"
    monkeypatch.delenv("PGS_FAULTS", raising=False)
    for key, value in dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                           PGS_PG_TIMEOUT_S="60", PYTHONPATH=root).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(root)
    args = ["--spec", "specs/qwen3_4b_12gib.toml", "--small", "--nproc", "2", "--peer", "titan_fsdp", "--steps", "4",
            "--skip", "1", "--timeout", "150", "--workdir", str(tmp_path / "runs"), "--out", str(out)]
    cmd, written = suites.command("product", args)
    assert cmd == [sys.executable, suites.SUITES["product"].path, *args] and written == str(out)
    code = main(cmd[2:])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["nproc"] == [2]
    rows = {r["setup"]: r for r in result["results"]}
    assert set(rows) == {"pgs run --nproc 2", "titan_fsdp --nproc 2"}
    for row in rows.values():
        assert not row.get("error") and row["world_size"] == 2
        assert row["global_tok_s"] > 0 and row["per_gpu_tok_s"] == pytest.approx(row["global_tok_s"] / 2)
        assert "scaling_efficiency" not in row  # no one-process row in this call
    pgs = rows["pgs run --nproc 2"]
    # weak scaling: the global batch is twice the spec's, so each rank trains the micro-batch one process would
    batch, _ = spec_batch("specs/qwen3_4b_12gib.toml", argparse.Namespace(small=True, set=[]))
    assert f"train.batch_size={2 * batch}" in pgs["command"]
    assert pgs["vs_titan"] == pytest.approx(pgs["per_gpu_tok_s"] / rows["titan_fsdp --nproc 2"]["per_gpu_tok_s"])
    assert "| pgs run --nproc 2 | 2 |" in stdout
