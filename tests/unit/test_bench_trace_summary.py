"""bench/trace_summary.py: the per-step summary of a ``torch.profiler`` trace (``python -m bench
sft-step --profile N``) on a hand-made trace: two kernels, one gap, one sync, nested annotations."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from trace_summary import NODE_PREFIX, summarize_trace  # noqa: E402


def test_busy_idle_classes_and_attribution_of_a_hand_made_trace():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "probe.step", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "probe.bwd", "ts": 50, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "probe.release_group", "ts": 60, "dur": 10, "tid": 2},
        {"ph": "X", "cat": "user_annotation", "name": "probe.sync", "ts": 100, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": NODE_PREFIX + "CompiledFunctionBackward", "ts": 55, "dur": 10, "tid": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 1, "tid": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 62, "dur": 1, "tid": 2,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 64, "dur": 3, "tid": 2,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 20, "dur": 80, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "lion8bit_kernel", "ts": 150, "dur": 30, "args": {"correlation": 2}},
    ]
    s = summarize_trace(ev, 1)
    us = lambda ms: round(ms * 1e3, 1)  # noqa: E731
    assert us(s["wall_ms_per_step"]) == 200, s
    assert us(s["cuda_busy_ms_per_step"]) == 110, s
    assert us(s["cuda_idle_ms_per_step"]) == 90, s  # 0-20, 100-150, 180-200
    assert s["gpu_ms_by_class"] == {"matmul": 0.08, "optimizer (8-bit kernels)": 0.03}, s
    assert s["idle_ms_by_annotation"] == {"probe.release_group": 0.05, "probe.step": 0.02,
                                          "(after the last kernel)": 0.02}, s
    assert s["idle_ms_by_autograd_node"] == {"CompiledFunctionBackward": 0.05, "(no autograd node)": 0.02}, s
    assert s["syncs_by_annotation_per_step"] == {"probe.release_group": 1.0}, s
    assert s["release_group_cpu_ms_per_step"] == 0.01, s
