"""The objective of a run: what the training loop asks of SFT, of preference optimization and of
any objective that comes later.

``pgs/runtime/loop/train.py`` names no objective.  :func:`setup` calls :func:`build_objective`,
which picks the class whose spec section is present (``[preference]`` selects
one of :class:`~pgs.runtime.loop.preference.PreferenceObjective` and
:class:`~pgs.runtime.loop.kto.KTOObjective`, by ``kind``: several classes may share a section
and say which specs are theirs with a ``selects(spec)`` classmethod; none selects
:class:`~pgs.runtime.loop.sft.SFTObjective`), and from then on the loop only talks to the
:class:`Objective` protocol below.  One optimizer step, as the loop runs it::

    batches = loader.next_step()                       # objective.stream, ahead by objective.loader_ahead
    batches, extra = objective.prepare(run, batches)   # e.g. sample completions (on-policy)
    valid, n = global sums of (trained tokens, objective.count(batches))
    for batch in batches:
        loss_sum, stats = objective.forward(run, batch, poison)
        (loss_sum / n).backward()                      # or after agreeing on finiteness (gradient release)
    optimizer step; stats summed over micro-batches (and ranks)
    record = objective.step_metrics(stats, n, valid, extra) + loss, lr, tokens, memory, ...
    objective.after_step(run, record)                  # e.g. SFT's entropy-collapse warning

So the gradient of a step is that of ``Σ loss_sum / n`` over the step's micro-batches on every
rank: a token mean for SFT (``n`` = valid tokens), a pair mean for preference (``n`` = pairs).
``n`` is known before any forward (from the prepared batches), which is what lets gradient
accumulation and gradient release divide each micro-batch as it goes.

Plugging in a new objective (e.g. on-policy distillation, a ``[distill]`` section):

1. Write a class with the members of :class:`Objective` in its own module under
   ``pgs/runtime/loop/`` (the pure loss in ``pgs.func.losses``).  ``create`` builds everything
   the objective owns: its data stream (any object with ``next_batch(n)``, ``state_dict()``,
   ``load_state_dict()`` and ``stats``, whose batches carry ``input_ids``, ``position_ids``,
   ``labels``, ``cu_seqlens``, ``num_tokens`` and ``num_trained_tokens``), frozen models (a
   reference, a teacher), random generators.  It runs after the model is built with its initial
   weights and frozen parts, before ``[memory]`` (kernels, checkpointing, compile) is applied
   and before the model is sharded or the optimizer bound.
2. Set ``section`` to the spec section that selects it and add the class to
   :func:`objective_classes`.  A spec with two objective sections is refused.
3. Whatever must survive a restart goes into ``state_dict()`` (JSON, written by rank 0 into
   ``trainer.json``; ``load_state_dict(None)`` is a checkpoint written before the objective had
   state) and ``generators()`` (torch generators, saved per process beside the global RNG, so a
   sampler's draws continue exactly after ``--resume``).
4. Metrics: ``stat_keys`` names the per-micro-batch sums ``forward`` returns (summed over the
   step's micro-batches and the ranks by the loop), ``step_metrics`` turns them (and the host
   numbers ``prepare`` returned, such as generated tokens/s) into the step's record,
   ``console_keys`` are the record's keys the progress line shows, ``evaluate`` returns the
   eval record (every rank calls it with several processes: keep the collectives the same).
5. Say what the loop may do around ``forward``: ``router_tap`` (it feeds a MoE model's router
   tap, so router losses and statistics apply), ``splits_rows`` (it trains on a part of each
   row when ``[parallel] context`` splits rows over ranks; False refuses that split).
6. ``for_profile`` (a classmethod): the objective and one micro-batch of random tokens of the
   spec's shapes, built without reading or writing anything (no data, no caches), for
   ``pgs profile --measure`` (``pgs.runtime.tools.profile.measure_memory``), which then runs
   ``prepare``, ``count``, ``forward`` and the backward as the loop does, so the measured step
   is the one ``pgs run`` trains.  Frozen models the objective keeps (a live reference, a
   teacher) are built here as ``create`` builds them.
7. Document it in ``docs/`` and add a quickstart-size end-to-end test.

The loop keeps what every objective shares: the optimizer and its gradient release, the
control plane (skips, stops, halts), checkpoints and exact resume, the metrics file.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from pgs.errors import SpecError
from pgs.runtime.loop.distill import DistillObjective
from pgs.runtime.loop.kto import KTOObjective
from pgs.runtime.loop.preference import PreferenceObjective
from pgs.runtime.loop.sft import SFTObjective


@runtime_checkable
class Objective(Protocol):
    """What the training loop asks of an objective (see the module docstring)."""

    #: The objective's name (``metrics.jsonl``'s ``start`` event, messages).
    name: str
    #: The spec section whose presence selects this objective (None: the default, SFT).
    section: str | None
    #: Names of the per-micro-batch sums ``forward`` returns, in order.
    stat_keys: tuple[str, ...]
    #: Keys of the step record the progress line shows (after loss, lr and grad_norm).
    console_keys: tuple[str, ...]
    #: How many steps the data worker prepares ahead (None: the loader's default).
    loader_ahead: int | None
    #: The training data stream the loop's ``StepLoader`` reads.
    stream: Any
    #: Whether ``forward`` feeds a mixture-of-experts model's router tap (``run.moe``:
    #: ``begin_micro``/``end_micro`` around the model, router losses into the gradient), so the
    #: loop opens the tap's step and logs its ``moe/*`` values.
    router_tap: bool
    #: Whether ``forward`` trains on this rank's part of rows split over context-parallel ranks
    #: (``[parallel] context``, ``run.context``): a token loss summed over the part is a share of
    #: the row's; an objective that needs whole sequences (log-probs summed per sequence,
    #: generation from a prompt) sets False and ``setup`` refuses the split.
    splits_rows: bool
    #: With ``splits_rows`` False: why a part of a row is not enough, the rest of ``setup``'s
    #: one-line refusal (``"a pair's loss ..."``); empty otherwise.
    whole_rows_reason: str

    @classmethod
    def for_profile(cls, spec, *, model, tokenizer, device: torch.device, rows: int, seq_len: int,
                    generator: torch.Generator) -> tuple["Objective", list]:
        """``(objective, [one micro-batch])`` for ``pgs profile --measure``: ``rows`` rows of
        ``seq_len`` random tokens (``generator``) laid out as the objective's stream lays out its
        data; nothing read from the data sources, nothing written (module docstring, step 6)."""

    def steps_per_epoch(self, batch_size: int) -> int:
        """Optimizer steps in one pass over the training data (``train.epochs`` runs)."""

    def prepare(self, run, batches: list) -> tuple[list, dict]:
        """The step's micro-batches as they will be trained (an objective may replace them, e.g.
        with completions it samples) and host numbers for this step's record."""

    def count(self, batches: Sequence) -> int:
        """This process's share of the step's loss denominator (valid tokens, pairs)."""

    def forward(self, run, batch, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed loss with its graph, detached float32 sums [len(stat_keys)])`` of a
        micro-batch.  ``poison``: a test's injected fault, multiply the loss by NaN."""

    def defers_head_grad(self, run, weight) -> bool:
        """Whether ``forward`` hands the (tied) head's gradient to the optimizer itself
        (``bound.before_step``) instead of through autograd."""

    def step_metrics(self, stats: list[float], count: int, valid_tokens: int, extra: dict) -> dict:
        """The objective's numbers of a step's record from its summed stats (plain floats),
        the global denominator and valid-token count, and ``prepare``'s host numbers."""

    def after_step(self, run, record: dict) -> None:
        """Called with every logged step record (warnings, events)."""

    def evaluate(self, run) -> dict:
        """The eval record's numbers at the current step (no ``step`` key)."""

    def state_dict(self) -> dict:
        """JSON-able state a checkpoint keeps (rank 0's)."""

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint without objective state)."""

    def generators(self) -> dict[str, torch.Generator]:
        """The objective's torch generators, saved and restored with the run's RNG (per process)."""


def objective_classes() -> tuple[type, ...]:
    """Every objective, the default (section None) last."""

    return (PreferenceObjective, KTOObjective, DistillObjective, SFTObjective)


def objective_class(spec) -> type:
    """The class the spec selects: the one whose section is present, else the default."""

    classes = objective_classes()
    chosen = [c for c in classes if c.section is not None and getattr(spec, c.section, None) is not None
              and (not hasattr(c, "selects") or c.selects(spec))]
    if len(chosen) > 1:
        names = " and ".join(f"[{c.section}]" for c in chosen)
        raise SpecError(f"{names}: a run trains one objective; keep one of these sections")
    if chosen:
        return chosen[0]
    return next(c for c in classes if c.section is None)


def build_objective(spec, *, model, tokenizer, device: torch.device, ctx=None) -> Objective:
    """The run's objective, made by its class's ``create`` (see the module docstring, step 1)."""

    return objective_class(spec).create(spec, model=model, tokenizer=tokenizer, device=device, ctx=ctx)


__all__ = ["Objective", "build_objective", "objective_class", "objective_classes"]
