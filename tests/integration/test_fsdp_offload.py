"""``memory.offload_optimizer`` with FSDP2 (``pgs.runtime.optim.sharded_offload``) on 2 gloo ranks.

One 2-rank run of tests/integration/fsdp_release_harness.py's ``offload`` scenario (in the
module's one start of the 2 ranks, tests/integration/runs_harness.py, which then runs the
``pgs run`` test's 2-rank runs; bounded by a timeout) checks, for AdamW
(fp32 state, tied head), AdamW8bit (tied) and Lion8bit (untied head), 10 steps each:

- the weights and every state leaf equal the on-device sharded release's bit for bit (the same
  chain on the same values: the staged views are the state), and the weights equal one process
  (``bind``, the harness's single-process reference) bit for bit: the FSDP2 sum of the two
  ranks' gradients is the one process's accumulation (tests/integration/test_fsdp.py), and the
  8-bit blocks of 64 elements are whole rows of every shard, so each shard's blocks are blocks
  of the whole tensor;
- between steps every travelling leaf lives in the rank's host buffer; each rank holds half of
  the one-process host state (up to the 64-byte alignment of each leaf);
- a DCP checkpoint after 5 steps resumed into a fresh offloaded release, and into an on-device
  sharded release (the same keys), ends at the uninterrupted run's weights and state bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from test_fsdp import H, _logs, finish, results
from test_fsdp_release import R, start


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """One start of 2 ranks (tests/integration/runs_harness.py) shared by this module's CPU tests,
    one step after the other: the harness's ``offload`` scenario, then ``pgs run`` of the offloaded
    spec (``two``, as each worker of ``pgs run --nproc 2`` runs it) and last the same spec
    SIGKILLed after step 5 (``cut``; the kill ends the ranks).  Meanwhile in this process: bind's
    weights and the one-process offloaded release's host bytes, and ``pgs run`` on one process
    (``one``, one thread)."""
    from helpers import end_runs, run_here, start_runs
    from pgs.runtime.loop.faults import Faults
    from pgs.runtime.optim.offload import OffloadedRelease

    folder = tmp_path_factory.mktemp("fsdp_offload")
    out = folder / "ranks"
    one, two, cut = (_offload_spec(folder, n) for n in ("one", "two", "cut"))
    runs = [{"name": "offload", "call": "fsdp_release_harness:offload"},
            {"name": "two", "argv": [str(two)]},
            {"name": "cut", "argv": [str(cut)], "faults": Faults(crash_at=("step", 5)).env()}]
    procs = start_runs(out, runs, 2)
    refs, host = {}, {}
    try:
        for name, entry in R.OFFLOAD_CHAINS.items():
            saved = H.CHAINS.get(name)
            H.CHAINS[name] = entry
            try:
                refs[name] = H.full_params(H.reference(name, R.STEPS)[0])
            finally:
                if saved is None:
                    del H.CHAINS[name]
                else:
                    H.CHAINS[name] = saved
            host[name] = OffloadedRelease(entry[0](), H.tiny_model(entry[1])).offload_stats()["host_state_bytes"]
        one_code = run_here(one)
    finally:
        codes = end_runs(procs, 1200)
    return {"folder": folder, "out": out, "refs": refs, "host": host, "one_code": one_code, "codes": codes}


@pytest.fixture(scope="module")
def offloaded(two_ranks):
    from helpers import run_outcome

    out = two_ranks["out"]
    codes, logs = run_outcome(out, "offload", 2)
    assert codes == [0, 0], logs[-6000:]
    return out, two_ranks["refs"], two_ranks["host"], results(out, "offload")


@pytest.mark.parametrize("name", list(R.OFFLOAD_CHAINS))
def test_offloaded_equals_on_device_sharded_release_and_one_process(offloaded, name):
    out, refs, _, ranks = offloaded
    for r in ranks:
        got = r[name]
        assert got["max_abs_diff"] == 0.0 and got["state_equal"], got
        assert got["state_on_host"] and got["grads_left"] == 0
        assert got["release_steps"] == R.STEPS and got["streamed"] == [got["units"]] * R.STEPS
        assert got["unannounced"] == 0  # units complete in the order learned (reverse layers, root last)
        assert got["d2h_bytes"] == R.STEPS * got["pcie_bytes_per_step"] // 2
        assert got["step_extras"]["offload/fetches"] == got["units"]
    weights = torch.load(out / f"offload_{name}.pt")
    assert max((weights[k] - refs[name][k]).abs().max().item() for k in weights) == 0.0
    initial = H.full_params(H.tiny_model(R.OFFLOAD_CHAINS[name][1]))
    assert max((weights[k] - initial[k]).abs().max().item() for k in weights) > 1e-4  # it trained


@pytest.mark.parametrize("name", list(R.OFFLOAD_CHAINS))
def test_each_rank_holds_half_the_host_state(offloaded, name):
    """Each rank's host state is half of one process's (the numbers: docs/distributed.md), and
    ``pgs profile``'s prediction for 2 ranks (``predict_memory(..., ranks=2)``) is what rank 0
    holds: its host state, its device staging, and every rank's state for a checkpoint."""
    from pgs.runtime.tools.profile import predict_memory

    _, _, host, ranks = offloaded
    factory, tied = R.OFFLOAD_CHAINS[name]
    model = H.tiny_model(tied)
    pred = predict_memory(model.config, model=model, dtype=torch.float32, chain=factory(), gradient_release=True,
                          offload_optimizer=True, micro_batch_tokens=32, ranks=2)
    assert pred["host_state"] == ranks[0][name]["host_state_bytes"]
    assert pred["optimizer_state"] == ranks[0][name]["staging_bytes"]
    assert pred["state_total"] == sum(r[name]["host_state_bytes"] for r in ranks)
    one = predict_memory(model.config, model=model, dtype=torch.float32, chain=factory(), gradient_release=True,
                         offload_optimizer=True, micro_batch_tokens=32)
    assert one["host_state"] == host[name] and "state_total" not in one
    for r in ranks:
        got = r[name]
        # each travelling leaf is padded to 64 bytes in the host buffer, on one process and on each rank
        assert abs(got["host_state_bytes"] - host[name] / 2) <= 64 * got["host_leaves"], (got, host[name])
        assert got["host_state_bytes"] < 0.53 * host[name]
        assert got["staging_bytes"] < got["host_state_bytes"]


