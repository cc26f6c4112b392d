"""``pgs run --nproc`` over several hosts and the evidence a hang leaves (issue 24, item 9):
torchrun's rendezvous options are handed through as they are (the exact command is checked),
and the workers get NCCL's flight recorder with its dump-on-timeout file inside the run folder
(from the launcher's environment, or set by ``fsdp.init`` itself under a plain torchrun)."""

from __future__ import annotations

import io
import os
import sys

import pytest

from pgs.cli import main
from pgs.runtime.dist import fsdp, launch
from helpers import free_port, tiny_spec

RECORDER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_ENABLE_MONITORING", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


class _Child:
    """What ``subprocess.Popen`` would return for torchrun: it exits 0 at once."""

    def __init__(self, cmd, stderr=None, env=None):
        self.cmd, self.env = cmd, env
        self.stderr = io.BytesIO(b"")

    def wait(self):
        return 0

    def send_signal(self, signum):
        pass


@pytest.fixture
def started(monkeypatch):
    seen: list[_Child] = []

    def popen(cmd, **kwargs):
        seen.append(_Child(cmd, **kwargs))
        return seen[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    for name in RECORDER:
        monkeypatch.delenv(name, raising=False)
    return seen


def test_standalone_command_is_unchanged():
    assert launch.torchrun_command(2, ["run", "s.toml"], grace_s=60, python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--shutdown-timeout=60",
        "-m", "pgs", "run", "s.toml"]


def test_rendezvous_options_replace_standalone():
    rdzv = launch.Rendezvous(nnodes="2", node_rank=1, master_addr="node0", master_port=29400)
    assert launch.torchrun_command(4, ["run", "s.toml"], grace_s=5, python="py", rendezvous=rdzv) == [
        "py", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1", "--master-addr=node0",
        "--master-port=29400", "--nproc-per-node=4", "--shutdown-timeout=5", "-m", "pgs", "run", "s.toml"]


def test_pgs_run_hands_the_rendezvous_to_torchrun(tmp_path, started, monkeypatch):
    monkeypatch.setenv(launch.GRACE_ENV, "77")
    spec = tiny_spec(tmp_path)
    code = main(["run", str(spec), "--nproc", "2", "--nnodes", "2:4", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "head:29500", "--rdzv-id", "job42", "--set", "train.steps=3"])
    assert code == 0 and len(started) == 1
    env, run_dir = started[0].env, tmp_path / "run"
    # torchrun's logs go inside the launcher's exit-code folder, which it removes at the end
    logs = f"--log-dir={os.path.join(env[launch.EXIT_DIR_ENV], 'torchrun')}"
    assert started[0].cmd == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--rdzv-endpoint=head:29500",
        "--rdzv-id=job42", "--rdzv-backend=c10d", "--nproc-per-node=2", "--shutdown-timeout=77", logs,
        "-m", "pgs", "run", str(spec), "--set", "train.steps=3"]
    assert env["TORCH_FR_BUFFER_SIZE"] == str(fsdp.TRACE_BUFFER_SIZE)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    prefix = str(run_dir / "nccl_trace" / "rank_")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    # only the current names: torch warns on every rank about the deprecated ones
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    assert (run_dir / "nccl_trace").is_dir()  # the recorder writes files, not their folder


