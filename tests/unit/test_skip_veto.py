"""A skipped step skips: ZClip's veto leaves the weights and every other stage's state as they were.

ZClip in mode "skip" (Kumar et al., arXiv 2504.02507) zeroes its own output on a spike; with
Adam after it that alone would still move the weights (Adam's momentum) and decay its moments.
The chain honours the stage's veto (``Transform.skip_of``): the weights and the state of every
other stage come out bit for bit as they went in, and the runtime's ``spike`` (logged as a
skipped step) is True exactly then.
"""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.runtime.optim.bound import BoundOptimizer

WARMUP = 4


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g) * 0 - 0.0}


def _grads(step: int, spike: bool = False, nan: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    out = {"w": torch.randn(6, 5, generator=g) * 0.1, "b": torch.randn(5, generator=g) * 0.1}
    if spike:
        out = {k: v * 1000.0 for k, v in out.items()}
    if nan:
        out["w"] = out["w"].clone()
        out["w"][0, 0] = float("nan")
    return out


def _same(a, b) -> bool:
    la, lb = pf.tree.leaves(a), pf.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                                           y.view(-1).view(torch.uint8) if y.is_floating_point() else y)
        for x, y in zip(la, lb))


def _warm(opt, params, steps=WARMUP + 2):
    state = opt.init(params)
    for i in range(steps):
        u, state = opt.update(_grads(i), state, params)
        params = pf.apply_updates(params, u)
    return params, state


