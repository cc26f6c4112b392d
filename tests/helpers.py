"""What the test modules share (``from helpers import ...``; tests/conftest.py puts this folder on
``sys.path``): a tiny random-init model's spec tables (its ``[model.config]``: tests/tiny.py), a spec written into a temporary folder,
``pgs run`` as a child process (one process or two ranks under torchrun) or in this process, several
``pgs run``s in one start of N ranks (tests/integration/runs_harness.py), a run's metrics
records, checkpoint equality, and the one ``pgs: error:`` line of a refused command."""

from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from tiny import tiny_table

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "pgs" / "assets" / "quickstart"



def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def config_toml(**changes) -> str:
    """The ``[model.config]`` table of ``tiny_table(**changes)`` (tests/tiny.py)."""
    return "[model.config]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in tiny_table(**changes).items())


def inline_table(table: dict) -> str:
    """``table`` as a TOML inline table, ``{ key = value, ... }``."""
    return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in table.items()) + " }"


def model_toml(tokenizer: str = "pgs:quickstart/tokenizer", init_seed: int | None = 3, **changes) -> str:
    """The ``[model]`` table of a tiny random-init model: the tokenizer, ``init_seed`` (None: left
    out) and ``config_toml(**changes)``."""
    seed = "" if init_seed is None else f"init_seed = {init_seed}\n"
    return f"[model]\ntokenizer = {_toml_value(str(tokenizer))}\n{seed}\n" + config_toml(**changes)


def write_toml(path: Path, template: str, **fields) -> Path:
    """Write ``template.format(**fields)`` to ``path`` (UTF-8); returns ``path``."""
    path.write_text(template.format(**fields), encoding="utf-8")
    return path


def quickstart_head(name: str, lines: int, path: Path) -> Path:
    """The first ``lines`` records of the quickstart's ``name`` (e.g. ``train.jsonl``) in ``path``."""
    path.write_text("\n".join((QUICKSTART / name).read_text().splitlines()[:lines]) + "\n")
    return path


#: The run tables of a short CPU run, 4 rows a step (AdamW, ``train.seed = 7``, no best metric);
#: ``loop_fields`` gives its fields.
LOOP = """
[optimizer]
alias = "adamw"
args = {{ weight_decay = {weight_decay} }}

[schedule]
{schedule}

[train]
steps = {steps}
batch_size = 4
grad_accum = {grad_accum}
seed = 7
eval_every = {eval_every}
log_every = 1000
{train_extra}
[checkpoint]
dir = "{run_dir}"
every = {every}
keep = {keep}
best_metric = ""
export = {export}
"""


def loop_fields(**changes) -> dict:
    """``LOOP``'s fields: no weight decay, a constant 3e-3, 2 micro-batches a step, no eval, no
    periodic checkpoint, no export; ``changes`` (``steps`` and ``run_dir`` among them) on top."""
    return {"weight_decay": 0.0, "schedule": 'name = "constant"\npeak = 3e-3', "grad_accum": 2, "eval_every": 0,
            "train_extra": "", "every": 0, "keep": 0, "export": "false", **changes}


#: A tiny SFT run on the quickstart data: ``tiny_spec`` fills it.
TINY_SPEC = model_toml() + """
[data]
sources = [{{ path = "pgs:quickstart/train.jsonl" }}]
eval = "pgs:quickstart/eval.jsonl"
max_seq_len = 96
seed = 1
""" + LOOP


def tiny_spec(tmp_path: Path, name: str = "run", **overrides) -> Path:
    """Write a tiny spec into ``tmp_path/name.toml``; its run folder is ``tmp_path/name``
    (``overrides``: ``steps``, ``eval_every``, ``wall``, ``max_skips``, ``every``, ``keep``, ``export``)."""
    fields = dict(steps=24, eval_every=0, wall=0, max_skips=3, every=4, keep=0, export="false")
    fields.update(overrides)
    extra = f"max_wall_seconds = {fields.pop('wall')}\nmax_consecutive_skips = {fields.pop('max_skips')}\n"
    return write_toml(tmp_path / f"{name}.toml", TINY_SPEC,
                      **loop_fields(weight_decay=0.01, schedule='name = "cosine"\npeak = 3e-3\nwarmup = 3',
                                    train_extra=extra, run_dir=str(tmp_path / name), **fields))


#: A one-step CPU run of a tiny model: ``cpu_spec`` fills it (``model``: the rest of the ``[model]``
#: table, e.g. a ``[model.config]`` table or a ``path = ...`` line).
CPU_SPEC = """\
[model]
tokenizer = "{tokenizer}"
{model}

[data]
sources = [{{ path = "pgs:quickstart/train.jsonl" }}]
max_seq_len = 96

[train]
steps = 1
batch_size = 2
eval_every = 0
log_every = 1000
device = "cpu"

[checkpoint]
dir = "{run_dir}"
every = 0
export = false
"""

