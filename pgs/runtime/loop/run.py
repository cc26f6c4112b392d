"""The state of a run between steps (``Run``): what the loop, the objectives and
``pgs profile --measure`` hand each other.  A record only: it imports the types it names for
annotations, so a module below the loop driver (``pgs.runtime.tools.profile``) can build one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from pgs.runtime.loop.faults import NO_FAULTS, Faults

if TYPE_CHECKING:
    from pgs.runtime.loop import control
    from pgs.runtime.loop.averaging import WeightAverager
    from pgs.runtime.loop.health import HealthMonitor
    from pgs.runtime.loop.metrics import MetricsLog
    from pgs.runtime.loop.msft import Msft
    from pgs.runtime.loop.objective import Objective
    from pgs.runtime.optim import Optimizer
    from pgs.runtime.store import background


@attrs.define
class Run:
    """Everything a run holds between steps; the counters are what a checkpoint records."""

    spec: Any
    run_dir: str
    device: torch.device
    model: Any
    tokenizer: Any
    bound: Optimizer  # pgs.runtime.optim: the binder make_optimizer chose
    objective: Objective  # pgs.runtime.loop.objective: what the run trains (SFT, preference, ...)
    total_steps: int
    micro_batch: int
    skips: control.SkipCounter
    chain_has_norm: bool = False
    schedule: Any = None  # the learning rate, built once from [schedule]: the chain's, and the resume check's
    ctx: Any = None  # distributed.DistContext when several processes train together
    step: int = 0
    trained_tokens: int = 0
    best: float | None = None
    best_step: int | None = None
    log: MetricsLog | None = None
    loader: Any = None  # data.StepLoader: the steps' batches, prepared ahead by a worker (its position is the run's)
    step_clock: float | None = None  # perf_counter at the end of the last step (None: restart the clock)
    faults: Faults = NO_FAULTS  # what a test injects (faults.py)
    health: HealthMonitor | None = None  # spikes, update ratios, the entropy tripwire (health.py)
    averaging: WeightAverager | None = None  # [averaging]: weight EMA on the CPU, merge-back (averaging.py)
    moe: Any = None  # model.moe.RouterTap of a mixture-of-experts model: router telemetry and losses
    context: Any = None  # dist.context.SequenceShard: this rank's part of each row ([parallel] context > 1)
    msft: Msft | None = None  # mSFT rounds (data.msft_round), else None
    samples: Any = None  # samples.EvalSamples: replies to held-out prompts at every eval ([eval] samples)
    saver: background.BackgroundSaver | None = None  # [checkpoint] background: the save written on a thread
    services: list = attrs.field(factory=list)  # loop.services: the step-time services (their state is checkpointed)

    def counters(self) -> dict:
        return {
            "trained_tokens": self.trained_tokens,
            "best": self.best,
            "best_step": self.best_step,
            "skips": self.skips.state_dict(),
            "data": self.loader.state_dict(),
            "objective": self.objective.state_dict(),
            "health": self.health.state_dict() if self.health is not None else None,
            **({"msft": self.msft.state_dict()} if self.msft is not None else {}),
        }
