"""The rank side of one start of several processes shared by several ``pgs run``s, one after the other.

Not a test module: ``helpers.start_runs`` starts it once per rank, with the environment torchrun
would give (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR), as
``python tests/integration/runs_harness.py PLAN``.  ``PLAN`` is a JSON file:
``{"out": FOLDER, "runs": [{"name", "argv", "faults"}, ...]}``.

Each run is what a worker of ``pgs run --nproc N`` does (``pgs.cli.main(["run", ...])`` with
``LOCAL_RANK`` set): its own process group, opened on a port rank 0 takes when the run starts and
closed at its end (a fresh rendezvous, as a fresh start would open), ``$PGS_FAULTS`` as
``faults`` gives it (none: unset), this rank's stdout and stderr into
``FOLDER/<name>_rank<r>.log`` and its exit code into ``FOLDER/<name>_rank<r>.code``.  What it
saves: the interpreter, torch, transformers and the data worker's fork server start once per rank
instead of once per run.  A run whose fault SIGKILLs the process (``Faults.crash_at``) must be
the last one.

An entry ``{"name", "call": "module:function"}`` instead runs ``function(FOLDER)`` (a rank-side
scenario such as tests/integration/generate_harness.py's ``main``), its output and outcome kept
the same way (code 0).  An entry that raises gets code 1, its traceback in its log, and ends the
plan (the process exits 1).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: How long a rank waits for rank 0 to reach a run (rank 0 may still be writing the run before's
#: last checkpoint or export).
PORT_WAIT_S = 600


def _into(path: Path) -> tuple[int, int]:
    """Point file descriptors 1 and 2 at ``path``; returns copies of the previous ones."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def _port(name: str, out: Path, rank: int) -> str:
    """This run's rendezvous port: rank 0 takes a free one when the run starts (a port chosen
    minutes ahead may be taken by then) and writes it to ``FOLDER/<name>.port``; the others wait
    for that file (every rank ends the run before, together)."""
    path = out / f"{name}.port"
    if rank == 0:
        from helpers import free_port

        port = str(free_port())
        path.with_suffix(".tmp").write_text(port)
        os.replace(path.with_suffix(".tmp"), path)
        return port
    deadline = time.monotonic() + PORT_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} from rank 0 after {PORT_WAIT_S} s")
        time.sleep(0.05)
    return path.read_text()


def _one(entry: dict, out: Path) -> int:
    os.environ["MASTER_PORT"] = _port(entry["name"], out, int(os.environ["RANK"]))
    if "call" in entry:
        module, function = entry["call"].split(":")
        getattr(importlib.import_module(module), function)(out)
        return 0
    from pgs.cli import main

    os.environ.pop("PGS_FAULTS", None)
    os.environ.update(entry.get("faults") or {})
    return main(["run", *entry["argv"]])


def run_plan(plan: dict) -> int:
    """Every entry of ``plan`` in order; 0, or 1 after an entry raised (its traceback in its log,
    code 1, and the entries after it not run: its collectives may have left the peers anywhere)."""
    out, rank = Path(plan["out"]), int(os.environ["RANK"])
    for entry in plan["runs"]:
        name = entry["name"]
        saved = _into(out / f"{name}_rank{rank}.log")
        try:
            code = _one(entry, out)
        except BaseException:  # noqa: BLE001 - reported where the test reads this entry's outcome
            traceback.print_exc()
            code = None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        (out / f"{name}_rank{rank}.code").write_text(str(1 if code is None else code))
        if code is None:
            return 1
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]  # generate_harness, helpers and tiny, as in the tests
    from pgs.cli import leave

    # as a worker of pgs run --nproc leaves (no C++ static destructors, its temp folder removed)
    leave(run_plan(json.loads(Path(sys.argv[1]).read_text())))
