"""Two "hosts" on one machine (issue 28, item 3): two ``pgs run --nproc 1 --nnodes 2 --node-rank R``
launchers, one per host, meet through torchrun's rendezvous and train one run together (FSDP2,
gloo on the CPU), as two machines would with ``srun`` (docs/distributed.md, "Several hosts").

- The static rendezvous (``--master-addr/--master-port``): SIGTERM to host 1's launcher only.  It
  passes the signal on to its worker; the control plane stops both ranks at the same step with one
  complete checkpoint; both launchers return 143: host 0's launcher got no signal and its torchrun
  reports 1, and it returns the 143 its worker recorded (``launch.record_exit``).
- torchrun's c10d rendezvous (``--rdzv-backend c10d --rdzv-endpoint``): ``--resume auto`` on both
  hosts trains the run to the end, each step logged once (rank 0's log), both launchers exit 0,
  and it ends at the uninterrupted two-rank run's weights, bit for bit.

The uninterrupted run is the reference only: its 2 ranks are started with the environment each
host's torchrun gives its worker (tests/integration/runs_harness.py), without the launchers.
Every launch is bounded by a timeout and the process-group timeout is short (a hang fails).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from pgs.runtime.loop.faults import Faults
from helpers import (ROOT, assert_same_weights, child_env, command, end_runs, final_weights, free_port, run_outcome,
                     start_runs, step_records, stopped_checkpoint, tiny_spec, wait_for_file)

TIMEOUT_S = 240
STEPS = 10


def two_host_spec(tmp_path: Path, name: str) -> Path:
    path = tiny_spec(tmp_path, name, steps=STEPS, every=0, export="true")
    path.write_text(path.read_text().replace("grad_accum = 2", "grad_accum = 1"))
    return path


def start_hosts(spec: Path, rendezvous: str, resume: str | None = None, **env) -> list[subprocess.Popen]:
    """One ``pgs run`` launcher per "host", each with one worker, meeting at a free local port."""
    port = free_port()
    procs = []
    for node in range(2):
        args = ["--nproc", "1", "--nnodes", "2", "--node-rank", str(node)]
        if rendezvous == "c10d":
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", spec.stem]
        else:
            args += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        procs.append(subprocess.Popen(command(spec, resume, tuple(args)), cwd=ROOT, env=child_env(PGS_PG_TIMEOUT_S=60, **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_two_hosts_train_stop_together_on_one_hosts_signal_and_resume_exactly(tmp_path):
    # 0. The uninterrupted run on 2 ranks (the reference of step 2).
    whole = two_host_spec(tmp_path, "whole")
    ranks = end_runs(start_runs(tmp_path / "ranks", [{"name": "whole", "argv": [str(whole)]}], 2), TIMEOUT_S)
    codes, logs = run_outcome(tmp_path / "ranks", "whole", 2)
    assert codes == [0, 0] and ranks == [0, 0], logs[-3000:]
    assert [r["step"] for r in step_records(tmp_path / "whole")] == list(range(1, STEPS + 1))
    assert json.loads((tmp_path / "whole" / f"step_{STEPS}" / "dcp.json").read_text())["world_size"] == 2

    # 1. Static rendezvous; SIGTERM to host 1's launcher only: both hosts stop at one step, exit 143.
    stopped = two_host_spec(tmp_path, "stopped")
    run_dir = tmp_path / "stopped"
    gate = tmp_path / "gate"  # the workers hold after step 2 until the signal has reached host 1's
    gate.mkdir()
    procs = start_hosts(stopped, "static", **Faults(pause_at=(2, str(gate))).env())
    try:
        wait_for_file(gate / "paused", procs, TIMEOUT_S)
        procs[1].send_signal(signal.SIGTERM)
        wait_for_file(gate / "signalled", procs, TIMEOUT_S)
        (gate / "go").write_text("")
    finally:
        outs = finish(procs)
    assert [p.returncode for p in procs] == [143, 143], [o[1][-3000:] for o in outs]
    folder = stopped_checkpoint(run_dir, 2, STEPS, world_size=2)
    assert not (run_dir / "HALT.json").exists()

    # 2. c10d rendezvous, --resume auto on both hosts: the run trains to the end, each step logged
    # once, both launchers exit 0, and it ends at the uninterrupted run's weights, bit for bit.
    procs = start_hosts(stopped, "c10d", resume="auto")
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    # c10d gives the global ranks in the order the hosts join: rank 0, which says it, is on either host
    assert any(f"resumed from {folder}" in err for _, err in outs), [o[1][-2000:] for o in outs]
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(run_dir), "resumed vs uninterrupted")
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, STEPS + 1))
    assert json.loads((run_dir / f"step_{STEPS}" / "dcp.json").read_text())["world_size"] == 2
