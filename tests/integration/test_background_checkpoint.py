"""``[checkpoint] background = true``: saves written on a thread from a host snapshot
(pgs/runtime/store/background.py).

What must hold: the files equal a foreground save's of the same step, whatever training does
to the live tensors while the thread writes; a run with background saves gives the same
checkpoints, bit for bit, as one without; a kill while the thread writes leaves the earlier
checkpoint to resume from, bit-exactly; a halt and a stop wait for the save in flight; with
two gloo ranks the DCP checkpoints written in the background equal the foreground run's and
resume to its bits.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
from pathlib import Path

import pytest
import torch

from pgs import cli
from pgs.runtime.loop.faults import Faults
from pgs.runtime.store import background, checkpoint as ckpt
from helpers import (assert_same_checkpoint, assert_same_weights, final_weights, launch, records, run_here,
                     step_records, tiny_spec, torchrun)

BACKGROUND = ("--set", "checkpoint.background=true")


pytestmark = pytest.mark.usefixtures("one_thread")


def _manifest(folder) -> dict:
    return json.loads((Path(folder) / ckpt.COMPLETE).read_text())["files"]


def _state():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    tensors, aliases = ckpt.model_tensors(model)
    optimizer = {"mu": torch.randn(16, 8, generator=g), "count": torch.tensor(3, dtype=torch.int32),
                 "codes": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
                 "flag": torch.ones((), dtype=torch.bool), "half": torch.randn(5, 3, generator=g).bfloat16(),
                 "empty": torch.empty(0, 4)}
    return model, tensors, aliases, optimizer


def test_snapshot_copies_every_dtype_and_shape_and_reuses_its_buffer():
    _, tensors, _, optimizer = _state()
    snap = background.Snapshot()
    copies, events = snap.take({"model": tensors, "optimizer": optimizer})
    assert events == []  # nothing on a GPU: every copy is done
    for group, source in (("model", tensors), ("optimizer", optimizer)):
        assert copies[group].keys() == source.keys()
        for name, t in source.items():
            c = copies[group][name]
            assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
            assert torch.equal(c, t) and (c.numel() == 0 or c.data_ptr() != t.data_ptr())
    held = snap.nbytes
    assert held >= sum(t.numel() * t.element_size() for t in [*tensors.values(), *optimizer.values()])
    again, _ = snap.take({"model": tensors, "optimizer": optimizer})
    assert snap.nbytes == held  # the same buffer
    assert again["model"]["0.weight"].data_ptr() == copies["model"]["0.weight"].data_ptr()
    snap.release()
    assert snap.nbytes == 0


def test_the_written_files_are_the_snapshots_whatever_training_does_meanwhile(tmp_path, monkeypatch):
    """The thread is held before it writes; the live tensors change; the folder still equals a
    foreground save of the values at the snapshot."""
    model, tensors, aliases, optimizer = _state()
    rng = ckpt.capture_rng()
    ckpt.save_tensors(str(tmp_path / "fg"), 1, tensors=tensors, aliases=aliases, optimizer_state=optimizer, rng=rng,
                      trainer={"n": 1}, spec_toml="x = 1\n")
    gate, entered = threading.Event(), threading.Event()
    real = ckpt.write_safetensors

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_safetensors", held)
    saver = background.BackgroundSaver()
    seconds = saver.start(lambda snap: ckpt.save_tensors(
        str(tmp_path / "bg"), 1, tensors=snap["model"], aliases=aliases, optimizer_state=snap["optimizer"], rng=rng,
        trainer={"n": 1}, spec_toml="x = 1\n"), {"model": tensors, "optimizer": optimizer})
    assert seconds >= 0 and saver.pending
    assert entered.wait(30)
    with torch.no_grad():  # "the next step": every live tensor changes in place
        for p in model.parameters():
            p.add_(1.0)
        for t in optimizer.values():
            t.zero_()
    assert saver.flags() == (1, 0)  # still writing
    with pytest.raises(RuntimeError, match="still in flight"):
        saver.start(lambda snap: None, {"model": tensors})
    gate.set()
    path = saver.close()
    assert path == str(tmp_path / "bg" / "step_1") and not saver.pending
    assert ckpt.problem(path) is None
    assert _manifest(path) == _manifest(tmp_path / "fg" / "step_1")


def test_a_failed_background_save_is_raised_where_the_training_thread_asks(tmp_path):
    saver = background.BackgroundSaver()

    def fails(snap):
        raise OSError(5, "Input/output error")

    saver.start(fails, {"model": {"w": torch.ones(3)}})
    while saver.flags()[0]:
        pass
    assert saver.flags() == (0, background.FAILED)
    result, err = saver.collect()
    assert result is None and isinstance(err, OSError) and "Input/output" in str(err)
    assert saver.collect() == (None, None) and saver.flags() == (0, 0)  # reported once
    from pgs.errors import DiskFull

    saver.submit(lambda: (_ for _ in ()).throw(DiskFull("disk full while writing the checkpoint x")))
    with pytest.raises(DiskFull):
        saver.wait()
    assert background.failure_code(DiskFull("x")) == background.DISK_FULL and background.failure_code(None) == 0
    saver.close()


def _run(spec, *args) -> int:
    return cli.main(["run", str(spec), *args])


@pytest.fixture(scope="module")
def foreground(tmp_path_factory) -> Path:
    """The run folder of the tiny spec (12 steps, a checkpoint every 4) saved in the foreground,
    one thread, in this process: the reference of the background runs below."""
    tmp = tmp_path_factory.mktemp("foreground")
    assert run_here(tiny_spec(tmp, "fg", steps=12, every=4)) == 0
    return tmp / "fg"


def test_a_run_with_background_saves_writes_the_foreground_runs_checkpoints(tmp_path, capsys, foreground):
    bg = tiny_spec(tmp_path, "bg", steps=12, every=4)
    assert _run(bg, *BACKGROUND) == 0, capsys.readouterr().err[-3000:]
    for step in (4, 8, 12):
        assert_same_checkpoint(tmp_path / "bg" / f"step_{step}", foreground / f"step_{step}")
    assert [r["loss"] for r in step_records(tmp_path / "bg")] == [r["loss"] for r in step_records(foreground)]
    events = [r for r in records(tmp_path / "bg") if r.get("event") == "checkpoint"]
    saves = {r["step"]: r for r in events}
    assert sorted(saves) == [4, 8, 12] and len(events) == 3  # each save's event once
    for step in (4, 8):  # periodic saves: in the background, logged when they end
        r = saves[step]
        assert r["background"] is True and r["logged_at_step"] >= step and r["snapshot_bytes"] > 0
        assert r["checkpoint_seconds"] >= 0 and r["write_seconds"] > 0 and r["sync_seconds"] > 0
        assert r["bytes"] == sum(f.stat().st_size for f in Path(r["path"]).iterdir() if f.name != "COMPLETE")
    assert "background" not in saves[12]  # the last step saves in the foreground
    from pgs.runtime.tools.report import read_metrics

    report = read_metrics(str(tmp_path / "bg" / "metrics.jsonl"))  # events logged late start no new run
    assert report.earlier_runs == 0 and [x for x, _ in report.series["loss"]] == list(range(1, 13))


def test_sigkill_while_the_thread_writes_then_resume_auto_is_bit_exact(tmp_path, foreground, capfd):
    """Killed halfway through the background write of step_8 (the training thread is already
    past step 8): step_8 never appears, step_4 is resumed from, the end equals an
    uninterrupted run's (``foreground``: one thread, as the child processes here)."""
    spec = tiny_spec(tmp_path, "run", steps=12, every=4)
    first = launch(spec, args=BACKGROUND, **Faults(crash_at=("checkpoint_write", 8)).env())
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert ckpt.problem(str(run_dir / "step_4")) is None and not (run_dir / "step_8").exists()
    capfd.readouterr()
    assert run_here(spec, "--resume", "auto", *BACKGROUND) == 0  # in this process, one thread
    err = capfd.readouterr().err
    assert "resumed from" in err and "step_4" in err
    for step in (8, 12):
        assert_same_checkpoint(run_dir / f"step_{step}", foreground / f"step_{step}")
    assert [r["loss"] for r in step_records(run_dir)] == [r["loss"] for r in step_records(foreground)]


