"""FSDP2 on the CPU with 2 gloo ranks: the global batch, sharded chains, DCP, the control plane.

Each 2-rank run is two processes started with torchrun's environment
(tests/integration/fsdp_harness.py), bounded by a timeout: a hang fails the test instead of
blocking CI (the process group timeout is also short, PGS_PG_TIMEOUT_S=60).  Three runs in
all (gloo startup and imports cost seconds each; the activation checkpointing scenario runs in
the first run's process group, after the equivalence scenario); each run checks several things.

Why exact equality is expected: the single-process reference accumulates the same row
blocks as micro-batches (rank 0's, then rank 1's), each divided by the same global token
count.  The sharded run computes the same per-block gradients, and FSDP sums two of them:
``a + b == b + a`` exactly in IEEE arithmetic, the all-gather and the reduce-scatter move
bits without changing them, and elementwise optimizer stages compute the same values on a
shard as on the whole tensor.  Per-tensor reductions (norms) sum in a different order on
shards, so they agree to rounding (checked at 1e-6 relative; a clip by the global norm at
1e-6 absolute on the weights after 20 steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pgs.func as pf
from helpers import free_port

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "fsdp_harness.py"
RUN_TIMEOUT_S = 150


def _harness():
    spec = importlib.util.spec_from_file_location("pgs_test_fsdp_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _harness()


def start(scenario: str, out: Path, world: int = 2) -> list[subprocess.Popen]:
    """One process per rank, with the environment torchrun would give."""
    out.mkdir(parents=True, exist_ok=True)
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


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = RUN_TIMEOUT_S) -> list[int]:
    """Exit codes of the ranks; kills them (each by its own pid) and fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    if any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pytest.fail(f"ranks did not finish within {timeout:.0f} s (hang?); logs in {out}\n{_logs(out)}")
    return [p.returncode for p in procs]


def _logs(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("log_*.txt")))


def results(out: Path, scenario: str, world: int = 2) -> list[dict]:
    return [json.loads((out / f"result_{scenario}_rank{r}.json").read_text()) for r in range(world)]


def _equal(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----------------------------------------------------------------------------------------
# run 1: equivalence with a single process, sharded norms, DCP, export


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_equivalence")
    procs = start("equivalence+checkpointing", out)
    # the single-process references run meanwhile
    refs = {name: H.full_params(H.reference(name, H.STEPS)[0]) for name in H.CHAINS}
    codes = finish(procs, out)
    assert codes == [0, 0], _logs(out)
    return out, refs, results(out, "equivalence")


@pytest.mark.parametrize("name", ["adamw", "lion", "matrix"])
def test_two_ranks_equal_one_process_exactly(equivalence, name):
    out, refs, _ = equivalence
    sharded = torch.load(out / f"{name}.pt")
    assert _equal(sharded, refs[name]) == 0.0
    moved = _equal(sharded, H.full_params(H.tiny_model(H.CHAINS[name][1])))
    assert moved > 1e-3  # the run trained


def test_global_norm_clip_equal_to_rounding(equivalence):
    out, refs, _ = equivalence
    assert _equal(torch.load(out / "adamw_clip.pt"), refs["adamw_clip"]) <= 1e-6


def test_muon_on_whole_matrices_under_sharding(equivalence):
    """pf.muon on shards (owner-rank Newton-Schulz of each whole matrix, round-robin) equals one
    process up to batched-matmul rounding (the owner batches fewer matrices per shape)."""
    out, refs, _ = equivalence
    sharded = torch.load(out / "muon.pt")
    assert _equal(sharded, refs["muon"]) <= 1e-5
    assert _equal(sharded, H.full_params(H.tiny_model(H.CHAINS["muon"][1]))) > 1e-3


def test_hyperball_and_adagc_under_sharding(equivalence):
    """adagc → adam → hyperball on shards: the same weights as one process (to all-reduce
    rounding: shard sums are added in another order), and every matrix keeps its initial norm R."""
    out, refs, _ = equivalence
    sharded = torch.load(out / "hyperball.pt")
    assert _equal(sharded, refs["hyperball"]) <= 1e-5
    init = H.full_params(H.tiny_model(H.CHAINS["hyperball"][1]))
    for name, w in sharded.items():
        if w.ndim >= 2:
            r0, r1 = init[name].norm().item(), w.norm().item()
            assert abs(r1 - r0) <= 1e-5 * r0, (name, r0, r1)
    assert _equal(sharded, init) > 1e-3  # it trained


def test_sharded_per_tensor_norms(equivalence):
    _, _, (r0, r1) = equivalence
    for r in (r0, r1):
        assert r["sumsq_max_rel_diff"] <= 1e-6
        assert r["dot_max_rel_diff"] <= 1e-6
        assert r["global_norm_rel_diff"] <= 1e-6


def test_dcp_resume_bit_exact(equivalence):
    _, _, (r0, r1) = equivalence
    for r in (r0, r1):
        assert r["resume_max_abs_diff"] == 0.0
        assert r["resume_state_equal"]


def test_dcp_reshard_two_ranks_to_one_process(equivalence):
    """The step-10 checkpoint of 2 ranks, loaded by one process, trains on to the same bits."""
    from pgs.runtime.store import dcp
    from pgs.runtime.optim.bound import bind

    out, refs, _ = equivalence
    model = H.tiny_model(True)
    opt = bind(H.CHAINS["adamw"][0](), model)
    trainer = dcp.load(str(out / "adamw" / "step_10"), model=model, optimizer=opt)
    assert trainer["next_step"] == 11
    model, _ = H.reference("adamw", H.STEPS - 10, start=(model, opt, 11))
    assert _equal(H.full_params(model), torch.load(out / "adamw.pt")) == 0.0


def test_hf_export_gathered_to_rank0(equivalence):
    from transformers import AutoModelForCausalLM

    out, _, _ = equivalence
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "hf"), local_files_only=True)
    want = torch.load(out / "adamw.pt")
    got = dict(loaded.named_parameters())
    assert _equal({k: got[k].detach() for k in want}, want) == 0.0


