"""``[memory] gradient_release = true`` in the real loop (``pgs run``), on the CPU.

A tiny Qwen3 (tests/helpers.py's tiny spec, ``grad_accum = 1``, ``optimizer.clip = 0``) trains
with the chain inside backward.  Expected, and checked:

- the weights equal the same run without gradient release **bit for bit** (fp32 AdamW): each
  parameter's update is the same per-tensor arithmetic on the same gradient (the gradient of
  a parameter is complete when its post-accumulate hook fires, tied head included), so the
  only thing that changes is *when* it runs (tests/unit/test_release.py shows the same for the
  bare component);
- a non-finite loss is seen before backward: no backward, no update, no state change;
- SIGKILL after a step and ``--resume auto`` give the uninterrupted run's checkpoint bits
  (weights and every group's chain state);
- what gradient release cannot run is refused by ``pgs validate`` (exit 2), naming the field.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_same_checkpoint, launch, run_here, step_records, tiny_spec
from pgs.runtime.loop.faults import Faults

RELEASE = "\n[memory]\ngradient_release = {release}\ndefer_head_grad = {defer}\n"


def release_spec(tmp_path: Path, name: str, *, release: bool = True, defer: bool | str = False, **fields) -> Path:
    """tests/helpers.py's tiny spec with grad_accum = 1, clip = 0 and a [memory] section."""
    fields.setdefault("steps", 6)
    fields.setdefault("every", 3)
    path = tiny_spec(tmp_path, name, **fields)
    text = path.read_text().replace("grad_accum = 2", "grad_accum = 1")
    text = text.replace('alias = "adamw"', 'alias = "adamw"\nclip = 0')
    path.write_text(text + RELEASE.format(release="true" if release else "false",
                                          defer=f'"{defer}"' if isinstance(defer, str) else str(defer).lower()))
    return path


def _run_in_process(spec_path: Path) -> int:
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import run

    return run(load_spec(spec_path))


def test_release_run_equals_the_bound_run_bit_for_bit(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, release in (("bound", False), ("released", True)):
            assert _run_in_process(release_spec(tmp_path, name, release=release, every=0)) == 0
    finally:
        torch.set_num_threads(threads)
    a = load_file(tmp_path / "bound" / "step_6" / "model.safetensors")
    b = load_file(tmp_path / "released" / "step_6" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item():.3g}"
    # the logged losses are the same too (same weights at every step)
    la = [r["loss"] for r in step_records(tmp_path / "bound")]
    lb = [r["loss"] for r in step_records(tmp_path / "released")]
    assert la == lb and len(la) == 6
    # the release run reports the learning rate and the gradient norm it streamed
    assert all("lr" in r and "grad_norm" in r for r in step_records(tmp_path / "released"))


def test_nonfinite_loss_is_skipped_before_backward(tmp_path, monkeypatch):
    from pgs.runtime.loop import control
    from pgs.runtime.optim.release import GradientRelease
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    run = setup(load_spec(release_spec(tmp_path, "nan", steps=4)), faults=Faults(nan_steps={1}))
    assert isinstance(run.bound, GradientRelease) and run.bound.in_backward
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    state = {k: v.clone() for k, v in run.bound.state_dict().items()}
    with control.StopSignals() as signals:
        record, flags = train_step(run, signals, control.WallClock(None))
        assert record["skipped"] == 1 and flags[control.NONFINITE]
        for n, p in run.model.named_parameters():
            assert torch.equal(p, before[n]), n
            assert p.grad is None, n
        after = run.bound.state_dict()
        assert all(torch.equal(after[k], v) for k, v in state.items())
        assert run.bound.steps == 0
        record, _ = train_step(run, signals, control.WallClock(None))  # step 2 is finite: it trains
        assert record["skipped"] == 0 and run.bound.steps == 1 and run.bound.counts() == {1}
        # (warmup from lr 0: the first update moves the moments, the second the weights)
        record, _ = train_step(run, signals, control.WallClock(None))
    assert record["skipped"] == 0 and run.bound.counts() == {2}
    assert any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters())