def test_a_halt_waits_for_the_save_in_flight(tmp_path, monkeypatch, capsys):
    """NaN losses from step 5 on halt the run (exit 81) while step_4 is still being written
    (the writer is slowed down): the exit waits, and step_4 is complete."""
    from pgs.errors import EXIT_SKIP_CAP
    from pgs.runtime.loop import train

    real = ckpt.write_safetensors
    release = threading.Event()

    def slow(*args, **kwargs):
        release.wait(2.0)  # longer than steps 5-7 take on the CPU
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_safetensors", slow)
    spec = tiny_spec(tmp_path, "run", steps=12, every=4, max_skips=3)
    from pgs.runtime.spec.load import load_spec

    loaded = load_spec(str(spec), overrides=["checkpoint.background=true"])
    code = train.run(loaded, faults=Faults(nan_steps={5, 6, 7, 8}))
    assert code == EXIT_SKIP_CAP == 81
    run_dir = tmp_path / "run"
    assert ckpt.problem(str(run_dir / "step_4")) is None
    assert (run_dir / "HALT.json").exists()
    assert any(r.get("event") == "checkpoint" and r["step"] == 4 for r in records(run_dir))


def test_sigterm_while_a_save_is_in_flight_waits_for_it_then_saves_and_exits_143(tmp_path, monkeypatch):
    """SIGTERM arrives while the thread writes step_4 (the writer sends it, then takes its time):
    the run stops at the next step boundary, step_4 completes, the stop's own checkpoint is
    written in the foreground after it, and the exit is 128 + 15."""
    import os

    from pgs.runtime.loop import train
    from pgs.runtime.spec.load import load_spec

    real = ckpt.write_safetensors
    sent = []
    waiting = threading.Event()  # the training thread waits for the save in flight
    wait = background.BackgroundSaver.wait

    def waited(self):
        waiting.set()
        return wait(self)

    def held(path, *args, **kwargs):
        if ".step_4.tmp-" in str(path) and not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
            # the save stays in flight until the stop waits for it: an event, not a duration
            assert waiting.wait(timeout=600), "the stop never waited for the save in flight"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(background.BackgroundSaver, "wait", waited)
    monkeypatch.setattr(ckpt, "write_safetensors", held)
    loaded = load_spec(str(tiny_spec(tmp_path, "run", steps=12, every=4)), overrides=["checkpoint.background=true"])
    assert train.run(loaded) == 128 + signal.SIGTERM
    run_dir = tmp_path / "run"
    events = [r for r in records(run_dir) if r.get("event") in ("checkpoint", "stop")]
    assert [e["event"] for e in events] == ["checkpoint", "checkpoint", "stop"]
    assert events[0]["step"] == 4 and events[0]["background"] is True
    stop_step = events[2]["step"]
    assert 4 < stop_step < 12 and events[1]["step"] == stop_step and "background" not in events[1]
    for step in (4, stop_step):
        assert ckpt.problem(str(run_dir / f"step_{step}")) is None
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_are_copied_into_pinned_memory_ahead_of_the_next_steps_kernels(tmp_path):
    """On the GPU the snapshot's copies are queued, not waited for; the next step's in-place
    updates, queued right after on the same stream, must not reach the files."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {f"w{i}": torch.randn(1024, 1024, device="cuda", generator=g) for i in range(8)}
    state = {"m": torch.randn(4096, 1024, device="cuda", generator=g).bfloat16(), "host": torch.randn(1000)}
    expected = {k: v.cpu().clone() for k, v in {**weights, **state}.items()}
    saver = background.BackgroundSaver()
    written = {}

    def write(snap):
        assert not snap["model"]["w0"].is_cuda and not snap["optimizer"]["host"].is_cuda
        written.update({k: v.clone() for group in snap.values() for k, v in group.items()})
        return True

    torch.cuda.synchronize()
    saver.start(write, {"model": weights, "optimizer": state})
    for t in [*weights.values(), state["m"]]:  # "the next step", queued behind the copies
        t.mul_(-3.0).add_(7.0)
    state["host"].zero_()
    assert saver.close() is True
    for k, v in expected.items():
        assert torch.equal(written[k], v), k


def test_reserve_makes_the_buffers_a_snapshot_then_reuses():
    _, tensors, _, optimizer = _state()
    snap = background.Snapshot()
    snap.reserve({"model": tensors, "optimizer": optimizer})
    held = snap.nbytes
    assert held >= sum(t.numel() * t.element_size() for t in [*tensors.values(), *optimizer.values()])
    copies, _ = snap.take({"model": tensors, "optimizer": optimizer})
    assert snap.nbytes == held and torch.equal(copies["optimizer"]["mu"], optimizer["mu"])
    snap.release()


def _two_rank_spec(tmp_path, name: str, background_saves: bool):
    path = tiny_spec(tmp_path, name, steps=8, every=2, keep=0, export="true")
    text = path.read_text().replace("grad_accum = 2", "grad_accum = 1")  # the same micro-batches on 2 ranks
    if background_saves:
        text = text.replace("[checkpoint]\n", "[checkpoint]\nbackground = true\n")
    path.write_text(text)
    return path


def test_two_ranks_write_dcp_checkpoints_in_the_background_and_resume_from_them(tmp_path):
    """Two gloo ranks: DCP saves at steps 2, 4, 6 written on each rank's thread (rank 0
    publishing), the last one in the foreground; the weights equal a foreground run's, and a
    resume from the background-written step_4 ends on the same bits."""
    from pgs.runtime.store import dcp

    fg, bg = _two_rank_spec(tmp_path, "fg", False), _two_rank_spec(tmp_path, "bg", True)
    assert "background = true" in bg.read_text()
    for spec in (fg, bg):
        done = torchrun(spec)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert_same_weights(final_weights(tmp_path / "fg"), final_weights(tmp_path / "bg"), "background vs foreground")
    run_dir = tmp_path / "bg"
    saves = {r["step"]: r for r in records(run_dir) if r.get("event") == "checkpoint"}
    assert sorted(saves) == [2, 4, 6, 8]
    assert all(saves[s].get("background") is True for s in (2, 4, 6)) and "background" not in saves[8]
    for step in (2, 4, 6, 8):
        assert dcp.problem(str(run_dir / f"step_{step}")) is None
        assert json.loads((run_dir / f"step_{step}" / "dcp.json").read_text())["world_size"] == 2
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name]

    import shutil

    for name in ("step_6", "step_8", "final"):
        shutil.rmtree(run_dir / name)
    done = torchrun(bg, "auto")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"resumed from {run_dir / 'step_4'}" in done.stderr
    assert_same_weights(final_weights(tmp_path / "fg"), final_weights(run_dir), "resumed from a background save")


def test_another_process_s_failed_save_stops_this_one_with_the_same_exit(tmp_path, monkeypatch, capsys):
    """The processes agree on a background save's failure (``control.SAVE_FAILED``): a process
    whose own save succeeded raises too when another's filled its disk (exit 84, the folder
    named), at the same step.  Simulated here by an agreement that reports a full disk.

    The save's end is an event the test fixes, not a race with training: each background save
    is waited for right after it is handed to the thread, so the step-4 save has ended before
    step 5's agreement, which is where the run must stop (before step 5's record)."""
    from pgs.errors import EXIT_DISK_FULL
    from pgs.runtime.loop import control

    real = control.agree
    submit = background.BackgroundSaver.submit

    def submit_and_let_it_end(self, job):
        submit(self, job)
        concurrent.futures.wait([self._pending])  # ended (or failed); still pending until collected

    monkeypatch.setattr(background.BackgroundSaver, "submit", submit_and_let_it_end)

    def other_rank_full(flags):
        out = real(flags)
        if len(out) > control.SAVE_FAILED and not out[control.SAVE_RUNNING] and step_folder_written():
            out[control.SAVE_FAILED] = background.DISK_FULL
        return out

    def step_folder_written():
        return (tmp_path / "run" / "step_4").exists()

    monkeypatch.setattr(control, "agree", other_rank_full)
    code = _run(tiny_spec(tmp_path, "run", steps=12, every=4), *BACKGROUND)
    err = capsys.readouterr().err
    assert code == EXIT_DISK_FULL == 84
    line = next(x for x in err.splitlines() if x.startswith("pgs: error"))
    assert line.startswith(f"pgs: error: disk full while writing the checkpoint {tmp_path / 'run' / 'step_4'}")
    steps = [r["step"] for r in step_records(tmp_path / "run")]
    assert steps == [1, 2, 3, 4]  # stopped at the first boundary after the save ended, not at the next save