def test_hf_export_sharded_from_fsdp(equivalence):
    import json

    from transformers import AutoModelForCausalLM

    out, _, _ = equivalence
    folder = out / "hf_sharded"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((folder / f).exists() for f in files)
    assert not (folder / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    want = torch.load(out / "adamw.pt")
    got = dict(loaded.named_parameters())
    assert _equal({k: got[k].detach() for k in want}, want) == 0.0


def test_8bit_state_is_per_rank_and_refuses_resharding(equivalence):
    from pgs.runtime.store import dcp
    from pgs.runtime.optim.bound import bind
    from pgs.runtime.store.checkpoint import CheckpointError

    out, _, (r0, r1) = equivalence
    for r in (r0, r1):
        assert r["lion8bit_per_rank_keys"] > 0
        assert r["lion8bit_state_equal"]
    model = H.tiny_model(True)
    with pytest.raises(CheckpointError, match="--nproc 2"):
        dcp.load(str(out / "lion8bit" / "step_2"), model=model, optimizer=bind(pf.lion8bit(1e-3, block_size=64, min_8bit_size=64), model))


# ----------------------------------------------------------------------------------------
# runs 2 and 3: the control plane


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """SIGTERM to rank 1 only, once both ranks are past step 3."""
    out = tmp_path_factory.mktemp("fsdp_control")
    procs = start("signal", out)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    progress = [out / f"progress_rank{r}" for r in range(2)]
    while time.monotonic() < deadline:
        try:
            if all(int(p.read_text() or 0) >= 3 for p in progress):
                break
        except (OSError, ValueError):
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    codes = finish(procs, out)
    return out, codes, results(out, "signal")


def test_sigterm_to_one_rank_stops_both_at_one_step(stopped):
    from pgs.runtime.store import dcp

    out, codes, (r0, r1) = stopped
    assert codes == [143, 143], _logs(out)
    assert r0["kind"] == r1["kind"] == "stop"
    assert r0["step"] == r1["step"] >= 3
    assert (r0["received"], r1["received"]) == (0, signal.SIGTERM)
    folder = out / f"step_{r0['step']}"
    assert dcp.problem(str(folder)) is None
    assert dcp.info(str(folder))["world_size"] == 2


def test_nan_on_one_rank_halts_both(stopped):
    out, _, (s0, _) = stopped
    procs = start("nan", out)
    codes = finish(procs, out)
    assert codes == [81, 81], _logs(out)
    r0, r1 = results(out, "nan")
    assert r0["kind"] == r1["kind"] == "halt"
    halt = json.loads((out / "HALT.json").read_text())
    assert halt["exit_code"] == 81
    # resumed after the stop; step first is clean, then 3 NaN steps (cap: 2 in a row)
    assert halt["step"] == s0["step"] + 1 + 3
    assert r0["message"] == r1["message"]


# ----------------------------------------------------------------------------------------
# no processes


def test_unaware_transforms_are_named():
    from pgs.runtime.optim.sharded_bind import unaware_transforms

    assert unaware_transforms(pf.adamw(1e-3)) == []
    assert unaware_transforms(pf.chain(pf.clip_by_global_norm(1.0), pf.lion(1e-4))) == []
    assert unaware_transforms(pf.adamh(1e-2)) == []  # hyperball forwards reduce_sum
    assert unaware_transforms(pf.muon(1e-3)) == []  # Newton-Schulz on whole matrices via whole_tensors
    assert unaware_transforms(pf.chain(pf.scale_by_sage(), pf.scale_by_learning_rate(1e-3))) == ["scale_by_sage (matrix)"]
    assert unaware_transforms(pf.chain(pf.scale_by_sage(), pf.scale_by_learning_rate(1e-3)), trust=("scale_by_sage",)) == []


def test_reduce_hook_is_applied_once_per_tree():
    calls = []

    def hook(tree):
        calls.append(len(pf.tree.leaves(tree)))
        return pf.tree_map(lambda x: 2 * x, tree)

    tree = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    sq = pf.per_tensor_sumsq(tree, reduce_sum=hook)
    assert (float(sq["a"]), float(sq["b"])) == (6.0, 8.0) and calls == [2]
    assert float(pf.global_norm(tree, None, hook)) == pytest.approx(14 ** 0.5)
    assert float(pf.per_tensor_dot(tree, tree, reduce_sum=hook)["a"]) == 6.0
    assert pf.per_tensor_sumsq(tree)["a"].item() == 3.0  # no hook: unchanged


def test_launch_command_and_timeout(monkeypatch):
    from pgs.runtime.dist import fsdp as distributed
    from pgs.runtime.dist import launch

    cmd = launch.torchrun_command(2, ["run", "spec.toml"], grace_s=60, python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "--shutdown-timeout=60", "-m", "pgs", "run", "spec.toml"]
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "42")
    assert distributed.timeout_seconds() == 42.0
    assert distributed.timeout_seconds(7) == 7.0
    monkeypatch.setenv("WORLD_SIZE", "1")
    ctx = distributed.init()
    assert (ctx.world_size, ctx.mesh, ctx.distributed) == (1, None, False)


# ----------------------------------------------------------------------------------------
# run 1 again: activation checkpointing under FSDP2


def test_checkpointed_layers_under_fsdp_train_as_unchecked(equivalence):
    """Full checkpointing (the recompute path and torch.utils.checkpoint) and sublayer
    checkpointing with offloaded inputs, applied before ``fully_shard`` as ``train.setup``
    does: the same weights after 3 AdamW steps on 2 ranks as without checkpointing, bit for
    bit (the recompute's nested backward runs FSDP2's unshard and reduce-scatter hooks).
    The ranks' exit codes are the ``equivalence`` fixture's (0, 0)."""
    out = equivalence[0]
    assert [r["world"] for r in results(out, "checkpointing")] == [2, 2]
    ref = torch.load(out / "ckpt_none.pt")
    assert _equal(ref, H.full_params(H.tiny_model(True))) > 1e-4  # the run trained
    for mode in H.CHECKPOINT_MODES:
        if mode != "none":
            assert _equal(torch.load(out / f"ckpt_{mode}.pt"), ref) == 0.0, mode
