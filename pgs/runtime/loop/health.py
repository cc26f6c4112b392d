"""The run's health monitor (a tiered ``HealthMonitor``, docs/techniques/health.md): what a long run needs to
be read at a glance, and the one tripwire that stops it.

Two tiers, so that the steady step gains no host read:

- **every step**, from the step's record once the loop has read it (numbers already on the
  host, a step late, ``train.StepRecord``): loss, ‖g‖ and entropy feed running statistics
  (an exponential moving mean and variance, β = ``BETA``, updated with non-spike values only)
  and a spike is a value ``SPIKE_Z`` standard deviations above the running mean, after
  ``WARMUP`` values (the z-score rule of pgs's spike detectors; ZClip, arXiv
  2504.02507, uses the same statistics to clip).  A spike is an ``event`` line.
- **every ``train.health_every`` steps** (0: ``train.log_every``) and at the last step: the
  interval's summary joins that step's line of ``metrics.jsonl`` (keys in ``docs/runtime.md``):
  ‖g‖ mean / max / std and spikes, loss spikes, the entropy's mean and least-squares slope
  per step (the trend that precedes a collapse, arXiv 2606.18487), and the update-to-weight norm
  ratio ‖Δw‖/‖w‖ of that step per parameter group (``GROUPS``).  The ratio needs the weights
  before the step: on those steps only, a fixed strided sample of each trainable weight's
  elements (``UpdateRatio``: up to ``RATIO_SAMPLE`` per parameter, a few MiB on the device, no
  copy of the whole model) is kept before the step and compared after it, and the ratios are
  copied back to the host without waiting, read when the step's line is written.

The tripwire ``train.entropy_halt`` (0: off): when the interval's mean next-token entropy is
below it, the run halts with exit 80 and ``HALT.json`` (``control.halt``; the entropy of a
step is summed over the ranks before it is logged, so every rank reaches the same verdict).
``train.entropy_warn`` keeps warning without stopping (``train.watch_entropy``).

The monitor's running statistics are part of a checkpoint's counters (``state_dict``), so a
resumed run flags the same spikes and reaches the same verdicts as an uninterrupted one.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from pgs.runtime.process import all_reduce_sum

#: Running statistics' decay, the z-score of a spike, and values seen before spikes are flagged.
BETA = 0.95
SPIKE_Z = 5.0
WARMUP = 10
#: Parameter groups of the update ratio: the first pattern that matches a parameter's name.
GROUPS = (
    ("embed", re.compile(r"embed|wte|wpe")),
    ("head", re.compile(r"lm_head|output")),
    ("norm", re.compile(r"norm|ln_")),
    ("attn", re.compile(r"attn|attention")),
    ("mlp", re.compile(r"mlp|ffn|experts|feed_forward")),
)
OTHER = "other"
#: What the interval summary watches for spikes (a step record's keys).
WATCHED = ("loss", "grad_norm")


def group_of(name: str) -> str:
    """The update-ratio group of a parameter name (``GROUPS``, else ``"other"``)."""
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return OTHER


class RunningStat:
    """Exponential moving mean and variance (bias-corrected), fed non-spike values only."""

    def __init__(self, beta: float = BETA):
        self.beta = beta
        self.count = 0
        self.mean = 0.0
        self.var = 0.0

    def zscore(self, x: float) -> float:
        if self.count < WARMUP:
            return 0.0
        return (x - self.mean) / math.sqrt(max(self.var, 1e-12 * max(1.0, self.mean * self.mean)))

    def update(self, x: float) -> None:
        self.count += 1
        if self.count == 1:
            self.mean, self.var = x, 0.0
            return
        delta = x - self.mean
        self.mean += (1 - self.beta) * delta
        self.var = self.beta * (self.var + (1 - self.beta) * delta * delta)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = int(state["count"]), float(state["mean"]), float(state["var"])


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own values: the local shard of an FSDP2 (DTensor) parameter."""
    return p.to_local() if hasattr(p, "to_local") else p