#: ``CPU_SPEC``'s model: one layer, 4 heads of 8 (2 key-value heads).
CPU_CONFIG = config_toml(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def cpu_spec(tmp_path: Path, *, model: str = CPU_CONFIG, tokenizer: Path = QUICKSTART / "tokenizer",
             run_dir: Path | None = None) -> Path:
    """``CPU_SPEC`` in ``tmp_path/spec.toml``; its run folder ``run_dir`` (default ``tmp_path/run``)."""
    run_dir = run_dir if run_dir is not None else tmp_path / "run"
    return write_toml(tmp_path / "spec.toml", CPU_SPEC, model=model, tokenizer=tokenizer.as_posix(),
                      run_dir=run_dir.as_posix())


def free_port() -> int:
    """A local TCP port free at the time of asking (for a rendezvous or ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(spec: Path, resume: str | None = None, args: tuple[str, ...] = ()) -> list[str]:
    """``python -m pgs run SPEC [--resume RESUME] [ARGS...]``."""
    return [sys.executable, "-m", "pgs", "run", str(spec)] + (["--resume", resume] if resume else []) + list(args)


def child_env(**extra) -> dict:
    """This environment without injected faults, one thread per process, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PGS_FAULTS"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(spec: Path, resume: str | None = None, timeout: float = 240, args: tuple[str, ...] = (),
           **env) -> subprocess.CompletedProcess:
    """``pgs run`` as a child process (``env``: more environment), its output captured."""
    return subprocess.run(command(spec, resume, args), cwd=ROOT, env=child_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def run_here(spec: Path, *args: str) -> int:
    """``pgs run SPEC ARGS...`` in this process at one intra-op thread (as ``launch``'s children
    run), its exit code: a one-process reference run without an interpreter, torch and
    transformers to start (a child pays seconds of CPU for them, and for its data worker's fork
    server, which this process starts once)."""
    from pgs.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["run", str(spec), *args])
    finally:
        torch.set_num_threads(threads)


def torchrun(spec: Path, resume: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``pgs run`` on 2 ranks under torchrun (gloo on the CPU), a short process-group timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "pgs", "run", str(spec)] + (["--resume", resume] if resume else [])
    return subprocess.run(cmd, cwd=ROOT, env=child_env(PGS_PG_TIMEOUT_S=60), capture_output=True, text=True,
                          timeout=timeout)


