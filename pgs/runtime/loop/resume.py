"""What a resumed run may change, checked against the checkpoint's own ``spec.resolved.toml``
before anything is restored (docs/checkpoints.md, "What a resume may change").

* **Hub revisions.**  A model, tokenizer, teacher or reference named by a hub name resolved to a
  commit (``pgs.runtime.model.hub``); the checkpoint's spec records ``org/name@<commit>``.  A
  resume whose name resolves to another commit (the branch moved on the hub) is refused: the run
  would continue against other weights.
* **The learning-rate schedule.**  The chain's step counter is restored and the schedule is
  the one the run built from the spec at hand, so a change of what the schedule depends on (the
  ``[schedule]`` fields, ``train.steps`` / ``train.epochs``) silently changes the learning
  rate of the steps to come: a cosine schedule of 60 steps extended to 90 jumps back up from its
  tail.  The rule: a resume may change these only if the new schedule gives every step already
  trained the learning rate it had (the resumed run is then a run planned that way from its
  start: a constant rate, a longer stable phase of WSD resumed inside it); one line says what
  changed.  Otherwise it is refused with one line naming the fields, old and new, and the
  learning rates at the seam.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs
import torch

from pgs.errors import SpecError
from pgs.runtime.model.hub import parse as hub_name
from pgs.runtime.spec.sections import ScheduleSpec
from pgs.runtime.spec.toml import read_toml

#: The fields that may name a hub repository (section, key).
HUB_FIELDS = (("model", "path"), ("model", "tokenizer"), ("distill", "teacher_path"),
              ("preference", "reference_path"))

SPEC_FILE = "spec.resolved.toml"


def _saved_spec(folder: str) -> dict | None:
    path = os.path.join(folder, SPEC_FILE)
    if not os.path.isfile(path):
        return None  # a checkpoint of a pgs that wrote no spec: nothing to compare
    try:
        return read_toml(path)
    except Exception:  # a damaged spec file: the checkpoint's manifest check has already passed on it
        return None


def check_hub(spec, saved: dict) -> None:
    """Refuse a resume whose hub names resolve to other commits than the checkpoint's."""
    for section, key in HUB_FIELDS:
        old = (saved.get(section) or {}).get(key)
        parsed = hub_name(old) if isinstance(old, str) else None
        if parsed is None or parsed[1] is None:
            continue
        field = f"{section}.{key}"
        now = spec.hub.get(field)
        if now is None and key == "tokenizer" and spec.hub.get("model.path") is not None:
            now = spec.hub["model.path"] if spec.model.tokenizer == spec.model.path else None
        if now is None or now.repo != parsed[0]:
            continue  # another source altogether: not a revision change (the other checks judge it)
        if now.revision != parsed[1]:
            raise SpecError(f"--resume: {field}: {now.repo} is revision {now.revision[:12]} now, the checkpoint was "
                            f"trained from {parsed[1][:12]}; set {field} = \"{now.repo}@{parsed[1]}\" to continue "
                            "from the same files, or start a new run")


def _format(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_schedule(spec, saved: dict, step: int, total: int, schedule,
                   steps_per_epoch: Callable[[int], int] | None = None) -> str | None:
    """The schedule of the checkpoint's spec against this run's ``schedule`` (built from
    ``spec`` for ``total`` steps); returns the note to print when something it depends on
    changed, raises ``SpecError`` when the learning rate of a step already trained (``step`` of
    them) would differ."""
    old_table = dict(saved.get("schedule") or {})
    old_train = saved.get("train") or {}
    if not old_table or not old_train:
        return None
    new_table = {k: v for k, v in attrs.asdict(spec.schedule).items()
                 if k == "name" or k in ScheduleSpec.USES[spec.schedule.name]}
    changes = [f"schedule.{k} {_format(old_table.get(k, '(default)'))} -> {_format(new_table.get(k, '(default)'))}"
               for k in sorted(set(old_table) | set(new_table)) if old_table.get(k) != new_table.get(k)]
    for key in ("steps", "epochs"):
        if old_train.get(key) != getattr(spec.train, key):
            changes.append(f"train.{key} {old_train.get(key, '(none)')} -> {getattr(spec.train, key) or '(none)'}")
    if old_train.get("epochs") is not None and old_train.get("batch_size") != spec.train.batch_size:
        changes.append(f"train.batch_size {old_train.get('batch_size')} -> {spec.train.batch_size}")
    if not changes:
        return None
    if old_train.get("steps") is not None:
        old_total = int(old_train["steps"])
    elif steps_per_epoch is not None:
        old_total = int(old_train["epochs"]) * steps_per_epoch(int(old_train.get("batch_size", spec.train.batch_size)))
    else:
        old_total = total
    old = ScheduleSpec(**old_table).build(old_total)
    counts = torch.arange(step + 1)  # the updates of the trained steps use counts 0 .. step-1; the next, step
    was, will = old(counts).double(), schedule(counts).double()
    what = ", ".join(changes)
    if step and not torch.allclose(was[:step], will[:step], rtol=1e-6, atol=0.0):
        first = int((~torch.isclose(was[:step], will[:step], rtol=1e-6, atol=0.0)).nonzero()[0])
        raise SpecError(
            f"--resume: {what} changes the learning rate of steps already trained (from step {first + 1}: "
            f"{was[first]:.3g} then, {will[first]:.3g} now; after step {step} the run would go on at "
            f"{will[step]:.3g} where it was at {was[step - 1]:.3g}); resume with the checkpoint's values, "
            "or start a new run (docs/checkpoints.md)")
    return (f"pgs: resume: {what}; the learning rate of the {step} steps trained is unchanged, "
            f"step {step + 1} goes on at {will[step]:.3g}")


def check_resume(spec, folder: str, step: int, total: int, schedule,
                 steps_per_epoch: Callable[[int], int] | None = None) -> str | None:
    """Both checks against checkpoint ``folder`` (at ``step``; ``schedule``: the run's); the note
    to print, or None."""
    saved = _saved_spec(folder)
    if saved is None:
        return None
    check_hub(spec, saved)
    return check_schedule(spec, saved, step, total, schedule, steps_per_epoch)
