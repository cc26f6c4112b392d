"""The step-time services' protocol: what the loop (``pgs.runtime.loop.train``) calls around
every step, every step record, every evaluation and the run's end.

A service is an object with the hooks below (:class:`Service` gives each a no-op default, so
a service writes only those it needs).  The loop holds a list of them, built once per run by
:func:`build_services`; ``before_*`` hooks run in the list's order and ``after_*`` hooks in the
reverse order, as nested context managers would (the first service in the list opens a step
first and closes it last).

==================================  ======================================================
hook                                when
==================================  ======================================================
``before_step(run, step)``          before step ``step`` (1-based) runs
``after_step(run, step)``           after it returned (``run.step == step``)
``observe(run, record) -> events``  a step's record was read, before it is logged: keys
                                    may be added; the returned event lines follow it
``after_record(run, record)``       after the record and its events were logged (a halt
                                    is raised here)
``eval_record(run, result)``        an evaluation's record, before it is logged
``after_eval(run, result)``         after it was logged
``finish(run)``                     the last step is done (before the ``done`` event)
``close(run)``                      the run ends, however it ends
``memory_estimate(spec, plan)``     the bytes the service holds beside what the model,
                                    binder, activations and loss hold (``pgs profile``'s
                                    and the preflight's figure, :func:`service_memory`):
                                    ``{"device": .., "host": ..}``
``state_dict(run)``                 its checkpoint state, when ``state_name`` is set (below)
``load_state_dict(run, t, folder)`` restore it (``t`` None: the checkpoint has none)
==================================  ======================================================

**State, shards and numbers on several processes.**  A service whose state must survive a
resume sets ``state_name`` and returns its tensors from ``state_dict(run)``; the checkpointer
writes them with every checkpoint and ``restore`` hands them back, before the first step,
through ``load_state_dict``.  On one process they are the step folder's file
``<state_name>.safetensors`` (``averaging.safetensors``); with several processes (``run.ctx``)
they are the DCP entry ``<state_name>`` of the sharded checkpoint, and the service declares
how its state is sharded by what it returns: a tensor that mirrors a parameter is a DTensor
of that parameter's mesh and placements over this rank's local shard (DCP writes each rank's
part and reshards it by global shape on another world size), any other tensor is the same on
every rank (replicated: written once).  Numbers a service decides on come reduced: the
evaluation's record (``eval_record``, ``after_eval``) and the step records are the same on
every rank (sums all-reduced, generated replies gathered), and every hook is called on every
rank at the same point, so a hook may run collectives (a gathered export, an eval forward of
a sharded model) and every rank takes the same decision.  JSON counters (health, mSFT) go
through ``Run.counters`` instead.

Checkpointing (``pgs.runtime.loop.checkpointer``) and evaluation
(``pgs.runtime.loop.evaluator``) decide *whether* the step ends with a save or an eval and
are asked by name (``checkpointer.should_save``, ``evaluator.should_evaluate``); the
services here only react.  A new service joins by implementing the hooks it needs and
adding one line to :func:`build_services` (and its class to :data:`SERVICES`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pgs.errors import EXIT_TRIPWIRE
from pgs.runtime.loop import control
from pgs.runtime.loop.averaging import CHECKPOINT_NAME, EXPORT_DIR
from pgs.runtime.loop.checkpointer import export
from pgs.runtime.loop.evaluator import evaluate


class Service:
    """A runtime service the loop iterates; every hook is a no-op until a service overrides it."""

    #: the name of the state it keeps in checkpoints (None: none; module docstring)
    state_name: str | None = None

    def state_dict(self, run) -> dict:
        return {}

    def load_state_dict(self, run, tensors: dict | None, folder: str) -> None:
        pass

    def before_step(self, run, step: int) -> None:
        pass

    def after_step(self, run, step: int) -> None:
        pass

    def observe(self, run, record: dict) -> list[dict]:
        return []

    def after_record(self, run, record: dict) -> None:
        pass

    def eval_record(self, run, result: dict) -> None:
        pass

    def after_eval(self, run, result: dict) -> None:
        pass

    def finish(self, run) -> None:
        pass

    def close(self, run) -> None:
        pass

    @staticmethod
    def memory_estimate(spec, plan: dict) -> dict[str, int]:
        return {}


class FaultService(Service):
    """What a test injects (``pgs.runtime.loop.faults``): a SIGKILL after a step, slow steps
    (the pause falls between one step's end and the next one's start)."""

    def __init__(self, faults):
        self.faults = faults
        self._stepped = False

    def before_step(self, run, step: int) -> None:
        if self._stepped and self.faults.slow_step_s:
            time.sleep(self.faults.slow_step_s)
        self._stepped = True

    def after_step(self, run, step: int) -> None:
        self.faults.crash("step", step)


class ProfilerService(Service):
    """``pgs run --profile A:B``: the trace of steps A..B (``pgs.runtime.loop.trace.Profiler``)."""

    def __init__(self, profiler):
        self.profiler = profiler

    def before_step(self, run, step: int) -> None:
        self.profiler.before(step)

    def after_step(self, run, step: int) -> None:
        self.profiler.after(step)

    def close(self, run) -> None:
        self.profiler.close()


class AveragingService(Service):
    """``[averaging]`` (``pgs.runtime.loop.averaging.WeightAverager``): the EMA's update and the
    merge-back after each step, the EMA's own eval keys, its export at the end."""

    def __init__(self, averager):
        self.averager = averager
        # the EMA is state (the base of a merge is not: the model is rebuilt as it was at step 0)
        self.state_name = CHECKPOINT_NAME if averager.has_ema else None

    def state_dict(self, run) -> dict:
        return self.averager.state_dict()

    def load_state_dict(self, run, tensors: dict | None, folder: str) -> None:
        self.averager.load_state_dict(tensors, folder)

    def after_step(self, run, step: int) -> None:
        self.averager.after_step(step)

    def eval_record(self, run, result: dict) -> None:
        if self.averager.ready:  # the EMA weights, evaluated the same way
            with self.averager.ema_weights(run.model):
                result.update({f"ema_{k}": v for k, v in evaluate(run).items() if k != "step"})

    def finish(self, run) -> None:
        if run.spec.checkpoint.export and self.averager.has_ema:
            with self.averager.ema_weights(run.model):
                export(run, os.path.join(run.run_dir, EXPORT_DIR), {"step": run.step, "ema": self.averager.decay})