#: Elements of each parameter the update ratio watches (all of a smaller parameter).
RATIO_SAMPLE = 8192


class UpdateRatio:
    """‖w_after − w_before‖ / ‖w_after‖ per group for one step, over a fixed strided sample of
    each parameter's elements: ``before`` copies the sampled elements (on the device), ``after``
    queues the norms and their copy to the host, ``read`` returns them.

    Why a sample: the exact ratio needs the whole model's weights from before the step, a
    second copy of every weight (7.5 GiB at Qwen3-4B: no room on the device under the memory
    recipes, and a host round trip of that size costs a tenth of a step each way).  Up to
    ``RATIO_SAMPLE`` elements per parameter, evenly strided over its flattened values (every
    element of a smaller parameter: exact there), held on the device between the two calls
    (≈ 6 MiB at 4B); the sums of squares over the same elements estimate the group's ratio (for
    sign-based updates such as Lion's, whose elements all move by about the learning rate, the
    estimate is close to exact)."""

    def __init__(self, model, sample: int = RATIO_SAMPLE):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = [group_of(n) for n, _ in named]
        self.names = sorted(set(groups))
        self.index = [self.names.index(g) for g in groups]
        self.sample = int(sample)
        self._snapshot: list[torch.Tensor] | None = None
        # step -> (sums, copy event): with a summary every step, step N's ratio is queued before
        # step N-1's record is read, so more than one can wait
        self._pending: dict[int, tuple[torch.Tensor, Any]] = {}

    def _sampled(self, p: torch.Tensor) -> torch.Tensor:
        flat = _local(p).detach().reshape(-1)
        stride = max(1, -(-flat.numel() // self.sample))
        return flat[::stride]

    @torch.no_grad()
    def before(self) -> None:
        # the copy in fp32 at once: ``after`` then subtracts it as it is
        self._snapshot = [self._sampled(p).to(torch.float32, copy=True) for p in self.params]

    @torch.no_grad()
    def after(self, step: int) -> None:
        if not self.params or self._snapshot is None:
            return
        now = [self._sampled(p).float() for p in self.params]
        device = now[0].device
        # the differences and squares as multi-tensor ops (one launch each on a GPU, not one per
        # parameter); only the sums run per parameter
        delta = torch._foreach_sub(now, self._snapshot)
        diff = torch.stack([d.sum() for d in torch._foreach_mul(delta, delta)])
        size = torch.stack([w.sum() for w in torch._foreach_mul(now, now)])
        self._snapshot = None
        if not isinstance(self.index, torch.Tensor) or self.index.device != device:  # once: no copy per step
            self.index = torch.as_tensor(self.index, device=device)
        index = self.index
        sums = torch.zeros(2, len(self.names), device=device).index_add_(1, index, torch.stack([diff, size]))
        sums = torch.cat([sums, sums.sum(1, keepdim=True)], 1).double()  # the last column: all parameters
        sums = all_reduce_sum(sums)  # FSDP2: the shards' sums
        event = None
        if sums.device.type == "cuda":
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            sums = host
        self._pending[step] = (sums, event)

    def read(self, step: int) -> dict:
        """``health/update_ratio/<group>`` and ``health/update_ratio`` of ``step`` (if measured)."""
        for old in [s for s in self._pending if s < step]:  # a record that was never read
            del self._pending[old]
        if step not in self._pending:
            return {}
        sums, event = self._pending.pop(step)
        if event is not None:
            event.synchronize()
        diff, size = sums.tolist()
        out = {f"health/update_ratio/{g}": math.sqrt(d) / math.sqrt(s) if s > 0 else 0.0
               for g, d, s in zip(self.names, diff, size)}
        out["health/update_ratio"] = math.sqrt(diff[-1]) / math.sqrt(size[-1]) if size[-1] > 0 else 0.0
        return out


class HealthMonitor:
    """See the module docstring.  ``every``: steps between summaries; ``total``: the last step
    (always summarised); ``entropy_halt``: the tripwire's threshold (0: off)."""

    def __init__(self, model, *, every: int, total: int, entropy_halt: float = 0.0):
        self.every = max(1, int(every))
        self.total = total
        self.entropy_halt = float(entropy_halt)
        self.stats = {key: RunningStat() for key in WATCHED}
        self.ratio = UpdateRatio(model)
        self.verdict: str | None = None
        self._reset()

    @classmethod
    def from_spec(cls, spec, model, total: int) -> "HealthMonitor":
        t = spec.train
        return cls(model, every=t.health_every or t.log_every, total=total, entropy_halt=t.entropy_halt)

    def _reset(self) -> None:
        self._window: dict[str, list[float]] = {"grad_norm": [], "entropy": [], "entropy_step": []}
        self._spikes = {key: 0 for key in WATCHED}

    def summarises(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    # -- around the step (the loop calls these with the step's number) --------------------
    def before_step(self, step: int) -> None:
        """Before step ``step`` runs: copy the weights if its update ratio is measured."""
        if self.summarises(step):
            self.ratio.before()

    def after_step(self, step: int) -> None:
        if self.summarises(step):
            self.ratio.after(step)

    # -- the step's record --------------------------------------------------------------
    def observe(self, record: dict) -> list[dict]:
        """Feed a read step record; adds the interval's summary to it on a summary step and
        returns the event lines to log (spikes).  Sets ``verdict`` when the tripwire fires."""
        step = int(record["step"])
        events = []
        if not record.get("skipped"):
            for key in WATCHED:
                value = record.get(key)
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    continue
                z = self.stats[key].zscore(value)
                if z > SPIKE_Z:
                    self._spikes[key] += 1
                    events.append({"step": step, "event": "spike", "what": key, "value": value, "z": z,
                                   "mean": self.stats[key].mean})
                else:
                    self.stats[key].update(value)
            if isinstance(record.get("grad_norm"), (int, float)):
                self._window["grad_norm"].append(float(record["grad_norm"]))
            if isinstance(record.get("entropy"), (int, float)):
                self._window["entropy"].append(float(record["entropy"]))
                self._window["entropy_step"].append(float(step))
        if self.summarises(step):
            seen = len(self._window["entropy"])
            record.update(self._summary())
            record.update(self.ratio.read(step))
            mean = record.get("health/entropy_mean")
            if self.entropy_halt > 0 and mean is not None and mean < self.entropy_halt:
                self.verdict = (f"mean next-token entropy {mean:.4f} over the last {seen} steps fell under "
                                f"train.entropy_halt = {self.entropy_halt:g} (collapse)")
            self._reset()
        return events

    def _summary(self) -> dict:
        out: dict[str, float] = {f"health/{key}_spikes": self._spikes[key] for key in WATCHED}
        g = self._window["grad_norm"]
        if g:
            mean = sum(g) / len(g)
            out.update({"health/grad_norm_mean": mean, "health/grad_norm_max": max(g),
                        "health/grad_norm_std": math.sqrt(sum((x - mean) ** 2 for x in g) / len(g))})
        e, s = self._window["entropy"], self._window["entropy_step"]
        if e:
            out["health/entropy_mean"] = sum(e) / len(e)
            out["health/entropy_slope"] = _slope(s, e)
        return out

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain numbers (a checkpoint's counters): running statistics and the open interval."""
        return {"stats": {key: stat.state_dict() for key, stat in self.stats.items()},
                "window": {k: list(v) for k, v in self._window.items()}, "spikes": dict(self._spikes)}

    def load_state_dict(self, state: dict) -> None:
        for key, stat in self.stats.items():
            stat.load_state_dict(state["stats"][key])
        self._window = {k: [float(x) for x in v] for k, v in state["window"].items()}
        self._spikes = {k: int(v) for k, v in state["spikes"].items()}


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
