"""Issue 29, items 2 and 3: a disk that fills mid-checkpoint, and a run folder used twice.

Both through ``pgs run`` end to end on tests/helpers.py's tiny spec, in this process (the
full disk is injected by making the safetensors writer ``write_safetensors`` or a file write
raise what a full disk raises).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pgs import cli
from pgs.errors import EXIT_BAD_INPUT, EXIT_DISK_FULL
from pgs.runtime.store import checkpoint as ckpt
from pgs.runtime.store import dcp
from helpers import records, step_records, tiny_spec


pytestmark = pytest.mark.usefixtures("one_thread")


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("pgs: error")]


def _safetensors_enospc(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


def _os_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_from(step: int, where: str, raise_fn, monkeypatch):
    """Make the checkpoint of ``step`` (and any later one) hit a full disk at ``where``."""
    real = {"write_safetensors": ckpt.write_safetensors, "_write_text": ckpt._write_text}[where]

    def writer(*args, **kwargs):  # write_safetensors(path, tensors, ...), _write_text(path, text)
        if any(f".step_{step}.tmp-" in str(a) for a in args[:2]):
            raise_fn()
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, where, writer)


@pytest.mark.parametrize("where, raise_fn, args", [
    ("write_safetensors", _safetensors_enospc, ()), ("write_safetensors", _os_enospc, ()), ("_write_text", _os_enospc, ()),
    ("write_safetensors", _os_enospc, ("--set", "checkpoint.background=true"))],
    ids=["safetensors", "writer-oserror", "oserror", "background"])
def test_disk_full_mid_checkpoint_is_one_line_exit_84_and_resume_continues(tmp_path, monkeypatch, capsys,
                                                                           where, raise_fn, args):
    """``background``: step 8 is written on the save thread (checkpoint.background) while
    training goes on; its failure stops the run at the next step boundary the same way."""
    spec = tiny_spec(tmp_path, "run", steps=12, every=4)
    run_dir = tmp_path / "run"
    _full_from(8, where, raise_fn, monkeypatch)
    code = cli.main(["run", str(spec), *args])
    err = capsys.readouterr().err
    assert code == EXIT_DISK_FULL == 84, err[-3000:]
    assert "Traceback" not in err
    lines = _error_lines(err)
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("pgs: error: disk full while writing the checkpoint ")
    assert str(run_dir / "step_8") in line and "bytes of weights + optimizer state" in line
    assert f"{run_dir / 'step_4'} is intact" in line and "--resume auto" in line
    # the bytes named are the weights + optimizer state of a checkpoint
    need = int(line.split("it needs about ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    written = sum((run_dir / "step_4" / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors"))
    assert 0.9 * written < need < 1.1 * written
    # no temporary left, the previous checkpoint intact, nothing published for step 8
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]
    assert not (run_dir / "step_8").exists()
    assert ckpt.problem(str(run_dir / "step_4")) is None

    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "step_4" in err
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 13))
    assert ckpt.problem(str(run_dir / "step_12")) is None


def test_disk_full_while_exporting_final_is_exit_84(tmp_path, monkeypatch, capsys):
    from pgs.runtime.store import export

    spec = tiny_spec(tmp_path, "run", steps=3, every=3, export="true")

    def full(*args, **kwargs):
        raise _os_enospc()

    monkeypatch.setattr(export, "write_safetensors", full)
    assert cli.main(["run", str(spec)]) == EXIT_DISK_FULL
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "disk full while writing the export" in lines[0] and "final" in lines[0]
    run_dir = tmp_path / "run"
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name] and not (run_dir / "final").exists()
    assert ckpt.problem(str(run_dir / "step_3")) is None


def _os_read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def test_a_run_folder_that_turns_read_only_mid_run_is_one_line_exit_84_and_resume_continues(
        tmp_path, monkeypatch, capsys):
    """The filesystem remounted read-only (or the write permission taken away) while the run
    goes on: the checkpoint's write fails, the line says so (not "disk full"), exit 84, the
    earlier checkpoint intact; the metrics' writer says the same of its own failed write."""
    spec = tiny_spec(tmp_path, "run", steps=12, every=4)
    run_dir = tmp_path / "run"
    _full_from(8, "write_safetensors", _os_read_only, monkeypatch)
    code = cli.main(["run", str(spec)])
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert code == EXIT_DISK_FULL and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pgs: error: the run folder can no longer be written (read-only or permission "
                               f"denied) while writing the checkpoint {run_dir / 'step_8'}; the previous "
                               f"checkpoint {run_dir / 'step_4'} is intact; make the folder writable")
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 13))

    from pgs.errors import DiskFull
    from pgs.runtime.loop.metrics import MetricsLog

    class ReadOnly:
        def write(self, text):
            _os_read_only()

        def flush(self):
            pass

    (tmp_path / "other").mkdir()
    log = MetricsLog(str(tmp_path / "other"), total_steps=20)
    log._file.close()
    log._file = ReadOnly()  # its filesystem now refuses writes
    with pytest.raises(DiskFull, match=r"^the run folder can no longer be written .* the records from step 13 on "
                                       r"are lost; .*make the folder writable"):
        log.write({"step": 13, "loss": 1.0})