def test_sigkill_then_resume_with_release_is_bit_exact(tmp_path, capfd):
    assert run_here(release_spec(tmp_path, "ref")) == 0  # one thread, as the children

    spec = release_spec(tmp_path, "run")
    first = launch(spec, **Faults(crash_at=("step", 5)).env())
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (tmp_path / "run" / "step_3" / "COMPLETE").exists()
    capfd.readouterr()
    assert run_here(spec, "--resume", "auto") == 0  # in this process, one thread
    err = capfd.readouterr().err
    assert "resumed from" in err and "step_3" in err
    # weights and the release state (every group's moments and count, the layout fingerprint)
    assert_same_checkpoint(tmp_path / "run" / "step_6", tmp_path / "ref" / "step_6")
    state = load_file(tmp_path / "run" / "step_6" / "optimizer.safetensors")
    assert "__pgs_release_groups__" in state


REFUSALS = [
    ({"train.grad_accum": 2}, "memory.gradient_release: train.grad_accum = 2"),
    ({"optimizer.clip": 1.0}, "memory.gradient_release: optimizer.clip = 1 is a global-norm clip"),
    ({"chain": '[{ name = "zclip" }, { name = "adamw" }]'}, "memory.gradient_release: optimizer.chain[0] (zclip)"),
    ({"memory.gradient_release": "false", "memory.master_weights": '"fp32"'}, "memory.master_weights"),
    ({"memory.offload_checkpoints": "true"}, "memory.offload_checkpoints: offloads the inputs of \"full\" or"),
    ({"memory.offload_prefetch": 2}, "memory.offload_prefetch = 2: how far ahead backward fetches"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_refusals_name_the_field(tmp_path, overrides, message):
    from pgs.errors import SpecError
    from pgs.runtime.spec.load import load_spec

    path = release_spec(tmp_path, "bad")
    if "chain" in overrides:  # a chain replaces the alias, its args and its clip
        text = path.read_text()
        start, end = text.index("[optimizer]"), text.index("[schedule]")
        path.write_text(text[:start] + f"[optimizer]\nchain = {overrides.pop('chain')}\n\n" + text[end:])
    sets = [f"{k}={v}" for k, v in overrides.items()]
    with pytest.raises(SpecError) as err:
        load_spec(path, sets)
    assert str(err.value).startswith(message), str(err.value)
    assert "set " in str(err.value) or "remove" in str(err.value)  # says the fix


def test_pgs_validate_exits_2_on_a_refused_spec(tmp_path, capsys):
    from pgs.cli import main

    path = release_spec(tmp_path, "bad")
    capsys.readouterr()
    assert main(["validate", str(path), "--set", "optimizer.clip=1.0"]) == 2  # in this process
    err = capsys.readouterr().err
    assert "memory.gradient_release: optimizer.clip = 1 is a global-norm clip" in err
    assert "optimizer.clip = 0" in err


def test_memory_section_round_trips_and_profile_reads_it(tmp_path):
    from pgs.runtime.tools.profile import memory_options
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(release_spec(tmp_path, "mem"), ["memory.activation_checkpointing=\"selective\"",
                                                      "memory.checkpoint_every=2"])
    again = tmp_path / "again.toml"
    spec.to_toml(again)
    assert load_spec(again).memory == spec.memory
    opts = memory_options(spec)
    assert opts == {"gradient_release": True, "activation_checkpointing": "selective", "checkpoint_every": 2,
                    "master_weights": None, "offload_checkpoints": False, "offload_prefetch": "auto",
                    "offload_optimizer": False}
    from pgs.errors import SpecError

    with pytest.raises(SpecError, match=r"memory.activation_checkpointing: 'fulll' is not one of .*did you mean"):
        load_spec(release_spec(tmp_path, "typo"), ['memory.activation_checkpointing="fulll"'])
    with pytest.raises(SpecError, match=r"memory.gradient_releas: unknown key \(did you mean gradient_release"):
        load_spec(release_spec(tmp_path, "typo2"), ["memory.gradient_releas=true"])


def test_activation_checkpointing_from_the_spec_keeps_the_loss(tmp_path, monkeypatch):
    """[memory] activation_checkpointing (and offload_checkpoints) reach the model; the loss is unchanged."""
    from pgs.runtime.model import layers
    from pgs.runtime.loop import control
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    offloads = []
    real = layers.apply_activation_checkpointing
    monkeypatch.setattr(layers, "apply_activation_checkpointing",
                        lambda *a, **k: offloads.append(k.get("offload")) or real(*a, **k))
    losses = []
    for policy, offload in (("none", False), ("full", False), ("full", True), ("sublayer", True), ("full", 2)):
        sets = [f'memory.activation_checkpointing="{policy}"', f"memory.offload_checkpoints={str(bool(offload)).lower()}"]
        if offload is not True and offload:  # memory.offload_prefetch: inputs fetched that many layers ahead
            sets.append(f"memory.offload_prefetch={offload}")
        run = setup(load_spec(release_spec(tmp_path, f"ac_{policy}_{offload}"), sets))
        decoder = run.model.model.layers
        assert all(("_pgs_forward_before_checkpointing" in layer.__dict__) == (policy != "none") for layer in decoder)
        with control.StopSignals() as signals:
            losses.append([train_step(run, signals, control.WallClock(None))[0]["loss"] for _ in range(2)])
    assert losses[0][0] == losses[1][0] == losses[2][0] == losses[3][0]
    assert losses[0][1] == pytest.approx(losses[1][1], rel=1e-5)
    assert losses[2][1] == losses[1][1]  # offloading the kept inputs changes no arithmetic
    assert losses[3][1] == pytest.approx(losses[1][1], rel=1e-5)  # the layer as two halves: same math
    assert losses[4] == losses[2]  # fetching two layers ahead changes no arithmetic either
    assert offloads == [False, 1, 1, 2]  # the depth apply_activation_checkpointing gets ("auto" is 1 here)


@pytest.mark.parametrize("setting,offload_optimizer,depth", [
    ("auto", False, 1), ("auto", True, 2), (1, True, 1), (3, False, 3), (3, True, 3)])
def test_offload_prefetch_auto_is_two_where_the_optimizer_state_shares_the_copies(tmp_path, setting,
                                                                                    offload_optimizer, depth):
    """``memory.offload_prefetch = "auto"`` (the default): the checkpointed inputs come back two
    layers ahead where the optimizer state's fetches share the host→device copies, else one; an
    int is taken as given; a bad value is one spec error naming the field."""
    from pgs.errors import SpecError
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.optim.config import prefetch_depth

    value = f'"{setting}"' if isinstance(setting, str) else str(setting)
    spec = load_spec(release_spec(tmp_path, "pf"), ['memory.activation_checkpointing="full"',
                                                     "memory.offload_checkpoints=true",
                                                     f"memory.offload_optimizer={str(offload_optimizer).lower()}",
                                                     f"memory.offload_prefetch={value}"])
    assert prefetch_depth(spec.memory.offload_prefetch, spec.memory.offload_optimizer) == depth
    for bad in ("0", '"two"', "1.5"):
        with pytest.raises(SpecError, match=r'memory.offload_prefetch: .*an integer >= 1 or "auto"'):
            load_spec(release_spec(tmp_path, "pf_bad"), [f"memory.offload_prefetch={bad}"])


def test_deferred_head_grad_run_matches_the_bound_run(tmp_path):
    """``memory.defer_head_grad`` (the default): the tied head's gradient joins the embedding's
    in its hook; the same run up to summation order."""
    for name, release, defer in (("bound_d", False, False), ("deferred", True, True)):
        assert _run_in_process(release_spec(tmp_path, name, release=release, defer=defer, every=0, steps=3)) == 0
    _assert_close_runs(tmp_path / "bound_d", tmp_path / "deferred", step=3)


def _assert_close_runs(ref: Path, run: Path, step: int) -> None:
    """Weights at ``step`` and every logged loss of two runs, up to summation order."""
    a = load_file(ref / f"step_{step}" / "model.safetensors")
    b = load_file(run / f"step_{step}" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    la = [r["loss"] for r in step_records(ref)]
    lb = [r["loss"] for r in step_records(run)]
    assert lb == pytest.approx(la, rel=1e-5) and len(lb) == step


def test_the_loop_defers_the_tied_head_gradient(tmp_path):
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import _forward, setup

    run = setup(load_spec(release_spec(tmp_path, "chk", defer=True)))
    embed = run.model.get_input_embeddings().weight
    assert run.model.get_output_embeddings().weight is embed
    run.loader.close()  # the stream is read here directly
    loss_sum, _ = _forward(run, run.loader.stream.next_batch(run.micro_batch), False)
    assert list(run.bound._before) == [n for n, p in run.bound.params.items() if p is embed]
    loss_sum.backward()
    assert run.bound._before == {} and all(p.grad is None for p in run.model.parameters())


def test_auto_defers_the_tied_head_gradient_only_where_memory_is_traded(tmp_path):
    """``defer_head_grad = "auto"`` (the default): deferred with activation checkpointing or tied
    slabs, not without (one head matmul per step saved where the V×D buffer is small)."""
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup

    for name, extra, want in (("plain", "", False), ("ckpt", 'activation_checkpointing = "full"\n', True)):
        path = release_spec(tmp_path, name, defer="auto")
        path.write_text(path.read_text() + extra)
        run = setup(load_spec(path))
        assert run.spec.memory.defer_head_grad == "auto"
        assert run.objective.defers_head_grad(run, run.model.get_input_embeddings().weight) is want


def test_mlp_tiles_and_per_parameter_groups_from_the_spec(tmp_path):
    """``[memory] mlp_tiles`` tiles every decoder MLP and ``release_groups = "parameter"`` gives
    each parameter its own group; the first step's loss is unchanged and the second's equal up
    to summation order (the tiles sum the MLP's weight gradients in another order).
    ``release_groups = "sublayer"`` splits each layer in two groups, with equal losses."""
    from pgs.runtime.loop import control
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.loop.train import setup, train_step

    losses = []
    for tiles, groups in ((0, "layer"), (3, "parameter"), (0, "sublayer")):
        sets = [f"memory.mlp_tiles={tiles}", f'memory.release_groups="{groups}"']
        run = setup(load_spec(release_spec(tmp_path, f"tiles_{tiles}"), sets))
        mlps = [layer.mlp for layer in run.model.model.layers]
        assert all((getattr(m.__dict__.get("forward"), "_pgs_mlp_tiles", 0)) == tiles for m in mlps)
        if groups == "parameter":  # each parameter alone, the small ones together per layer
            from pgs.runtime.optim.release import SMALL_PARAMETER

            sizes = dict((n, p.numel()) for n, p in run.model.named_parameters())
            for g, names in run.bound.groups.items():
                assert len(names) == 1 or (g.endswith("/small") and all(sizes[n] < SMALL_PARAMETER for n in names))
        elif groups == "sublayer":  # two groups per decoder layer
            layered = [g for g in run.bound.groups if ".layers." in g]
            assert layered and all(g.endswith(("/mlp", "/attn")) for g in layered)
            assert len(layered) == 2 * len(run.model.model.layers)
        else:
            assert all(len(names) > 1 for g, names in run.bound.groups.items() if ".layers." in g)
        with control.StopSignals() as signals:
            losses.append([train_step(run, signals, control.WallClock(None))[0]["loss"] for _ in range(2)])
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6)
    assert losses[1][1] == pytest.approx(losses[0][1], rel=1e-5)
    assert losses[2] == losses[0]  # sublayer groups: the same elementwise updates, bit for bit


def test_the_12gib_recipe_from_a_spec_trains_as_the_bound_run(tmp_path):
    """docs/memory.md's recipe (release, sublayer checkpoints with offloaded inputs, the tied
    weight in row slabs, compiled layers) through ``pgs run``'s loop, fp32 AdamW: the same
    losses and weights as the plain bound run, up to summation order and the compiled layers'
    fusion."""
    recipe = ('activation_checkpointing = "sublayer"\noffload_checkpoints = true\ntied_slabs = 64\n'
              'compile_layers = true\n')
    assert _run_in_process(release_spec(tmp_path, "bound_r", release=False, every=0, steps=3)) == 0
    path = release_spec(tmp_path, "recipe", release=True, defer=True, every=0, steps=3)
    path.write_text(path.read_text() + recipe)
    assert _run_in_process(path) == 0
    _assert_close_runs(tmp_path / "bound_r", tmp_path / "recipe", step=3)