CHAINS = {
    "zclip_adamw": lambda mode: pf.chain(pf.zclip(warmup_steps=WARMUP, mode=mode), pf.adamw(1e-2, weight_decay=0.1)),
    "clip_zclip_adam_lr": lambda mode: pf.chain(pf.clip_by_global_norm(1e3), pf.zclip(warmup_steps=WARMUP, mode=mode),
                                                pf.scale_by_adam(), pf.scale_by_learning_rate(1e-2)),
    "nested_injected": lambda mode: pf.chain(
        pf.chain(pf.inject_hyperparams(pf.zclip, static_args=("mode",))(warmup_steps=WARMUP, mode=mode),
                 pf.scale_by_adam()),
        pf.inject_hyperparams(pf.scale_by_learning_rate)(learning_rate=lambda c: 1e-2 / (1.0 + c.double()))),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_skipped_spike_leaves_weights_and_other_state_bit_identical(name):
    opt = CHAINS[name]("skip")
    params, state = _warm(opt, _params())
    assert not bool(pf.skip_signal(opt, state))
    u, new_state = opt.update(_grads(50, spike=True), state, params)
    assert bool(pf.skip_signal(opt, new_state))
    after = pf.apply_updates(params, u)
    assert _same(after, params), "a skipped step moved the weights"
    # every stage but ZClip's own is exactly as it was; ZClip recorded the spike
    outer = list(state)
    for key in outer:
        child = opt.children[outer.index(key)]
        if child.skip_of is None:
            assert _same(new_state[key], state[key]), f"{key}: state changed on a skipped step"
    count = lambda st: int(pf.reported_metrics(st)["spikes_skipped"])  # noqa: E731
    assert count(new_state) == count(state) + 1
    # the next ordinary step goes on from the state before the spike, as if it never came
    u2, s2 = opt.update(_grads(51), new_state, params)
    ref_u, ref_s = opt.update(_grads(51), state, params)
    assert _same(u2, ref_u)
    assert not bool(pf.skip_signal(opt, s2))


def test_the_veto_holds_on_the_flat_path():
    opt = CHAINS["zclip_adamw"]("skip")
    flat = pf.compile(opt, jit=False)
    params = _params()
    state = flat.init(params)
    for i in range(WARMUP + 2):
        params, state = flat.step(_grads(i), state, params)
    new_params, new_state = flat.step(_grads(50, spike=True), state, params)
    assert bool(pf.skip_signal(opt, new_state))
    assert _same(new_params, params)
    assert _same(new_state["1_chain"], state["1_chain"])


def test_clip_mode_clips_a_spike_without_vetoing_but_vetoes_a_nan():
    opt = CHAINS["zclip_adamw"]("clip")
    params, state = _warm(opt, _params())
    u, s = opt.update(_grads(50, spike=True), state, params)
    assert bool(s["0_zclip"].spike) and not bool(pf.skip_signal(opt, s))
    assert not _same(pf.apply_updates(params, u), params)  # clipped, applied
    u, s = opt.update(_grads(51, nan=True), state, params)
    assert bool(pf.skip_signal(opt, s))
    assert _same(pf.apply_updates(params, u), params) and _same(s["1_chain"], state["1_chain"])


def test_a_chain_without_a_vetoing_stage_never_vetoes():
    opt = pf.chain(pf.clip_by_global_norm(1.0), pf.adamw(1e-2))
    assert opt.skip_of is None and pf.skip_signal(opt, opt.init(_params())) is None


@pytest.mark.parametrize("compile", [False, True])
def test_bound_optimizer_reports_spike_only_on_a_vetoed_step(compile):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = BoundOptimizer(CHAINS["zclip_adamw"]("skip"), model, compile=compile, jit=False)
    x = torch.randn(8, 5)
    for i in range(WARMUP + 3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        assert opt.metrics().spike is False
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state_before = opt.state_dict()
    (model(x).pow(2).mean() * 1e4).backward()
    opt.step()
    opt.zero_grad()
    assert opt.metrics().spike is True
    assert _same(before, {k: v.detach() for k, v in model.state_dict().items()})
    after = opt.state_dict()
    moved = [k for k in state_before if not _same({"x": state_before[k]}, {"x": after[k]})]
    assert moved and all("zclip" in k for k in moved), moved


# --------------------------------------------------------------------------- the loop


#: the tiny spec of tests/integration/test_faults_validate_run.py, trained 7 steps with a checkpoint after each
LOOP_SETS = (
    "train.steps=7", "checkpoint.every=1", "checkpoint.keep=0", 'checkpoint.best_metric=""',
    'schedule.name="constant"', "schedule.peak=1e-3",
    'optimizer.chain=[{{ name = "zclip", mode = "{mode}", warmup_steps = 3 }}, {{ name = "scale_by_adam" }}, '
    '{{ name = "add_decayed_weights", weight_decay = 0.1 }}, {{ name = "scale_by_learning_rate" }}]',
)

SPIKE_STEP = 6


@pytest.mark.parametrize("mode", ["skip", "clip"])
def test_the_loop_logs_skipped_only_for_a_vetoed_step_which_changes_nothing(tmp_path, monkeypatch, mode):
    """An injected spike (step 6's loss × 10⁴, so its gradient norm is a z-score outlier): with
    mode "skip" the step is logged skipped and step_6's weights and optimizer state equal
    step_5's bit for bit; with mode "clip" it is an ordinary (clipped) step."""
    import json as _json

    from safetensors.torch import load_file

    from pgs.cli import main
    from pgs.runtime.loop import sft

    calls = {"n": 0}
    real = sft.token_loss

    def spiking(*args, **kwargs):  # one micro-batch per step: the n-th call is step n
        calls["n"] += 1
        result = real(*args, **kwargs)
        if calls["n"] == SPIKE_STEP:
            result = result._replace(loss_sum=result.loss_sum * 1e4)  # TokenLossResult, a NamedTuple
        return result

    monkeypatch.setattr(sft, "token_loss", spiking)  # the SFT objective's loss
    from helpers import cpu_spec

    sets = [a for item in LOOP_SETS for a in ("--set", item.format(mode=mode))]
    assert main(["run", str(cpu_spec(tmp_path)), *sets]) == 0
    run = tmp_path / "run"
    steps = [_json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in steps] == list(range(1, 8))
    assert [r["skipped"] for r in steps] == [int(mode == "skip" and r["step"] == SPIKE_STEP) for r in steps]
    before = {k: load_file(run / f"step_{SPIKE_STEP - 1}" / f) for k, f in
              (("model", "model.safetensors"), ("optimizer", "optimizer.safetensors"))}
    after = {k: load_file(run / f"step_{SPIKE_STEP}" / f) for k, f in
             (("model", "model.safetensors"), ("optimizer", "optimizer.safetensors"))}
    assert _same(before["model"], after["model"]) is (mode == "skip")
    changed = [k for k in before["optimizer"] if not _same({"x": before["optimizer"][k]}, {"x": after["optimizer"][k]})]
    if mode == "skip":  # only ZClip's own record of the spike moved
        assert changed and all("zclip" in k for k in changed), changed
    else:
        assert any("adam" in k for k in changed)
