"""bench/offload_bench.py's result table, without a GPU: the shared Markdown format with the
setup's error and timeout beside its name (the figures it logged stay), the bandwidth entry
as a line under the table rather than a row."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import offload_bench as ob  # noqa: E402


def test_table_rows_errors_timeouts_and_the_bandwidth_line():
    results = [{"setup": "bandwidth", "h2d_gb_s": 25.34, "d2h_gb_s": 24.06, "both_gb_s_each": 20.0},
               {"setup": "pgs_4b", "mean_tok_s": 12345.6, "max_allocated_gib": 10.004, "max_reserved_gib": 11.5,
                "host_pss_setup_gib": 20.04, "host_pss_steps_gib": 21.5, "host_pss_save_gib": 30.06,
                "host_pss_max_gib": 30.06, "median_step_s": 0.33333},
               {"setup": "pgs_4b_offload", "error": "Traceback ...\nRuntimeError: boom", "timed_out": 110.4,
                "mean_tok_s": 9000.0, "pcie_gib_per_step": 48.0, "pcie_s_per_step": 2.0}]
    lines = ob.table(results).splitlines()
    assert lines[0] == ("| setup | mean tok/s | wall tok/s | max alloc GiB | max reserved GiB | host PSS GiB: setup | "
                        "steps | save | max | host state GiB | PCIe GiB/step | PCIe s/step | step s (median) | "
                        "resume s | step k+1 diff | loss diff | run-to-run diff | same weights |")
    assert lines[1] == "|---" * 18 + "|"
    row = "| pgs_4b | 12,346 |  | 10.00 | 11.50 | 20.0 | 21.5 | 30.1 | 30.1 |  |  |  | 0.333 |  |  |  |  |  |"
    assert lines[2] == row
    assert lines[3] == ("| pgs_4b_offload (error: RuntimeError: boom) (timed out at 110 s) | 9,000 |  |  |  |  |  |  |  |  | "
                        "48.00 | 2.000 |  |  |  |  |  |  |")
    assert lines[4:] == ["", "host↔device (1 GiB, page-locked): H2D 25.3 GB/s, D2H 24.1 GB/s, both at once 20.0 GB/s each"]
    assert ob.table(results[1:2]).splitlines()[2:] == [row]


def test_a_resumed_setup_is_compared_with_the_uninterrupted_one():
    """``compare_resumes``: loss differences after the resume and before the interruption (run
    to run), and whether the final weights' digests are equal."""
    results = [{"setup": "pgs_4b", "losses": {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5}, "final_model_digest": "aa"},
               {"setup": "pgs_4b_resume", "losses": {3: 2.25, 4: 1.5}, "final_model_digest": "ab",
                "interrupted": {"losses": {1: 3.0, 2: 2.375, 3: 2.0}}},
               {"setup": "other_resume", "losses": {1: 1.0}}]
    ob.compare_resumes(results)
    r = results[1]
    assert r["loss_diff"] == 0.25 and r["run_to_run_diff"] == 0.125 and r["same_weights"] is False
    assert "loss_diff" not in results[2]  # no uninterrupted setup named "other"


def test_host_memory_by_phase_of_a_run():
    G = 2**30
    # (time, pss, rss, main rss): build to 4 GiB, steps at 6, a save at t=20-22 reaching 9, exit
    samples = [(1.0, 2 * G, 3 * G, 2 * G), (5.0, 4 * G, 5 * G, 4 * G), (11.0, 6 * G, 8 * G, 5 * G),
               (15.0, 6 * G, 8 * G, 5 * G), (21.0, 9 * G, 11 * G, 8 * G), (23.5, 5 * G, 6 * G, 4 * G)]
    records = [{"event": "start", "time": 2.0},
               {"step": 1, "loss": 1.0, "tokens": 8, "step_seconds": 2.0, "time": 10.0},
               {"step": 2, "loss": 1.0, "tokens": 8, "step_seconds": 1.0, "time": 19.0},
               {"step": 2, "event": "checkpoint", "path": "x/step_2", "checkpoint_seconds": 2.5, "time": 22.0,
                "write_seconds": 1.5, "sync_seconds": 0.75, "bytes": 3 * G},
               {"step": 2, "event": "done", "time": 23.0}]
    out = ob.host_phases(samples, records)
    assert out["host_pss_setup_gib"] == 4 and out["host_pss_steps_gib"] == 6 and out["host_pss_save_gib"] == 9
    assert out["host_pss_max_gib"] == 9 and out["host_rss_main_max_gib"] == 8 and out["checkpoint_s"] == [2.5]
    assert out["checkpoint_write_s"] == [1.5] and out["checkpoint_sync_s"] == [0.75] and out["checkpoint_gib"] == [3]
    # a background save: its span is the thread's write + sync before the event, not the snapshot
    background = records[:3] + [{"step": 2, "event": "checkpoint", "background": True, "checkpoint_seconds": 0.1,
                                 "time": 23.0, "write_seconds": 1.5, "sync_seconds": 1.0, "bytes": 3 * G}]
    assert ob.host_phases(samples, background)["host_pss_save_gib"] == 9
    assert ob.host_phases(samples, []) == {"host_pss_max_gib": 9, "host_rss_main_max_gib": 8}
    assert ob.host_phases([], records) == {}


def test_host_sample_reads_this_process_and_its_children():
    import subprocess
    # the child says when its 64 MiB are written (a fixed sleep raced a loaded machine's startup)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); "
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        alone = ob.host_sample(child.pid)
        tree = ob.host_sample(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert alone[0] > 64 << 20 and alone[2] > 64 << 20  # the child's 64 MiB are resident
    assert tree[1] >= alone[1] + tree[2]  # the tree's RSS sum includes the child
    assert 0 < tree[0] <= tree[1]  # PSS never exceeds RSS
