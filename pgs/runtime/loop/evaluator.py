"""Evaluation as one component: when (``train.eval_every``, the last step, and step 0 of a
fresh run), what (the objective's eval record, each source's own eval loss, what the
services add: ``pgs.runtime.loop.services``) and what follows (the best model, by the
checkpointer).  The eval functions themselves are ``pgs.runtime.loop.evaluate``."""

from __future__ import annotations

from pgs.runtime.loop.msft import source_eval_losses


def evaluate(run) -> dict:
    """The objective's eval record at the current step, and each source's own eval loss where
    sources name eval files.  With several processes every rank calls it and gets the same
    record (each rank evaluates its share, the sums are all-reduced)."""
    out = {"step": run.step}
    if run.spec.data.eval:
        out.update(run.objective.evaluate(run))
    out.update(source_eval_losses(run))
    return out


def _line(result: dict) -> str:
    return "eval  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())


class Evaluator:
    """Whether a step ends with an evaluation, and the evaluation itself."""

    def __init__(self, spec):
        data = spec.data
        self.every = spec.train.eval_every
        self.enabled = (bool(data.eval) or any(s.eval for s in data.sources)) and self.every > 0

    def should_evaluate(self, step: int, *, last_step: bool = False) -> bool:
        """At step 0 (before training), every ``eval_every`` steps, and after the last one."""
        return self.enabled and (step % self.every == 0 or last_step)

    def run(self, run, services=(), checkpointer=None) -> dict:
        """Evaluate, let the services add to the record (``eval_record``) and react to it
        (``after_eval``), log it, and keep the best model."""
        with run.bound.eval_weights():  # a schedule-free chain is evaluated at its x
            result = evaluate(run)
        for service in services:
            service.eval_record(run, result)
        run.log.write(result)
        run.log.say(_line(result))
        for service in reversed(services):
            service.after_eval(run, result)
        if checkpointer is not None:
            checkpointer.keep_best(run, result)
        return result
