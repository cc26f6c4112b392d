"""Gradient release per FSDP2 unit (``pgs.runtime.optim.sharded_release``) on 2 gloo ranks (CPU).

One 2-rank run (tests/integration/fsdp_release_harness.py, ranks started with torchrun's
environment by tests/integration/test_fsdp.py's ``start``/``finish``, bounded by a timeout so that a
hang fails) checks everything that needs processes: for AdamW (tied head), Lion (untied),
per-tensor clipping + AdamW (``reduce_sum`` inside the hooks) and Muon (``whole_tensors``
gathers/scatters inside the hooks), 10 steps with release against 10 steps of
``bind_sharded`` on the same ranks, plus a DCP save/resume of the release state.

Tolerance: exact.  The hooks see the same reduce-scattered gradient tensors that
``ShardedBoundOptimizer.step`` would read, and the chain's arithmetic per element is the
same (elementwise stages; per-tensor norms all-reduce the same shard sums; Muon gathers the
same whole matrices, and Newton–Schulz maps each independently), so the weights are equal
bit for bit; tests/integration/test_fsdp.py already pins the sharded run to one process bit for bit
(AdamW, Lion), so release on 2 ranks equals one process too (checked here for AdamW and
Lion against the harness's single-process reference).  Only the logged gradient norm is
summed in another order (per unit, then across units): 1e-6 relative.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument

from helpers import free_port
from test_fsdp import H, _logs, finish, results

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "fsdp_release_harness.py"


def _release_harness():
    spec = importlib.util.spec_from_file_location("pgs_test_fsdp_release_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


R = _release_harness()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def start(scenario: str, out: Path, world: int = 2) -> list[subprocess.Popen]:
    """One process per rank of the release harness, with the environment torchrun would give."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PGS_PG_TIMEOUT_S="60",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        log = open(out / f"log_{scenario}_rank{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, str(HARNESS), scenario, str(out)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parents[1])))
    return procs


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_release")
    procs = start("release", out)
    # the single-process references run meanwhile (the harness uses H.CHAINS' adamw and lion)
    refs = {name: H.full_params(H.reference(name, R.STEPS)[0]) for name in ("adamw", "lion")}
    codes = finish(procs, out)
    assert codes == [0, 0], _logs(out)
    return out, refs, results(out, "release")


@pytest.mark.parametrize("name", list(R.CHAINS))
def test_release_equals_sharded_bind_exactly(released, name):
    _, _, ranks = released
    for r in ranks:
        got = r[name]
        assert got["max_abs_diff"] == 0.0
        assert got["grads_left"] == 0  # every sharded gradient was freed inside backward
        assert got["release_steps"] == R.STEPS and got["counts"] == [R.STEPS]
        # every unit (2 layers + root) stepped from its hook, none at the end of backward;
        # with an unused parameter, its unit (layer 0) steps when backward ends
        streamed = got["units"] - 1 if name.endswith("_unused") else got["units"]
        assert got["units"] == 3 and got["streamed"] == [streamed] * R.STEPS
        assert got["grad_norm_rel"] <= 1e-6


def test_release_with_checkpointed_layers_equals_without(released):
    """Sublayer checkpoints with offloaded inputs (the recompute's nested backward) under
    sharded gradient release: the weights of the run without checkpointing, bit for bit."""
    out, _, _ = released
    assert _max_diff(torch.load(out / "release_adamw_ckpt.pt"), torch.load(out / "release_adamw.pt")) == 0.0


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_release_on_two_ranks_equals_one_process(released, name):
    out, refs, _ = released
    got = torch.load(out / f"release_{name}.pt")
    assert _max_diff(got, refs[name]) == 0.0
    assert _max_diff(got, H.full_params(H.tiny_model(R.CHAINS[name][1]))) > 1e-3  # it trained


def test_release_dcp_resume_bit_exact(released):
    _, _, ranks = released
    for r in ranks:
        assert r["resume_max_abs_diff"] == 0.0


# ----------------------------------------------------------------------------------------
# one GPU: NCCL and CUDA streams (one rank; several GPUs belong to issue 28's device kind)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_over_nccl_on_one_gpu_equals_sharded_bind(tmp_path):
    """FSDP2 over NCCL on one rank (the same path as with several: a group and a mesh of one),
    fp32 and bf16 mixed precision: release equals ``bind_sharded`` bit for bit, every sharded
    gradient freed inside backward, every unit stepped from its hook, a DCP resume bit-exact."""
    procs = start("cuda", tmp_path, world=1)
    assert finish(procs, tmp_path) == [0], _logs(tmp_path)
    (r,) = results(tmp_path, "cuda", world=1)
    assert r["backend"] == "nccl" and r["device"].startswith("cuda")
    for key in ("adamw_fp32", "adamw_bf16", "lion_fp32", "lion_bf16"):
        got = r[key]
        assert got["max_abs_diff"] == 0.0 and got["resume_max_abs_diff"] == 0.0, (key, got)
        assert got["finite"] and got["moved"] > 1e-3, (key, got)  # it trained
        assert got["grads_left"] == 0 and got["streamed"] == [got["units"]] * R.STEPS, (key, got)


# ----------------------------------------------------------------------------------------
# no processes


def test_global_transform_is_refused_with_the_reason():
    from pgs.runtime.optim.sharded_release import ShardedGradientRelease

    model = H.tiny_model(True)
    chain = pf.chain(pf.clip_by_global_norm(1.0), pf.adamw(1e-3))
    with pytest.raises(InvalidArgument, match=r"clip_by_global_norm.*global.*unknown while backward"):
        ShardedGradientRelease(chain, model)
    with pytest.raises(InvalidArgument, match="grad_accum=2"):
        ShardedGradientRelease(pf.adamw(1e-3), model, grad_accum=2)
    with pytest.raises(InvalidArgument, match="not sharded"):
        ShardedGradientRelease(pf.adamw(1e-3), model)


# ----------------------------------------------------------------------------------------
# pgs run under torchrun with [memory] gradient_release = true


def test_pgs_run_two_ranks_with_release_equals_without(tmp_path):
    """Two torchrun launches of tests/helpers.py's tiny spec (2 ranks, grad_accum = 1,
    clip = 0, AdamW), with and without gradient release, started together: the same final
    weights bit for bit, the same losses, and the release run logs lr and grad_norm."""
    from safetensors.torch import load_file

    from helpers import ROOT, child_env, step_records
    from test_train_distributed import STEPS, TIMEOUT_S, spec_for

    procs = {}
    for name, release in (("bound", "false"), ("released", "true")):
        path = spec_for(tmp_path, name, ranks=2)
        text = path.read_text().replace('alias = "adamw"', 'alias = "adamw"\nclip = 0')
        path.write_text(text + f"\n[memory]\ngradient_release = {release}\n")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "pgs", "run", str(path)]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=child_env(PGS_PG_TIMEOUT_S=60), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    logs = {}
    try:
        for name, p in procs.items():
            logs[name] = p.communicate(timeout=TIMEOUT_S)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}:\n{logs[name][-4000:]}"
    a = load_file(tmp_path / "bound" / "final" / "model.safetensors")
    b = load_file(tmp_path / "released" / "final" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |diff| {(a[k] - b[k]).abs().max().item():.3g}"
    la, lb = step_records(tmp_path / "bound"), step_records(tmp_path / "released")
    assert [r["step"] for r in lb] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    for ra, rb in zip(la, lb):
        assert rb["lr"] == ra["lr"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5)