def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt, "write_safetensors", denied)
    with pytest.raises(OSError, match="Input/output"):
        ckpt.save(str(tmp_path), 1, model=torch.nn.Linear(2, 2), optimizer_state={}, rng={}, trainer={},
                  spec_toml="")


def test_is_disk_full_reads_errno_text_and_causes():
    assert ckpt.is_disk_full(OSError(errno.ENOSPC, "x"))
    assert ckpt.is_disk_full(OSError(errno.EDQUOT, "x"))
    # a folder that can no longer be written ends the run the same way (exit 84), said as such
    assert ckpt.write_failure(OSError(errno.EACCES, "Permission denied")) == "read-only"
    assert ckpt.write_failure(OSError(errno.EROFS, "x")) == "read-only"
    assert ckpt.write_failure(OSError(errno.ENOSPC, "x")) == "full"
    assert ckpt.write_failure(OSError(errno.EIO, "Input/output error")) is None
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert ckpt.is_disk_full(outer)


def test_dcp_save_on_a_full_disk_removes_its_temporary(tmp_path, monkeypatch):
    """The sharded path (one process, no group): DCP's writer hits a full disk."""
    import pgs.func as pf
    from pgs.errors import DiskFull
    from pgs.runtime.optim.bound import bind
    from torch.distributed.checkpoint import FileSystemWriter

    model = torch.nn.Linear(4, 4)
    opt = bind(pf.adamw(1e-3), model)
    dcp.save(str(tmp_path), 1, model=model, optimizer=opt, trainer={"n": 1}, spec_toml="")

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(DiskFull, match="step_2") as err:
        dcp.save(str(tmp_path), 2, model=model, optimizer=opt, trainer={"n": 2}, spec_toml="")
    assert err.value.exit_code == EXIT_DISK_FULL
    assert "step_1" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


# -- a run folder used twice ------------------------------------------------------------------
def test_a_second_run_into_a_used_folder_is_refused(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=3, every=3)
    run_dir = tmp_path / "run"
    assert cli.main(["run", str(spec)]) == 0
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert cli.main(["run", str(spec)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"pgs: error: checkpoint.dir: {run_dir} already holds a run (metrics.jsonl, step_3")
    assert "--resume auto" in err and "--overwrite" in err
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing appended

    # --resume auto continues it (here: nothing left to do)
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3]


def test_overwrite_moves_the_old_run_aside(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=3, every=3)
    run_dir = tmp_path / "run"
    assert cli.main(["run", str(spec)]) == 0
    old_weights = load_file(run_dir / "step_3" / "model.safetensors")
    capsys.readouterr()
    assert cli.main(["run", str(spec), "--set", "train.steps=4", "--set", "checkpoint.every=4", "--overwrite"]) == 0
    err = capsys.readouterr().err
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and f"moved the previous run to {aside[0]}" in err
    assert sorted(p.name for p in aside[0].iterdir() if p.name.startswith("step_")) == ["step_3"]
    moved = load_file(aside[0] / "step_3" / "model.safetensors")
    assert all(torch.equal(moved[k], old_weights[k]) for k in moved)
    # the new run is alone in its folder: one fresh start, steps once
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]
    assert [r["event"] for r in records(run_dir) if "event" in r] == ["start", "checkpoint", "done"]
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_")) == ["step_4"]


def test_overwrite_and_resume_exclude_each_other(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=3)
    assert cli.main(["run", str(spec), "--overwrite", "--resume", "auto"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "--resume" in err


def test_resume_auto_on_an_empty_folder_starts_fresh(tmp_path, capsys):
    spec = tiny_spec(tmp_path, "run", steps=3, every=3)
    (tmp_path / "run").mkdir()
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    assert [r["step"] for r in step_records(tmp_path / "run")] == [1, 2, 3]
    assert "resumed" not in capsys.readouterr().err


def test_a_folder_without_a_run_is_not_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "metrics.jsonl").write_text("")
    assert ckpt.existing_run(str(run_dir)) == []
    ckpt.refuse_existing_run(str(run_dir))
    assert ckpt.move_aside(str(run_dir)) is None and run_dir.is_dir()


def test_report_after_overwrite_and_resume_reads_one_run(tmp_path, capsys):
    """End to end: a killed-before-checkpoint run continued with --resume auto (no checkpoint:
    a fresh start appended to the same file) reports only the new run."""
    from pgs.runtime.tools.report import read_metrics

    spec = tiny_spec(tmp_path, "run", steps=3, every=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3, 4)))
    assert cli.main(["run", str(spec), "--resume", "auto"]) == 0
    m = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [x for x, _ in m.series["loss"]] == [1, 2, 3] and 9.0 not in [v for _, v in m.series["loss"]]
    assert m.earlier_runs == 1