def test_dcp_resume_bit_exact_into_offloaded_and_on_device(offloaded):
    _, _, _, ranks = offloaded
    for r in ranks:
        assert r["per_rank_keys"] > 0  # the 8-bit codes and scales of a shard, saved per rank
        assert r["resume_max_abs_diff"] == 0.0 and r["resume_state_equal"]
        assert r["resume_on_device_max_abs_diff"] == 0.0 and r["resume_on_device_state_equal"]


# ----------------------------------------------------------------------------------------
# one GPU: NCCL, FSDP2's reduce-scatter stream, the staging's side streams


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_over_nccl_on_one_gpu_equals_on_device(tmp_path):
    """One rank over NCCL (a group and a mesh of one: the path of several): the offloaded sharded
    release equals the on-device one bit for bit, fp32 and bf16 mixed precision, for every chain
    of the CPU test, with pinned host memory and a DCP resume bit-exact."""
    procs = start("cuda_offload", tmp_path, world=1)
    assert finish(procs, tmp_path) == [0], _logs(tmp_path)
    (r,) = results(tmp_path, "cuda_offload", world=1)
    assert r["backend"] == "nccl" and r["device"].startswith("cuda")
    for name in R.OFFLOAD_CHAINS:
        for mp in ("fp32", "bf16"):
            got = r[f"{name}_{mp}"]
            assert got["max_abs_diff"] == 0.0 and got["state_equal"], (name, mp, got)
            assert got["resume_max_abs_diff"] == 0.0 and got["resume_state_equal"], (name, mp, got)
            assert got["page_locked"] and got["finite"] and got["grads_left"] == 0, (name, mp, got)