def test_a_single_host_run_also_gets_the_recorder(tmp_path, started, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own setting wins
    assert main(["run", str(tiny_spec(tmp_path)), "--nproc", "2"]) == 0
    cmd, env = started[0].cmd, started[0].env
    assert "--standalone" in cmd and not any(c.startswith("--nnodes") for c in cmd)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in env
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl_trace" / "rank_")


def test_only_the_first_host_refuses_an_existing_run(tmp_path, started):
    spec = tiny_spec(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # host 0 started the shared folder already
    assert main(["run", str(spec), "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                 "--master-port", "1234"]) == 0
    assert main(["run", str(spec), "--nnodes", "2", "--node-rank", "0", "--master-addr", "h",
                 "--master-port", "1234"]) == 2
    assert len(started) == 1


@pytest.mark.parametrize("argv, field", [(["--nnodes", "0"], "--nnodes"), (["--nnodes", "two"], "--nnodes"),
                                        (["--node-rank", "-1"], "--node-rank"),
                                        (["--master-port", "70000"], "--master-port")])
def test_bad_rendezvous_options_are_one_line(tmp_path, started, capsys, argv, field):
    assert main(["run", str(tiny_spec(tmp_path)), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and not started


def test_the_world_size_counts_every_host(tmp_path, started, capsys):
    """batch_size 4 with grad_accum 2 splits over 2 processes, not over 2 hosts x 2."""
    assert main(["run", str(tiny_spec(tmp_path)), "--nproc", "2", "--nnodes", "2", "--node-rank", "0",
                 "--master-addr", "h", "--master-port", "1"]) == 2
    assert "4 processes" in capsys.readouterr().err and not started


def test_init_sets_the_recorder_under_a_plain_torchrun(tmp_path, monkeypatch):
    """A worker started by torchrun directly (no ``pgs run --nproc``): ``fsdp.init`` sets the
    recorder's settings the environment lacks before the group opens."""
    for name in RECORDER:
        monkeypatch.delenv(name, raising=False)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    try:
        ctx = fsdp.init(device="cpu", single=True, trace_dir=str(tmp_path / "run"))
        assert ctx.backend == "gloo"
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl_trace" / "rank_")
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and (tmp_path / "run" / "nccl_trace").is_dir()
    finally:
        fsdp.shutdown()


def test_a_memory_option_that_cannot_run_sharded_is_refused_before_launch(tmp_path, started, capsys):
    """``pgs run --nproc 2`` with ``memory.tied_slabs`` (FSDP2 reduce-scatters the embedding's whole
    gradient, so row slabs cannot avoid it): one line naming it and why, exit 2, and no process
    started (each rank would otherwise build the model first).  ``memory.offload_optimizer`` runs
    on several processes (tests/integration/test_fsdp_offload.py)."""
    argv = ["run", str(tiny_spec(tmp_path)), "--nproc", "2", "--set", "memory.gradient_release=true",
            "--set", "train.grad_accum=1", "--set", "optimizer.clip=0", "--set", "memory.tied_slabs=8"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory.tied_slabs" in err[0] and "reduce-scatter" in err[0] and not started


@pytest.mark.parametrize("recorded, torchrun_code, verdict", [
    ((143, 143), 1, 143),  # stopped by a signal another host got: torchrun says 1, the workers 143
    ((84, 1), 1, 84),      # one worker's full disk, the other's collective failing after it
    ((1, 1), 1, 1),
    ((), 1, 1),            # killed before recording anything: torchrun's code
    ((0, 0), 0, 0),
])
def test_a_host_returns_the_code_its_workers_recorded(tmp_path, monkeypatch, recorded, torchrun_code, verdict):
    folders = []

    def popen(cmd, stderr=None, env=None):
        child = _Child(cmd, stderr, env)
        folders.append(env[launch.EXIT_DIR_ENV])
        monkeypatch.setenv(launch.EXIT_DIR_ENV, folders[-1])
        for rank, code in enumerate(recorded):  # what `python -m pgs` does in each worker as it exits
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            launch.record_exit(code)
        child.wait = lambda: torchrun_code
        return child

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    spec = tiny_spec(tmp_path)
    assert main(["run", str(spec), "--nnodes", "2", "--node-rank", "1", "--master-addr", "h"]) == verdict
    assert len(folders) == 1 and not os.path.exists(folders[0])  # the launcher removes its folder


def test_record_exit_outside_a_launch_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.EXIT_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    launch.record_exit(143)
    assert not any(tmp_path.iterdir())
    assert launch.workers_code(str(tmp_path / "absent")) is None