def wait_for_steps(run_dir: Path, procs: list[subprocess.Popen], n: int, timeout: float = 240) -> None:
    """Until the run's log holds ``n`` steps; fails at once, with their stderr, if any of ``procs``
    ended before that, and after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").exists() and len(step_records(run_dir)) >= n):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
        assert time.monotonic() < deadline, f"no {n} steps in {run_dir} after {timeout} s"
        time.sleep(0.05)


def wait_for_file(path: Path, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    """Until ``path`` exists (an event a child writes, e.g. ``Faults.pause_at``'s); fails at once,
    with their stderr, if any of ``procs`` ended before that, and after ``timeout`` seconds (a
    guard against a hang, not a measure of speed)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


def stopped_checkpoint(run_dir: Path, lo: int, hi: int, world_size: int) -> Path:
    """The step folder of a run stopped once by SIGTERM (one ``stop`` record, exit 143, at a step
    in ``[lo, hi)``), checked complete and written by ``world_size`` ranks (DCP)."""
    stop = [r for r in records(run_dir) if r.get("event") == "stop"]
    assert len(stop) == 1 and stop[0]["exit_code"] == 143, stop
    assert lo <= stop[0]["step"] < hi, stop
    folder = run_dir / f"step_{stop[0]['step']}"
    assert (folder / "COMPLETE").exists() and json.loads((folder / "dcp.json").read_text())["world_size"] == world_size
    return folder


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def run_plain_and_released(tmp_path: Path, text: str) -> tuple[list[dict], list[dict]]:
    """Run the spec ``text`` (written for run folder ``tmp_path / "plain"``) as it is, with one
    micro-batch a step and no clip, and again with ``memory.gradient_release``; both step records."""
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    text = text.replace("grad_accum = 2", "grad_accum = 1").replace('alias = "adamw"', 'alias = "adamw"\nclip = 0.0')
    (tmp_path / "plain.toml").write_text(text)
    released = text.replace(str(tmp_path / "plain"), str(tmp_path / "released")) + "\n[memory]\ngradient_release = true\n"
    (tmp_path / "released.toml").write_text(released)
    assert run(load_spec(tmp_path / "plain.toml")) == 0
    assert run(load_spec(tmp_path / "released.toml")) == 0
    return step_records(tmp_path / "plain"), step_records(tmp_path / "released")


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: different keys"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_same_checkpoint(a: Path, b: Path) -> None:
    assert_same_tensors(load_file(a / "model.safetensors"), load_file(b / "model.safetensors"), "model")
    assert_same_tensors(load_file(a / "optimizer.safetensors"), load_file(b / "optimizer.safetensors"), "optimizer")
    ta, tb = (json.loads((p / "trainer.json").read_text()) for p in (a, b))
    assert ta["data"] == tb["data"] and ta["trained_tokens"] == tb["trained_tokens"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a run's final export."""
    return load_file(run_dir / "final" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, what: str, atol: float = 0.0) -> None:
    """The same tensors, bit for bit, or (``atol`` > 0) to ``atol`` in every element."""
    assert sorted(a) == sorted(b), what
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert (torch.equal(a[k], b[k]) if atol == 0 else diff <= atol), f"{what}: {k} max |diff| {diff:.3g}"


def error_line(stderr: str) -> str:
    """The one line a refused command writes: ``pgs: error: ...``, no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("pgs: error: "), stderr
    return lines[0]


def cli_error(argv: list[str], capsys) -> tuple[int, str]:
    """``pgs ARGV`` in this process (``pgs.cli.main``): its exit code and its one error line."""
    from pgs.cli import main

    code = main(argv)
    _, err = capsys.readouterr()
    return code, error_line(err)


class CountingReader(Mapping):
    """A read-only mapping over ``inner`` (a lazily read safetensors file) that records the most
    tensors it handed out that were alive at once (``most``): what a loader holds at its peak."""

    def __init__(self, inner: Mapping):
        self.inner, self.alive, self.most = inner, [], 0

    def __getitem__(self, key):
        import weakref

        t = self.inner[key]
        self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(t)]
        self.most = max(self.most, len(self.alive))
        return t

    def __contains__(self, key) -> bool:
        return key in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


RUNS_HARNESS = ROOT / "tests" / "integration" / "runs_harness.py"


def start_runs(out: Path, runs: list[dict], world: int, **env) -> list[subprocess.Popen]:
    """``world`` ranks of tests/integration/runs_harness.py (the environment torchrun would give,
    a short process-group timeout, ``env`` on top), which run ``runs`` one after the other in one
    start of the ranks, each with a fresh rendezvous: each entry ``{"name", "argv"}``
    (``pgs run ARGV`` on every rank; ``"faults"``: a ``Faults(...).env()``, a crash last) or
    ``{"name", "call": "module:function"}``.  Their outcomes: :func:`run_outcome`."""
    out.mkdir(parents=True, exist_ok=True)
    plan = {"out": str(out), "runs": runs}
    path = out / "plan.json"
    path.write_text(json.dumps(plan))
    procs = []
    for rank in range(world):
        e = child_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                      PGS_PG_TIMEOUT_S=60, PYTHONPATH=ROOT, **env)
        with open(out / f"ranks_rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(RUNS_HARNESS), str(path)], cwd=ROOT, env=e,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def sigterm_rank_one_at_the_gate(procs: list[subprocess.Popen], gate: Path, timeout: float) -> None:
    """A run of :func:`start_runs` with ``Faults(pause_at=(step, gate))`` paused at ``step``:
    SIGTERM to rank 1 only, then, once its handler has seen it, the run goes on (both ranks must
    stop at one step with one checkpoint)."""
    wait_for_file(gate / "paused", procs, 3 * timeout)
    procs[1].send_signal(signal.SIGTERM)
    wait_for_file(gate / "signalled", procs, timeout)
    (gate / "go").write_text("")


def end_runs(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """The ranks' exit codes once all have ended; after ``timeout`` seconds (a hang), each still
    running is killed (by its own pid) and the test fails."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks still running after {timeout} s (a hang?)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def run_outcome(out: Path, name: str, world: int) -> tuple[list[int | None], str]:
    """A run of :func:`start_runs`: each rank's exit code (None: it did not end, e.g. killed
    during it) and the ranks' logs (rank 0's first)."""
    codes = [int(p.read_text()) if (p := out / f"{name}_rank{r}.code").exists() else None for r in range(world)]
    logs = "\n".join((out / f"{name}_rank{r}.log").read_text(errors="replace") if (out / f"{name}_rank{r}.log").exists()
                     else "" for r in range(world))
    return codes, logs
