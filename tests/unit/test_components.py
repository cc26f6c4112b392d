"""Runtime services as components: the step protocol's order, the checkpointer's and the
evaluator's decisions, configs that live next to their code, rules written once, and one memory
figure for ``pgs profile`` and the preflight."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import attrs
import pytest
import torch

from pgs.errors import SpecError
from pgs.runtime.common import auto_device
from pgs.runtime.loop.checkpointer import Checkpointer
from pgs.runtime.loop.evaluator import Evaluator
from pgs.runtime.loop.services import Service, after_step, before_step, build_services
from pgs.runtime.store.config import CheckpointSpec
from helpers import cpu_spec


class Recorder(Service):
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def before_step(self, run, step):
        self.calls.append(("before", self.name, step))

    def after_step(self, run, step):
        self.calls.append(("after", self.name, step))


def test_before_hooks_run_in_order_and_after_hooks_in_reverse():
    calls: list = []
    services = [Recorder("a", calls), Recorder("b", calls), Service()]
    before_step(services, None, 3)
    after_step(services, None, 3)
    assert calls == [("before", "a", 3), ("before", "b", 3), ("after", "b", 3), ("after", "a", 3)]


def test_a_new_service_joins_through_build_services():
    calls: list = []
    run = SimpleNamespace(faults=SimpleNamespace(slow_step_s=0, crash=lambda *a: None), averaging=None,
                          health=None, msft=None, samples=None)
    services = build_services(run, extra=(Recorder("mine", calls),))
    before_step(services, run, 1)
    after_step(services, run, 1)
    assert calls == [("before", "mine", 1), ("after", "mine", 1)]


def test_the_checkpointer_saves_every_n_steps_at_a_stop_and_at_the_last_step():
    run = SimpleNamespace(spec=SimpleNamespace(checkpoint=CheckpointSpec(every=3)), ctx=None, saver="unset")
    c = Checkpointer(run)
    assert run.saver is None and c.saver is None  # no background saver unless checkpoint.background
    assert [s for s in range(1, 8) if c.should_save(s, last_step=False, stop=False)] == [3, 6]
    assert c.should_save(4, last_step=False, stop=True) and c.should_save(7, last_step=True, stop=False)
    never = Checkpointer(SimpleNamespace(spec=SimpleNamespace(checkpoint=CheckpointSpec(every=0)), ctx=None))
    assert not any(never.should_save(s, last_step=False, stop=False) for s in range(1, 10))
    # checkpoint.last = false: no save after the last step, unless it is a periodic one or a stop
    last = Checkpointer(SimpleNamespace(spec=SimpleNamespace(checkpoint=CheckpointSpec(every=3, last=False)), ctx=None))
    assert not last.should_save(7, last_step=True, stop=False)
    assert last.should_save(6, last_step=True, stop=False) and last.should_save(7, last_step=True, stop=True)


def _eval_spec(eval_file, every, source_evals=()):
    sources = [SimpleNamespace(eval=e) for e in source_evals] or [SimpleNamespace(eval=None)]
    return SimpleNamespace(data=SimpleNamespace(eval=eval_file, sources=sources),
                           train=SimpleNamespace(eval_every=every))


def test_the_evaluator_runs_every_n_steps_and_after_the_last_one_when_there_is_eval_data():
    e = Evaluator(_eval_spec("eval.jsonl", 4))
    assert [s for s in range(0, 10) if e.should_evaluate(s)] == [0, 4, 8]
    assert e.should_evaluate(9, last_step=True)
    assert Evaluator(_eval_spec(None, 4, ["a.jsonl"])).should_evaluate(4)  # a source's own eval file
    assert not Evaluator(_eval_spec(None, 4)).should_evaluate(4)  # nothing to evaluate
    assert not Evaluator(_eval_spec("eval.jsonl", 0)).should_evaluate(0, last_step=True)  # eval_every = 0: off


def test_each_section_config_lives_next_to_its_code_and_the_spec_re_exports_it():
    from pgs.runtime.loop import averaging, config as loop_config, trackers
    from pgs.runtime.model import config as model_config
    from pgs.runtime.optim import config as optim_config
    from pgs.runtime.spec import load, sections
    from pgs.runtime.store import config as store_config

    owners = {"memory": optim_config.MemorySpec, "optimizer": optim_config.OptimizerSpec,
              "schedule": optim_config.ScheduleSpec, "model": model_config.ModelSpec, "moe": model_config.MoESpec,
              "train": loop_config.TrainSpec, "loss": loop_config.LossSpec, "checkpoint": store_config.CheckpointSpec,
              "log": trackers.LogSpec, "averaging": averaging.AveragingSpec}
    for name, cls in owners.items():
        assert sections.SECTIONS[name] is cls
        assert getattr(load, cls.__name__) is cls


def test_the_memory_rules_are_written_once_and_said_alike_by_the_spec_and_the_binder(tmp_path):
    from pgs.runtime.optim import make_optimizer
    from pgs.runtime.optim.config import MemorySpec
    from pgs.runtime.spec.load import load_spec
    import pgs.func as pf

    memory = MemorySpec(offload_optimizer=True)
    why = memory.refusal()
    assert why.startswith("memory.offload_optimizer:") and "gradient_release = true" in why
    with pytest.raises(SpecError) as binder:
        make_optimizer(pf.lion(1e-3), torch.nn.Linear(2, 2), memory)
    spec = cpu_spec(tmp_path)
    with pytest.raises(SpecError) as loaded:
        load_spec(spec, ["memory.offload_optimizer=true", "optimizer.clip=0"])
    assert str(binder.value) == str(loaded.value) == why
    assert attrs.evolve(memory, gradient_release=True).refusal() is None


def test_pgs_profile_shows_the_peak_the_preflight_checks(tmp_path):
    from rich.console import Console

    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.tools import resources as R
    from pgs.runtime.tools.profile import profile

    spec = load_spec(cpu_spec(tmp_path))
    buf = io.StringIO()
    assert profile(spec, console=Console(file=buf, width=200)) == 0
    text = buf.getvalue()
    unit = re.search(r"predicted (GiB|MiB)", text).group(1)
    shown = float(re.search(r"peak \(what is live together at the worst phase\)\s*│\s*([\d.]+)", text).group(1))
    prediction = R.predict(spec, auto_device(spec.train.device))
    assert shown == pytest.approx(prediction.peak / (2**30 if unit == "GiB" else 2**20), abs=1e-3)
    assert "attention masks" in text


def test_a_services_memory_estimate_joins_the_predicted_peak_and_host_memory(tmp_path, monkeypatch):
    from pgs.runtime.loop.services import HealthService
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.tools import resources as R

    spec = load_spec(cpu_spec(tmp_path))
    before = R.predict(spec, torch.device("cpu"))
    monkeypatch.setattr(HealthService, "memory_estimate", staticmethod(lambda spec, plan: {"device": 1000, "host": 7}))
    after = R.predict(spec, torch.device("cpu"))
    assert after.peak == before.peak + 1000 and after.host == before.host + 7
    assert after.parts["services"] == 1000 and "services" not in before.parts


class _Counter(Service):
    """A service with state of its own (``state_name``): a tensor that must survive a resume."""

    state_name = "counter"

    def __init__(self, value=None):
        self.value = value

    def state_dict(self, run) -> dict:
        return {"value": self.value}

    def load_state_dict(self, run, tensors, folder) -> None:
        self.value = None if tensors is None else tensors["value"].clone()


def test_a_service_with_state_names_its_checkpoint_file_and_its_dcp_entry():
    """What the checkpointer writes of the services: one process, ``<state_name>.safetensors``;
    several, the DCP entry ``<state_name>``; a service without ``state_name`` adds nothing.
    (The save and restore of such state end to end: tests/integration/test_averaging.py and
    test_services_distributed.py, through the weight EMA's service.)"""
    from pgs.runtime.loop.checkpointer import service_entries, service_files, stateful

    kept = torch.tensor([1.5, -2.0, 3.25])
    run = SimpleNamespace(services=[Service(), _Counter(kept), Recorder("x", [])])
    assert [type(s) for s in stateful(run)] == [_Counter]
    assert service_files(run) == {"counter.safetensors": {"value": kept}}
    assert service_entries(run) == {"counter": {"value": kept}}
    assert service_files(SimpleNamespace(services=[Service()])) == {}
