"""The loop's objective interface (pgs/runtime/loop/objective.py): which class a spec selects,
that both objectives carry every member the loop asks for, and that a new objective plugs into
the real loop with nothing else changed: its host numbers reach the step records, its state and
its generator go through a checkpoint and continue exactly after a resume."""

from __future__ import annotations

import json
import types

import pytest
import torch

from pgs.errors import SpecError
from pgs.runtime.loop import objective as O
from pgs.runtime.loop.preference import PreferenceObjective
from pgs.runtime.loop.sft import SFTObjective
from helpers import records, step_records, tiny_spec

#: The members the loop reads (the protocol's annotations and methods).
MEMBERS = sorted(set(O.Objective.__annotations__) | {
    k for k, v in vars(O.Objective).items() if callable(v) and not k.startswith("_")})


def test_the_spec_section_selects_the_objective(monkeypatch):
    assert O.objective_class(types.SimpleNamespace(preference=None)) is SFTObjective
    assert O.objective_class(types.SimpleNamespace(preference=object())) is PreferenceObjective

    class Distill(SFTObjective):
        section = "distill"

    monkeypatch.setattr(O, "objective_classes", lambda: (PreferenceObjective, Distill, SFTObjective))
    assert O.objective_class(types.SimpleNamespace(preference=None, distill=object())) is Distill
    with pytest.raises(SpecError, match=r"\[preference\] and \[distill\]: a run trains one objective"):
        O.objective_class(types.SimpleNamespace(preference=object(), distill=object()))


@pytest.mark.parametrize("cls", [SFTObjective, PreferenceObjective])
def test_every_objective_has_what_the_loop_asks_for(cls):
    assert "forward" in MEMBERS and "stream" in MEMBERS and "generators" in MEMBERS
    missing = [m for m in MEMBERS if m != "stream" and not hasattr(cls, m)]
    assert missing == []
    assert len(cls.stat_keys) >= 1 and callable(cls.create)


class Sampling(SFTObjective):
    """SFT plus what an on-policy objective adds: a draw per step from its own generator
    (reported through ``prepare``'s host numbers) and a counter in its checkpoint state."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampler = torch.Generator().manual_seed(11)
        self.prepared = 0

    def prepare(self, run, batches):
        self.prepared += 1
        return batches, {"draw": float(torch.rand((), generator=self.sampler)), "prepared": self.prepared}

    def state_dict(self):
        return {**super().state_dict(), "prepared": self.prepared}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.prepared = (state or {}).get("prepared", 0)

    def generators(self):
        return {**super().generators(), "sampler": self.sampler}


def test_a_new_objective_plugs_into_the_loop_and_resumes_exactly(tmp_path, monkeypatch):
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    monkeypatch.setattr(O, "objective_classes", lambda: (Sampling,))
    spec = load_spec(tiny_spec(tmp_path, "plug", steps=4, every=2))
    assert run(spec) == 0
    first = step_records(tmp_path / "plug")
    assert [r["prepared"] for r in first] == [1, 2, 3, 4]
    trainer = json.loads((tmp_path / "plug" / "step_2" / "trainer.json").read_text())
    assert trainer["objective"] == {"entropy_low": False, "prepared": 2}
    assert run(spec, resume=str(tmp_path / "plug" / "step_2")) == 0
    again = step_records(tmp_path / "plug")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(first, again):  # the sampler continues where step 2 left it
        assert (a["draw"], a["prepared"], a["loss"]) == (b["draw"], b["prepared"], b["loss"])
    assert len({r["draw"] for r in first}) == 4
    assert any(r.get("event") == "resume" for r in records(tmp_path / "plug"))


def test_a_preference_checkpoint_resumes_only_against_its_reference():
    from pgs.runtime.loop.preference import Reference
    from pgs.runtime.store.reference import StaleReference

    spec = types.SimpleNamespace(preference=object())
    cached = PreferenceObjective(spec, Reference("cached", key="0123abcd"), [])
    state = cached.state_dict()
    assert state == {"reference": "cached", "key": "0123abcd"}
    assert json.loads(json.dumps(state)) == state
    cached.load_state_dict(state)
    cached.load_state_dict(None)  # a checkpoint written before objectives had state
    live = PreferenceObjective(spec, Reference("live"), [])
    with pytest.raises(StaleReference, match=r"the cached reference \(cache key 0123abcd\), this run has the live"):
        live.load_state_dict(state)
    other = PreferenceObjective(spec, Reference("cached", key="ffff0000"), [])
    with pytest.raises(StaleReference, match="cache key ffff0000"):
        other.load_state_dict(state)
