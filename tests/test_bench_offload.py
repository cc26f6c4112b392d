"""bench/offload_bench.py's result table, without a GPU: the shared Markdown format with the
setup's error and timeout beside its name (the figures it logged stay), the bandwidth entry
as a line under the table rather than a row."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import offload_bench as ob  # noqa: E402


def test_table_rows_errors_timeouts_and_the_bandwidth_line():
    results = [{"setup": "bandwidth", "h2d_gb_s": 25.34, "d2h_gb_s": 24.06, "both_gb_s_each": 20.0},
               {"setup": "pgs_4b", "mean_tok_s": 12345.6, "max_allocated_gib": 10.004, "max_reserved_gib": 11.5,
                "host_rss_max_gib": 30.06, "median_step_s": 0.33333},
               {"setup": "pgs_4b_offload", "error": "Traceback ...\nRuntimeError: boom", "timed_out": 110.4,
                "mean_tok_s": 9000.0, "pcie_gib_per_step": 48.0, "pcie_s_per_step": 2.0}]
    lines = ob.table(results).splitlines()
    assert lines[0] == ("| setup | mean tok/s | max alloc GiB | max reserved GiB | host RSS GiB | host state GiB | "
                        "PCIe GiB/step | PCIe s/step | step s (median) |")
    assert lines[1] == "|---|---|---|---|---|---|---|---|---|"
    assert lines[2] == "| pgs_4b | 12,346 | 10.00 | 11.50 | 30.1 |  |  |  | 0.333 |"
    assert lines[3] == ("| pgs_4b_offload (error: RuntimeError: boom) (timed out at 110 s) | 9,000 |  |  |  |  | "
                        "48.00 | 2.000 |  |")
    assert lines[4:] == ["", "host↔device (1 GiB, page-locked): H2D 25.3 GB/s, D2H 24.1 GB/s, both at once 20.0 GB/s each"]
    assert ob.table(results[1:2]).splitlines()[2:] == ["| pgs_4b | 12,346 | 10.00 | 11.50 | 30.1 |  |  |  | 0.333 |"]
