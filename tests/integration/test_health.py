"""The run's health monitor (issue 24, item 3): spikes of ‖g‖ and loss against running
statistics, the interval summary in metrics.jsonl (‖g‖ statistics, entropy trend, update/weight
norm ratio per parameter group), and the ``train.entropy_halt`` tripwire: exit 80 and HALT.json."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pgs.errors import EXIT_TRIPWIRE
from pgs.runtime.loop import train
from pgs.runtime.loop.health import SPIKE_Z, WARMUP, HealthMonitor, group_of
from pgs.runtime.spec.load import load_spec
from helpers import tiny_spec


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(5, 3)
        self.self_attn = torch.nn.Linear(3, 3, bias=False)
        self.mlp = torch.nn.Linear(3, 4, bias=False)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def _records(values, key="grad_norm", base=None):
    for step, v in enumerate(values, 1):
        yield {"step": step, "skipped": 0, "loss": 2.0, "grad_norm": 1.0, "entropy": 1.5, **(base or {}), key: v}


def test_a_grad_norm_spike_is_flagged_and_counted():
    monitor = HealthMonitor(_Tiny(), every=30, total=100)
    g = torch.Generator().manual_seed(0)
    calm = (1.0 + 0.05 * torch.randn(24, generator=g)).tolist()
    events = [e for r in _records(calm + [4.0] + calm[:4]) for e in monitor.observe(r)]
    assert [(e["event"], e["what"], e["step"]) for e in events] == [("spike", "grad_norm", 25)]
    assert events[0]["z"] > SPIKE_Z
    record = {"step": 30, "skipped": 0, "loss": 2.0, "grad_norm": 1.0, "entropy": 1.5}
    monitor.observe(record)
    assert record["health/grad_norm_spikes"] == 1 and record["health/loss_spikes"] == 0
    assert record["health/grad_norm_max"] == 4.0


def test_no_spike_before_warmup_and_none_on_a_smooth_trend():
    monitor = HealthMonitor(_Tiny(), every=1000, total=1000)
    early = list(_records([1.0] * (WARMUP - 1) + [50.0]))  # too early to judge
    assert not [e for r in early for e in monitor.observe(r)]
    smooth = HealthMonitor(_Tiny(), every=1000, total=1000)
    losses = [3.0 * math.exp(-0.02 * i) for i in range(200)]  # a loss going down as losses do
    assert not [e for r in _records(losses, key="loss") for e in smooth.observe(r)]


def test_a_loss_spike_is_flagged_and_spikes_do_not_teach_the_statistics():
    monitor = HealthMonitor(_Tiny(), every=1000, total=1000)
    losses = [2.0 + 0.01 * (i % 3) for i in range(20)] + [9.0, 9.0, 2.0]
    events = [e for r in _records(losses, key="loss") for e in monitor.observe(r)]
    assert [(e["what"], e["step"]) for e in events] == [("loss", 21), ("loss", 22)]
    assert monitor.stats["loss"].mean == pytest.approx(2.01, abs=0.01)


def test_entropy_trend_and_summary_interval():
    monitor = HealthMonitor(_Tiny(), every=4, total=10)
    records = list(_records([2.0, 1.8, 1.6, 1.4], key="entropy"))
    for r in records:
        monitor.observe(r)
    assert "health/entropy_mean" not in records[2]
    assert records[3]["health/entropy_mean"] == pytest.approx(1.7)
    assert records[3]["health/entropy_slope"] == pytest.approx(-0.2)
    assert monitor.summarises(10) and not monitor.summarises(9)


def test_update_ratio_per_group_equals_the_hand_computation():
    model = _Tiny()
    assert [group_of(n) for n, _ in model.named_parameters()] == ["embed", "attn", "mlp", "other", "other"]
    monitor = HealthMonitor(model, every=1, total=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monitor.before_step(1)
    with torch.no_grad():  # a "step": each trainable weight moves by a known amount
        for i, p in enumerate(model.parameters()):
            if p.requires_grad:
                p.add_(0.1 * (i + 1) * torch.ones_like(p))
    monitor.after_step(1)
    record = {"step": 1, "skipped": 0, "loss": 1.0}
    monitor.observe(record)
    named = {n: p.detach() for n, p in model.named_parameters()}
    for name, group in (("embed_tokens.weight", "embed"), ("self_attn.weight", "attn"), ("mlp.weight", "mlp")):
        expected = float((named[name] - before[name]).norm() / named[name].norm())
        assert record[f"health/update_ratio/{group}"] == pytest.approx(expected, rel=1e-6)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    total = math.sqrt(sum(float((named[n] - before[n]).square().sum()) for n in trained))
    size = math.sqrt(sum(float(named[n].square().sum()) for n in trained))
    assert record["health/update_ratio"] == pytest.approx(total / size, rel=1e-6)
    assert "health/update_ratio/other" not in record  # frozen: not measured


def test_update_ratio_of_a_large_parameter_is_its_strided_sample():
    """A parameter over ``RATIO_SAMPLE`` elements: the ratio over its evenly strided sample (no
    copy of the whole weight), close to the exact ratio for a spread-out update."""
    model = torch.nn.Linear(300, 200, bias=False)  # 60,000 elements > 8,192
    monitor = HealthMonitor(model, every=1, total=1)
    before = model.weight.detach().clone()
    monitor.before_step(1)
    assert sum(s.numel() for s in monitor.ratio._snapshot) <= 8192
    with torch.no_grad():
        model.weight.add_(torch.randn_like(model.weight) * 0.01)
    monitor.after_step(1)
    record = {"step": 1, "skipped": 0, "loss": 1.0}
    monitor.observe(record)
    w = model.weight.detach().reshape(-1)
    stride = -(-w.numel() // 8192)
    sampled = float((w[::stride] - before.reshape(-1)[::stride]).norm() / w[::stride].norm())
    exact = float((w - before.reshape(-1)).norm() / w.norm())
    assert record["health/update_ratio"] == pytest.approx(sampled, rel=1e-6)
    assert record["health/update_ratio"] == pytest.approx(exact, rel=0.05)


def _run(tmp_path, name, *sets):
    spec = load_spec(tiny_spec(tmp_path, name, steps=4), ["train.health_every=2", *sets])
    code = train.run(spec)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return code, [json.loads(line) for line in lines]


def test_a_run_writes_the_health_keys_on_its_summary_steps(tmp_path):
    code, records = _run(tmp_path, "run")
    assert code == 0
    steps = {r["step"]: r for r in records if "loss" in r}
    keys = {"health/grad_norm_mean", "health/grad_norm_max", "health/grad_norm_std", "health/grad_norm_spikes",
            "health/loss_spikes", "health/entropy_mean", "health/entropy_slope", "health/update_ratio",
            "health/update_ratio/attn", "health/update_ratio/mlp", "health/update_ratio/embed",
            "health/update_ratio/norm"}
    for step in (2, 4):
        assert keys <= set(steps[step]), keys - set(steps[step])
        assert 0 < steps[step]["health/update_ratio"] < 1
    assert not any(k.startswith("health/") for k in steps[1]) and not any(k.startswith("health/") for k in steps[3])
    assert steps[2]["health/entropy_mean"] == pytest.approx((steps[1]["entropy"] + steps[2]["entropy"]) / 2)
    trainer = json.loads((tmp_path / "run" / "step_4" / "trainer.json").read_text())
    assert set(trainer["health"]) == {"stats", "window", "spikes"}  # resumes where it was
    from pgs.runtime.tools.report import write_report

    write_report(str(tmp_path / "run"))  # pgs report draws the ratios
    assert (tmp_path / "run" / "report" / "update_ratio.png").stat().st_size > 0


def test_the_entropy_tripwire_halts_with_80_and_halt_json(tmp_path, capsys):
    code, records = _run(tmp_path, "halt", "train.entropy_halt=100.0")  # every entropy is below 100 nats
    assert code == EXIT_TRIPWIRE == 80
    marker = json.loads((tmp_path / "halt" / "HALT.json").read_text())
    assert marker["exit_code"] == 80 and marker["step"] == 2 and marker["tripwire"] == "train.entropy_halt"
    assert "train.entropy_halt" in marker["reason"]
    assert max(r["step"] for r in records if "loss" in r) <= 3  # stopped at the first summary
    assert "train.entropy_halt" in capsys.readouterr().err


def test_a_summary_every_step_logs_every_step_update_ratio(tmp_path):
    """``train.health_every = 1``: step N's ratio is measured before step N-1's record is read
    (the loop reads a record one step late); each record still gets its own step's ratio."""
    code, records = _run(tmp_path, "every", "train.health_every=1")
    assert code == 0
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    ratios = [r.get("health/update_ratio") for r in steps]
    assert ratios[0] == 0.0 and all(0 < x < 1 for x in ratios[1:]), ratios  # step 1: the warm-up's zero rate