class HealthService(Service):
    """Spikes, update ratios and the entropy tripwire (``pgs.runtime.loop.health.HealthMonitor``)."""

    def __init__(self, monitor):
        self.monitor = monitor

    def before_step(self, run, step: int) -> None:
        self.monitor.before_step(step)

    def after_step(self, run, step: int) -> None:
        self.monitor.after_step(step)

    def observe(self, run, record: dict) -> list[dict]:
        return self.monitor.observe(record)  # the interval's health keys join the record

    def after_record(self, run, record: dict) -> None:
        if self.monitor.verdict is not None:
            raise control.halt(run.run_dir, self.monitor.verdict, step=record["step"], exit_code=EXIT_TRIPWIRE,
                               details={"tripwire": "train.entropy_halt"})


class MsftService(Service):
    """mSFT rounds (``data.msft_round``, ``pgs.runtime.loop.msft.Msft``): after each evaluation,
    a source that overfit first is excluded and the weights revert to its best step."""

    def __init__(self, msft):
        self.msft = msft

    def after_eval(self, run, result: dict) -> None:
        event = self.msft.after_eval(run, result)
        if event is not None:
            run.log.write(event)
            run.log.say(f"mSFT: {event['source']} overfit first (best at step {event['best_step']}); "
                        f"excluded, weights reverted to that step; active: {', '.join(event['active']) or 'none'}")


class SamplesService(Service):
    """``[eval] samples`` (``pgs.runtime.loop.samples.EvalSamples``): greedy replies to held-out
    prompts at every evaluation, written to ``<run dir>/samples/step_<N>.jsonl``."""

    def __init__(self, samples):
        self.samples = samples

    def eval_record(self, run, result: dict) -> None:
        self.samples.sample(run, result)


def build_services(run, profiler=None, extra: tuple[Service, ...] = ()) -> list[Service]:
    """The run's step-time services, in the order their ``before_*`` hooks run."""
    services: list[Any] = [FaultService(run.faults), *extra]
    if profiler is not None:
        services.append(ProfilerService(profiler))
    if run.averaging is not None:
        services.append(AveragingService(run.averaging))
    if run.health is not None:
        services.append(HealthService(run.health))
    if run.msft is not None:
        services.append(MsftService(run.msft))
    if run.samples is not None:
        services.append(SamplesService(run.samples))
    return services


#: The service classes :func:`build_services` may build: the memory estimate asks each of them.
SERVICES: tuple[type[Service], ...] = (FaultService, ProfilerService, AveragingService, HealthService, MsftService,
                                       SamplesService)


def service_memory(spec, plan: dict) -> dict[str, int]:
    """The bytes the services hold for ``spec`` (``plan``: ``pgs.runtime.tools.profile.plan_from_spec``'s),
    summed over :data:`SERVICES`' ``memory_estimate``: ``device`` joins the predicted peak,
    ``host`` the host memory ``pgs validate`` and ``pgs run`` check (``tools/profile.predict``)."""
    total = {"device": 0, "host": 0}
    for cls in SERVICES:
        for where, nbytes in cls.memory_estimate(spec, plan).items():
            total[where] += int(nbytes)
    return total


def before_step(services: list[Service], run, step: int) -> None:
    for service in services:
        service.before_step(run, step)


def after_step(services: list[Service], run, step: int) -> None:
    for service in reversed(services):
        service.after_step(run, step)
