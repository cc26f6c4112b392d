"""Optimizer state on the host (``memory.offload_optimizer``), measured through ``pgs run``.

In one call, one setup after the other, each in its own process with its own timeout (a
setup that runs out of time or fails is recorded as such, and the JSON is rewritten after
every setup, so partial results survive):

1. ``bandwidth``: host ↔ device copy bandwidth of page-locked memory registered as the
   offload registers it (1 GiB; host → device, device → host, and both at once on two streams).
2. ``pgs_8b_offload``: ``pgs run specs/qwen3_8b_20gib.toml`` (Qwen3-8B shape, 1×4096, every
   weight trainable, state offloaded).
3. ``hf_8b_compiled_ac``: the HF peer at the same shape on the same batches
   (``bench/product.py --order peer --peer hf_compiled_ac``: compiled decoder layers,
   checkpointing, ``torch.optim.AdamW(fused=True)``).
4. ``pgs_4b`` and ``pgs_4b_offload``: ``specs/qwen3_4b_12gib.toml`` with the state on the
   device and with ``--set memory.offload_optimizer=true --set memory.device_limit_gib=9`` (the 9 GiB recipe).
5. ``pgs_4b_saves``, ``pgs_4b_bgsaves`` (and the 8B's): a checkpoint every ``--save-every``
   steps, in the foreground and with ``checkpoint.background = true``; ``wall_tok_s`` (tokens
   over the steps' wall-clock span, saves included) against the setup without periodic saves
   shows what the saves cost training.  (A background save hides only when the steps between
   saves take longer than a save: at most one is in flight.)
6. ``pgs_4b_resume`` and ``pgs_8b_offload_resume``: the recipe killed after step N/2 + 3 and
   continued with ``--resume auto`` from its checkpoint at N/2 (``run_resume``): the resumed
   run's peaks (the state's load included), launch to first step, its first step's loss against
   the interrupted run's, and beside the uninterrupted setup earlier in the same call the largest
   loss differences (after the resume, and run to run before it) and whether the final weights
   are equal.
7. ``pgs_32b``, ``pgs_14b`` and ``pgs_14b_save``: ``specs/qwen3_32b_one_gpu.toml`` (every weight
   of a Qwen3-32B trained on one card) and the same recipe at Qwen3-14B's shape, the first two
   without a checkpoint at the end (``checkpoint.last = false``: a 32B checkpoint is 92 GiB),
   the third with one (its ``checkpoint`` event times the save); ``pgs_14b_save_resume`` is
   that run killed and resumed as in 6.

For the ``pgs run`` setups: tokens/s is ``bench/product.py``'s "mean" over steps
``--skip``+1 to N (the run's own step records), max allocated / reserved are the run's
``torch.cuda`` peaks, host memory is the proportional set size (PSS) of the run's process
tree (/proc, every 0.5 s: the pinned state, the offloaded checkpoints, the libraries once
however many compile workers share them), reported by phase: before step 1, while stepping,
while saving (the run's ``checkpoint`` events time each save); and with offload the run's own ``offload`` record gives the PCIe bytes per step; their time at
the measured bandwidth (each direction at its own, the two overlapping) is the floor the
copies put under a step if nothing overlapped them.  Checkpoints: one save at the end (after
the last step record; the timeout may cut it without losing the figures).

    python -m bench offload --steps 16                    # on the GPU (bench/device_offload.sh)
    python -m bench offload --small --only pgs_4b,pgs_4b_offload   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import product  # noqa: E402 - the product bench's summary of a run's step records and its smoke shape

GiB = 2**30
#: Qwen3-14B's shape on the 32B recipe (the rest of its config is Qwen3-32B's)
QWEN3_14B = ["model.config.intermediate_size=17408", "model.config.num_hidden_layers=40",
             "model.config.num_attention_heads=40"]
SETUPS = {  # name -> (kind, spec, extra --set, default timeout s)
    "pgs_8b_offload": ("pgs", "specs/qwen3_8b_20gib.toml", [], 200),
    "hf_8b_compiled_ac": ("peer", "specs/qwen3_8b_20gib.toml", [], 170),
    "pgs_4b": ("pgs", "specs/qwen3_4b_12gib.toml", [], 110),
    "pgs_4b_offload": ("pgs", "specs/qwen3_4b_12gib.toml",
                       ["memory.offload_optimizer=true", "memory.device_limit_gib=9"], 110),
    # a save every --save-every steps, in the foreground and in the background (checkpoint.background):
    # the steps' wall-clock throughput (wall_tok_s) beside the setup without periodic saves
    "pgs_4b_saves": ("pgs", "specs/qwen3_4b_12gib.toml", ["checkpoint.every={every}"], 160),
    "pgs_4b_bgsaves": ("pgs", "specs/qwen3_4b_12gib.toml", ["checkpoint.every={every}", "checkpoint.background=true"],
                       160),
    "pgs_8b_offload_saves": ("pgs", "specs/qwen3_8b_20gib.toml", ["checkpoint.every={every}"], 230),
    "pgs_8b_offload_bgsaves": ("pgs", "specs/qwen3_8b_20gib.toml",
                               ["checkpoint.every={every}", "checkpoint.background=true"], 230),
    # killed after step N/2 + 3 and resumed from the checkpoint at N/2 (run_resume)
    "pgs_4b_resume": ("resume", "specs/qwen3_4b_12gib.toml", [], 220),
    "pgs_8b_offload_resume": ("resume", "specs/qwen3_8b_20gib.toml", [], 400),
    # the 32B recipe on one card (no checkpoint at the end: one is 92 GiB), and the same recipe at
    # Qwen3-14B's shape, without and with one save at the end (the save's time and host memory)
    "pgs_32b": ("pgs", "specs/qwen3_32b_one_gpu.toml", ["checkpoint.last=false"], 420),
    "pgs_14b": ("pgs", "specs/qwen3_32b_one_gpu.toml", QWEN3_14B + ["checkpoint.last=false"], 240),
    "pgs_14b_save": ("pgs", "specs/qwen3_32b_one_gpu.toml", QWEN3_14B, 300),
    "pgs_14b_save_resume": ("resume", "specs/qwen3_32b_one_gpu.toml", QWEN3_14B, 400),
}


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (/proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _field(path: str, name: str) -> int:
    """A ``kB`` field of a /proc status-like file, in bytes (0 where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_sample(pid: int) -> tuple[int, int, int]:
    """(proportional set size of the process tree, resident set of the tree, resident set of
    ``pid`` alone), bytes.  The tree's PSS counts a page shared by k processes once in all (the
    libraries that Inductor's compile workers share with the run), so it is the host memory the
    run takes; the RSS sum counts such pages once per process."""
    pids = _tree(pid)
    pss = sum(_field(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
    rss = sum(_field(f"/proc/{p}/status", "VmRSS:") for p in pids)
    return pss, rss, _field(f"/proc/{pid}/status", "VmRSS:")


class HostMemory(product.GpuMemory):
    """Samples ``host_sample`` of a process tree every ``period`` s into ``samples``
    (time, pss, rss, main rss) (the product bench's sampler thread, reading /proc instead of
    nvidia-smi)."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(period)
        self.pid = pid

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append((time.time(), *host_sample(self.pid)))
            self._stop.wait(self.period)


def host_phases(samples: list[tuple], records: list[dict]) -> dict:
    """Host memory (the tree's PSS) by phase of a ``pgs run``: before its first step record
    (model build, compilation, the state's first placement), while it steps (saves excluded),
    and while it saves (each ``checkpoint`` event's ``checkpoint_seconds`` before its time; a
    background save's ``write_seconds`` + ``sync_seconds``)."""
    if not samples:
        return {}
    out = {"host_pss_max_gib": max(s[1] for s in samples) / GiB,
           "host_rss_main_max_gib": max(s[3] for s in samples) / GiB}
    steps = [r for r in records if "loss" in r and "tokens" in r]
    # a save's span: what training waited, or for a background save its thread's write and sync
    saves = [(r["time"] - (r.get("write_seconds", 0.0) + r.get("sync_seconds", 0.0) if r.get("background")
                           else r.get("checkpoint_seconds", 0.0)) - 0.5, r["time"] + 0.5)
             for r in records if r.get("event") == "checkpoint"]
    if not steps:
        return out
    start = steps[0]["time"] - steps[0].get("step_seconds", 0.0)
    end = max(r["time"] for r in records)

    def peak(keep) -> float | None:
        vals = [s[1] for s in samples if keep(s[0])]
        return max(vals) / GiB if vals else None

    def saving(t):
        return any(a <= t <= b for a, b in saves)

    out["host_pss_setup_gib"] = peak(lambda t: t < start)
    out["host_pss_steps_gib"] = peak(lambda t: start <= t <= end and not saving(t))
    if saves:
        out["host_pss_save_gib"] = peak(saving)
        events = [r for r in records if r.get("event") == "checkpoint"]
        out["checkpoint_s"] = [r.get("checkpoint_seconds") for r in events]
        if all("write_seconds" in r for r in events):  # the save's phases: written + hashed, fsynced
            out["checkpoint_write_s"] = [r["write_seconds"] for r in events]
            out["checkpoint_sync_s"] = [r["sync_seconds"] for r in events]
            out["checkpoint_gib"] = [r["bytes"] / GiB for r in events]
    return out


def _rss_peak(samples: list[tuple]) -> float:
    """The largest resident-set sum of the tree, GiB (counts shared pages once per process)."""
    return max((s[2] for s in samples), default=0) / GiB


def _run_child(cmd: list[str], timeout: float, env=None) -> tuple[int | None, str, str, list]:
    """Run ``cmd`` in its own process group; kill the group at ``timeout``.  (returncode or
    None on timeout, stdout, stderr, the host-memory samples of the process tree)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        with HostMemory(proc.pid) as host:
            try:
                rc = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read(), host.samples


def run_pgs(name: str, spec: str, sets: list[str], args, timeout: float, *, env: dict | None = None,
            resume: bool = False, keep: bool = False) -> dict:
    """``pgs run`` of one setup in ``<workdir>/<name>``.  ``env``: more environment (a fault to
    inject); ``resume``: the folder is kept and the run continues it (``--resume auto``), and its
    figures are those after the resume; ``keep``: the folder stays for a run that resumes it."""
    run_dir = os.path.join(args.workdir, name)
    if not resume:
        subprocess.run(["rm", "-rf", run_dir])
    # the small shape's sets last: on the CPU they override the setup's device-only ones (the cap)
    sets = [f"train.steps={args.steps}", f"checkpoint.dir={run_dir}", "checkpoint.every=0", "checkpoint.keep=1",
            "train.log_every=5"] + sets + (product.SMALL if args.small else [])
    cmd = [sys.executable, "-m", "pgs", "run", spec] + [x for s in sets for x in ("--set", s)]
    cmd += ["--resume", "auto"] if resume else []
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    started = time.time()
    rc, _, err, samples = _run_child(cmd, timeout, env)
    out = {"setup": name, "spec": spec, "command": " ".join(cmd[1:]), "returncode": rc,
           "host_rss_max_gib": _rss_peak(samples), "seconds": time.time() - started}
    if rc is None:
        out["timed_out"] = timeout
    records = product.read_metrics(run_dir)
    if resume:  # this run's records: those after its resume event
        at = max((i for i, r in enumerate(records) if r.get("event") == "resume"), default=None)
        if at is None:
            out["error"] = err[-3000:] or f"no resume event (returncode {rc})"
            return out
        out["resumed_from"] = records[at]["from"]
        records = records[at:]
    out.update(host_phases(samples, records))
    steps = [r for r in records if "loss" in r and "tokens" in r]
    if steps:
        out.update(product.summarize(records, args.skip))
        out["launch_to_step1_s"] = steps[0]["time"] - started
        out["step_s"] = [round(r["step_seconds"], 3) for r in steps]
        out["losses"] = {r["step"]: r["loss"] for r in steps}
        out["last_loss"] = steps[-1]["loss"]
    done = next((r for r in records if r.get("event") == "done"), None)
    if done is not None and "mem_gib" in done:  # the run's own peaks (a resumed run: since its start)
        out["done_mem_gib"], out["done_reserved_gib"] = done["mem_gib"], done["reserved_gib"]
    final = os.path.join(run_dir, f"step_{args.steps}", "COMPLETE")
    if os.path.exists(final):  # the final weights' digest, to compare an interrupted run with
        with open(final, encoding="utf-8") as handle:
            out["final_model_digest"] = json.load(handle)["files"]["model.safetensors"].get("sha256_chunks")
    offload = next((r for r in records if r.get("event") == "offload"), None)
    if offload is not None:
        out["host_state_gib"] = offload["host_state_bytes"] / GiB
        out["staging_gib"] = offload["staging_bytes"] / GiB
        out["pcie_gib_per_step"] = offload["pcie_bytes_per_step"] / GiB
    if not steps or (rc not in (0, None) and not keep):
        out["error"] = err[-3000:] or f"no step records (returncode {rc})"
    out["stderr_tail"] = err[-1500:]
    if not args.keep and not keep:  # the final checkpoint (24 GB at 8B): room on the disk for the next setup
        subprocess.run(["rm", "-rf", run_dir])
    return out


def run_resume(name: str, spec: str, sets: list[str], args, timeout: float) -> dict:
    """Resume on the product path: ``pgs run`` to ``N = --steps`` with a checkpoint at
    ``k = N // 2``, killed (SIGKILL, ``PGS_FAULTS`` ``crash_at``) right after step k + 3 (so that
    step k + 1's record is logged), then ``pgs run --resume auto`` to N.  The result is the
    resumed run's: its steps, its peaks (the load of the state included), ``resume_s`` (launch to
    its first step); ``interrupted`` holds the first run's.  ``resume_step_diff``: step k + 1's
    loss after the resume against the interrupted run's own step k + 1 (the same weights and
    batch: 0 when the checkpoint restores the run exactly and the forward is deterministic).
    Beside an uninterrupted setup of the same spec and sets earlier in the call (``compare_resumes``),
    ``loss_diff`` is the largest difference of a step's loss after the resume, ``run_to_run_diff``
    the largest before the interruption (two runs of the same steps: the device's own
    nondeterminism), and ``same_weights`` whether the final model files' digests are equal."""
    k = args.steps // 2
    faults = {"PGS_FAULTS": json.dumps({"crash_at": ["step", k + 3]})}
    began = time.time()
    first = run_pgs(name, spec, sets + [f"checkpoint.every={k}"], args, timeout / 2, env=faults, keep=True)
    if first.get("returncode") != -signal.SIGKILL:  # (its summary's error, too few steps to time, is no failure)
        return {**first, "error": first.get("error") or f"the run to be interrupted ended with {first.get('returncode')}"}
    out = run_pgs(name, spec, sets, args, timeout - (time.time() - began), resume=True)
    out["interrupted"] = {key: first.get(key) for key in ("returncode", "seconds", "max_allocated_gib",
                                                         "max_reserved_gib", "checkpoint_s", "losses")}
    out["resume_s"] = out.pop("launch_to_step1_s", None)
    before, after = (first.get("losses") or {}).get(k + 1), (out.get("losses") or {}).get(k + 1)
    if before is not None and after is not None:
        out["resume_step_diff"] = abs(after - before)
    return out


def compare_resumes(results: list[dict]) -> None:
    """``loss_diff``, ``run_to_run_diff`` and ``same_weights`` of each resumed setup against the
    uninterrupted one (same spec and sets; the setup's name without ``_resume``)."""
    by_name = {r["setup"]: r for r in results}
    for r in results:
        base = by_name.get(r["setup"].removesuffix("_resume")) if r["setup"].endswith("_resume") else None
        if base is None or "losses" not in r or "losses" not in base:
            continue
        common = [s for s in r["losses"] if s in base["losses"]]
        if common:
            r["loss_diff"] = max(abs(r["losses"][s] - base["losses"][s]) for s in common)
        resumed = min(r["losses"], default=None)
        first = (r.get("interrupted") or {}).get("losses") or {}
        early = [s for s in first if s in base["losses"] and (resumed is None or s < resumed)]
        if early:
            r["run_to_run_diff"] = max(abs(first[s] - base["losses"][s]) for s in early)
        if r.get("final_model_digest") and base.get("final_model_digest"):
            r["same_weights"] = r["final_model_digest"] == base["final_model_digest"]


def run_peer(name: str, spec: str, sets: list[str], args, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peer.json")
        cmd = [sys.executable, os.path.join(BENCH, "product.py"), "--spec", spec, "--order", "peer",
               "--peer", "hf_compiled_ac", "--steps", str(args.steps), "--skip", str(args.skip), "--out", path]
        cmd += ["--small"] if args.small else []
        cmd += [x for s in sets for x in ("--set", s)]
        started = time.time()
        rc, _, err, samples = _run_child(cmd, timeout, dict(os.environ, PYTHONUNBUFFERED="1"))
        out = {"setup": name, "spec": spec, "returncode": rc, "host_rss_max_gib": _rss_peak(samples),
               **host_phases(samples, []),
               "seconds": time.time() - started}
        if rc is None:
            out["timed_out"] = timeout
        if os.path.exists(path):
            res = json.load(open(path))["results"]
            if res:
                out.update({k: v for k, v in res[0].items() if k not in ("setup", "spec")})
        if "mean_tok_s" not in out:
            out["error"] = err[-3000:] or f"no result (returncode {rc})"
    return out


BANDWIDTH = r"""
import json, time, torch
from pgs.runtime.pinned import host_buffer
n = 1 << 30
host, registered = host_buffer(n, True)
host.fill_(1)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
host2, _ = host_buffer(n, True)
a, b = torch.cuda.Stream(), torch.cuda.Stream()
def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps
def h2d():
    dev.copy_(host, non_blocking=True)
def d2h():
    host2.copy_(dev2, non_blocking=True)
def both():
    with torch.cuda.stream(a):
        dev.copy_(host, non_blocking=True)
    with torch.cuda.stream(b):
        host2.copy_(dev2, non_blocking=True)
th, td, tb = timed(h2d), timed(d2h), timed(both)
print(json.dumps({"registered": registered, "pinned": host.is_pinned(), "h2d_gb_s": n / th / 1e9,
                  "d2h_gb_s": n / td / 1e9, "both_gb_s_each": n / tb / 1e9}))
"""


def run_bandwidth(args, timeout: float) -> dict:
    if args.small:
        return {"setup": "bandwidth", "skipped": "needs a CUDA device"}
    rc, out, err, _ = _run_child([sys.executable, "-c", BANDWIDTH], timeout,
                                 dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    try:
        return {"setup": "bandwidth", **json.loads(out.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {"setup": "bandwidth", "error": (err or out)[-2000:] or f"returncode {rc}"}


def pcie_floor(results: list[dict]) -> None:
    """Seconds per step the offload's copies take at the measured bandwidth (each direction
    at its own rate, overlapping each other), and that over the run's median step."""
    bw = next((r for r in results if r.get("setup") == "bandwidth" and "h2d_gb_s" in r), None)
    if bw is None:
        return
    for r in results:
        if "pcie_gib_per_step" in r:
            one_way = r["pcie_gib_per_step"] * GiB / 2
            s = max(one_way / (bw["both_gb_s_each"] * 1e9), one_way / (bw["h2d_gb_s"] * 1e9))
            r["pcie_s_per_step"] = s
            if r.get("median_step_s"):
                r["pcie_share_of_step"] = s / r["median_step_s"]


#: The table's columns: (header, result key, format).
COLUMNS = [("mean tok/s", "mean_tok_s", ",.0f"), ("wall tok/s", "wall_tok_s", ",.0f"),
           ("max alloc GiB", "max_allocated_gib", ".2f"),
           ("max reserved GiB", "max_reserved_gib", ".2f"), ("host PSS GiB: setup", "host_pss_setup_gib", ".1f"),
           ("steps", "host_pss_steps_gib", ".1f"), ("save", "host_pss_save_gib", ".1f"),
           ("max", "host_pss_max_gib", ".1f"),
           ("host state GiB", "host_state_gib", ".2f"), ("PCIe GiB/step", "pcie_gib_per_step", ".2f"),
           ("PCIe s/step", "pcie_s_per_step", ".3f"), ("step s (median)", "median_step_s", ".3f"),
           ("resume s", "resume_s", ".1f"), ("step k+1 diff", "resume_step_diff", ".2e"),
           ("loss diff", "loss_diff", ".2e"), ("run-to-run diff", "run_to_run_diff", ".2e"),
           ("same weights", "same_weights", "")]


def _setup_cell(r: dict) -> str:
    """The setup, with its error's last line and its timeout beside it (the figures it logged stay)."""
    err = r.get("error")
    note = "" if not err else f" (error: {str(err).strip().splitlines()[-1][:100]})"
    if r.get("timed_out"):
        note += f" (timed out at {r['timed_out']:.0f} s)"
    return f"{r['setup']}{note}"


def table(results: list[dict]) -> str:
    text = product.markdown_table([r for r in results if r["setup"] != "bandwidth"], COLUMNS, setup=_setup_cell,
                                  inline_errors=True)
    bw = next((r for r in results if r["setup"] == "bandwidth"), None)
    if bw and "h2d_gb_s" in bw:
        text += (f"\n\nhost↔device (1 GiB, page-locked): H2D {bw['h2d_gb_s']:.1f} GB/s, D2H {bw['d2h_gb_s']:.1f} GB/s, "
                 f"both at once {bw['both_gb_s_each']:.1f} GB/s each")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16, help="steps of each setup")
    p.add_argument("--save-every", type=int, default=40, help="checkpoint.every of the *_saves setups")
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out (the mean is over steps skip+1..N)")
    p.add_argument("--only", default="bandwidth,pgs_8b_offload,hf_8b_compiled_ac,pgs_4b,pgs_4b_offload",
                   help=f"setups, in this order (known: bandwidth, {', '.join(SETUPS)})")
    p.add_argument("--budget", type=float, default=560.0, help="seconds for all setups together")
    p.add_argument("--timeout", action="append", default=[], metavar="SETUP=S", help="a setup's own timeout")
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run of this script)")
    p.add_argument("--workdir", default="", help="where the run folders go (default: a temporary folder)")
    p.add_argument("--out", default="", help="JSON results (rewritten after every setup)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more --set for every setup's spec (e.g. memory.device_limit_gib=76: an H100's room on an H200)")
    p.add_argument("--keep", action="store_true", help="keep each pgs run's folder (default: removed after reading)")
    args = p.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-offload-")
    own = {k: float(v) for k, v in (t.split("=", 1) for t in args.timeout)}
    t0 = time.time()
    results: list[dict] = []

    def save():
        pcie_floor(results)
        compare_resumes(results)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as handle:
                json.dump({"steps": args.steps, "skip": args.skip, "results": results}, handle, indent=1)

    for name in [n for n in args.only.split(",") if n]:
        left = args.budget - (time.time() - t0)
        if left < 20:
            results.append({"setup": name, "error": "skipped: the budget is spent"})
            continue
        if name == "bandwidth":
            results.append(run_bandwidth(args, min(left, own.get(name, 60))))
        elif name in SETUPS:
            kind, spec, sets, default = SETUPS[name]
            sets = [x.format(every=args.save_every) for x in sets] + args.set
            timeout = min(left, own.get(name, default))
            fn = {"pgs": run_pgs, "peer": run_peer, "resume": run_resume}[kind]
            results.append(fn(name, spec, sets, args, timeout))
        else:
            results.append({"setup": name, "error": f"unknown setup (known: bandwidth, {', '.join(SETUPS)})"})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_s", "losses", "stderr_tail", "error")}),
              flush=True)
        save()
    print(table(results), flush=True)
    save()
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
