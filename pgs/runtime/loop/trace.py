"""``pgs run --profile A:B``: a torch profiler trace of training steps A to B of the real run.

The trace covers what the product runs (data loader, forward, the control plane's read,
backward with the release steps inside, the metrics' copies), not a hand-wired harness.  It
writes, in ``<run dir>/profile/``:

* ``trace.json``: a Chrome/Perfetto trace (open it at https://ui.perfetto.dev) of CPU and CUDA
  activity with the steps marked (``pgs.step.N``);
* ``ops.txt``: the operators sorted by device time, then by host time (``key_averages``).

Only the main process profiles; the steps outside ``A..B`` run untouched.
"""

from __future__ import annotations

import os

import torch

from pgs.errors import SpecError


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (1-based, inclusive) -> ``(A, B)``; one clear line when it is malformed."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecError(f"--profile: {text!r} is not A:B (the first and last step to trace, e.g. 10:14)") from None
    if not 1 <= a <= b:
        raise SpecError(f"--profile: {text!r} needs 1 <= A <= B")
    return a, b


class Profiler:
    """Traces steps ``first..last`` (see the module docstring)."""

    def __init__(self, run_dir: str, steps: tuple[int, int], device: torch.device):
        self.first, self.last = steps
        self.folder = os.path.join(run_dir, "profile")
        self.cuda = device.type == "cuda"
        self._prof = None
        self._mark = None

    def before(self, step: int) -> None:
        """Called before step ``step`` (1-based) runs."""
        if step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
        if self._prof is not None:
            self._mark = torch.profiler.record_function(f"pgs.step.{step}")
            self._mark.__enter__()

    def after(self, step: int) -> None:
        """Called after step ``step`` returned."""
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (idempotent; also when the run ends early)."""
        if self._prof is None:
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self.cuda:
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(self.folder, "trace.json"))
        averages = prof.key_averages()
        with open(os.path.join(self.folder, "ops.txt"), "w", encoding="utf-8") as handle:
            if self.cuda:
                handle.write(averages.table(sort_by="self_cuda_time_total", row_limit=60) + "\n\n")
            handle.write(averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n")