# ----------------------------------------------------------------------------------------
# pgs run --nproc 2 with [memory] offload_optimizer = true


def _offload_spec(tmp_path, name: str):
    """tests/integration/test_train_release.py's release spec (AdamW, grad_accum = 1, clip = 0,
    6 steps, a checkpoint every 3, an export) with the state in host memory."""
    from test_train_release import release_spec

    spec = release_spec(tmp_path, name, export="true")
    spec.write_text(spec.read_text() + "offload_optimizer = true\n")
    return spec


def _host_bytes(run_dir) -> tuple[int, int]:
    from helpers import records

    (event,) = [r for r in records(run_dir) if r.get("event") == "offload"]
    return event["host_state_bytes"], event["processes"]


@pytest.mark.slow
def test_pgs_run_two_ranks_offloaded_equals_one_process_and_sigkill_resume_is_exact(two_ranks):
    """``pgs run --nproc 2`` with the state in host memory: the final weights and the losses of
    the same spec on one process (to the tolerance of tests/integration/test_train_distributed.py:
    4 rows in one micro-batch there, 2 on each rank here, so the token sums of a gradient are
    added in another order), each rank holding half the host state; killed (SIGKILL, both ranks,
    after step 5) and resumed with ``--resume auto`` from step 3, it ends with the weights and
    losses of the uninterrupted 2-rank run bit for bit.  The uninterrupted run and the killed one
    run in the module's start of the 2 ranks (``two_ranks``: each rank runs ``pgs run`` as a
    worker of ``pgs run --nproc 2`` does); the resume is ``pgs run --nproc 2`` itself."""
    from helpers import assert_same_weights, final_weights, launch, run_outcome, step_records

    tmp_path, out = two_ranks["folder"], two_ranks["out"]
    assert two_ranks["one_code"] == 0
    codes, log = run_outcome(out, "two", 2)
    assert codes == [0, 0], log[-4000:]
    assert "optimizer state in host memory per process (2 processes, each its own shards)" in log
    assert_same_weights(final_weights(tmp_path / "one"), final_weights(tmp_path / "two"), "1 vs 2 ranks", atol=1e-6)
    la, lb = step_records(tmp_path / "one"), step_records(tmp_path / "two")
    assert [r["step"] for r in lb] == list(range(1, 7))
    for ra, rb in zip(la, lb):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6) and rb["lr"] == ra["lr"]
        assert rb["offload/fetches"] > 0 and rb["offload/unannounced"] == 0
    (host_one, n_one), (host_two, n_two) = _host_bytes(tmp_path / "one"), _host_bytes(tmp_path / "two")
    assert (n_one, n_two) == (1, 2)
    assert 0.47 * host_one < host_two < 0.53 * host_one, (host_one, host_two)

    codes, log = run_outcome(out, "cut", 2)
    assert 0 not in codes and -9 in two_ranks["codes"], (codes, two_ranks["codes"], log[-3000:])  # killed in the run
    cut = tmp_path / "cut.toml"
    assert (tmp_path / "cut" / "step_3" / "COMPLETE").exists() and not (tmp_path / "cut" / "step_6").exists()
    resumed = launch(cut, "auto", timeout=400, args=("--nproc", "2"), PGS_PG_TIMEOUT_S=60)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from" in resumed.stderr and "step_3" in resumed.stderr
    assert_same_weights(final_weights(tmp_path / "two"), final_weights(tmp_path / "cut"), "resumed vs uninterrupted")
    after = [r for r in step_records(tmp_path / "cut") if r["step"] > 3][-3:]
    assert [(r["step"], r["loss"]) for r in after] == [(r["step"], r["loss"]) for r in lb[3:]]
