"""Fault injection over the classes of bad input that used to end in a traceback, a hang or a
silent drop (issue 44): each must now end with the documented exit code (docs/exit-codes.md),
exactly one ``pgs: error:`` line, no traceback, and nothing an earlier run wrote changed.

Every case runs ``pgs run SPEC --resume auto`` (and ``pgs validate`` where it reads the same
input) against the folder of a finished tiny run, in this process; a case that would hang (a
FIFO read, ``/dev/zero``) is cut off by an alarm and fails instead of hanging the suite.
The run-folder lock and the data's content fingerprint have their own modules
(tests/integration/test_run_lock.py, tests/integration/test_data_fingerprint.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pgs import cli
from pgs.runtime import userpath
from helpers import error_line, tiny_spec

HANG_GUARD_S = 300  # a case still running after this hung (the alarm fails it)


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A finished tiny run: its spec, and every file of its folder with its bytes."""
    folder = tmp_path_factory.mktemp("earlier")
    spec = tiny_spec(folder, "run", steps=4, every=4)
    assert cli.main(["run", str(spec)]) == 0
    return spec, _files(folder / "run")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_hang():
    def hung(signum, frame):
        raise AssertionError(f"still running after {HANG_GUARD_S} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_GUARD_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def refused(argv: list[str], capsys, code: int = 2) -> str:
    """``pgs ARGV`` exits ``code`` with one ``pgs: error:`` line and no traceback; the line."""
    got = cli.main(argv)
    _, err = capsys.readouterr()
    line = error_line(err)
    assert got == code, (got, line)
    return line


def _special(tmp_path: Path, kind: str) -> Path:
    """A path of ``kind``: a character device, a FIFO, a symbolic-link loop, a NUL byte."""
    if kind == "device":
        return Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    if kind == "loop":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
        return tmp_path / "a"
    return tmp_path / "with\0nul"


WHY = {"device": "a character device, not a regular file", "fifo": "a FIFO (named pipe), not a regular file",
       "loop": "a loop of symbolic links", "nul": "a path with a NUL byte in it"}


@pytest.mark.parametrize("kind", sorted(WHY))
def test_a_special_file_as_the_spec_is_one_line(kind, tmp_path, capsys, no_hang):
    path = _special(tmp_path, kind)
    for command in ("run", "validate"):
        line = refused([command, str(path)], capsys)
        assert line == f"pgs: error: {path}: {WHY[kind]}; expected a spec file (.toml)", line


@pytest.mark.parametrize("kind", sorted(WHY))
def test_a_special_file_as_data_is_one_line_and_changes_nothing(kind, tmp_path, capsys, earlier, no_hang):
    spec, before = earlier
    path = _special(tmp_path, kind)
    source = 'data.sources=[{ path = "' + str(path).replace("\0", "\\u0000") + '" }]'  # TOML spells NUL \u0000
    for command in (["run", str(spec), "--resume", "auto"], ["validate", str(spec)]):
        line = refused([*command, "--set", source], capsys)
        assert line.startswith("pgs: error: data.sources[0].path: ") and WHY[kind] in line, line
    assert _files(spec.parent / "run") == before


def test_an_unreadable_spec_or_data_file_is_one_line(tmp_path, capsys, earlier, monkeypatch):
    """Permission bits do not stop root, who runs some CI: the refusal is checked by making
    ``os.access`` deny the files, which is what ``userpath`` asks."""
    spec, before = earlier
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": []}\n')
    denied = {str(spec), str(data)}
    real = os.access
    monkeypatch.setattr(userpath.os, "access", lambda p, mode, **kw: os.fspath(p) not in denied and real(p, mode, **kw))
    assert refused(["run", str(spec)], capsys) == (f"pgs: error: {spec}: not readable (permission denied); "
                                                   "expected a spec file (.toml)")
    monkeypatch.setattr(userpath.os, "access", lambda p, mode, **kw: os.fspath(p) != str(data) and real(p, mode, **kw))
    line = refused(["run", str(spec), "--resume", "auto", "--set", f'data.sources=[{{ path = "{data}" }}]'], capsys)
    assert line == f"pgs: error: data.sources[0].path: {data} is not readable (permission denied)"
    assert _files(spec.parent / "run") == before


@pytest.mark.parametrize("assignment,expected", [
    ("train.steps=99999999999999999999", "train.steps: 99999999999999999999 is out of range"),
    ("train.seed=99999999999999999999", "train.seed: 99999999999999999999 is out of range"),
    ("train.seed=-99999999999999999999", "train.seed: -99999999999999999999 is out of range"),
    ("data.seed=18446744073709551616", "data.seed: 18446744073709551616 is out of range"),
    ("optimizer.args={ weight_decay = 1e400 }", "optimizer.args.weight_decay: inf is not a finite number"),
    ("loss.z_loss=inf", "loss.z_loss: inf is not a finite number"),
    ("loss.z_loss=nan", "loss.z_loss: nan is not a finite number"),
    ('checkpoint.dir=""', "checkpoint.dir: expected the run folder's path, got an empty string"),
    ("train.steps=1500\nseed = 3", "--set: '1500\\nseed = 3' is more than one TOML value"),
])
def test_a_field_out_of_range_or_a_dropped_line_is_one_line_and_changes_nothing(assignment, expected, capsys,
                                                                                earlier, no_hang):
    spec, before = earlier
    for command in (["run", str(spec), "--resume", "auto"], ["run", str(spec), "--overwrite"], ["validate", str(spec)]):
        line = refused([*command, "--set", assignment], capsys)
        assert line.startswith(f"pgs: error: {expected}"), line
    assert _files(spec.parent / "run") == before
    assert not [p for p in spec.parent.iterdir() if ".old-" in p.name]  # --overwrite moved nothing


@pytest.mark.parametrize("argv,expected", [
    (["validate", "{spec}", "--records", "-5"], "pgs: error: argument --records: expected an integer >= 0, got -5"),
    (["data", "inspect", "{spec}", "--records", "-5"], "pgs: error: argument --records: expected an integer >= 0"),
    (["data", "inspect", "{spec}", "-n", "-1"], "pgs: error: argument -n: expected an integer >= 0, got -1"),
    (["run", "{spec}", "--nproc", "0"], "pgs: error: argument --nproc: expected an integer >= 1, got 0"),
    (["run", "{spec}", "--bogus"], "pgs: error: unrecognized arguments: --bogus"),
])
def test_a_bad_flag_is_blamed_on_the_flag_in_one_line(argv, expected, capsys, earlier):
    spec, before = earlier
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.format(spec=spec) for a in argv])
    assert exit_.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(expected), line
    assert _files(spec.parent / "run") == before


def test_pgs_data_without_a_subcommand_prints_its_own_usage(capsys):
    assert cli.main(["data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pgs data ") and "inspect" in err and "Traceback" not in err, err
    assert "--measure" not in err  # not pgs profile's usage


def test_a_string_where_a_boolean_goes_is_one_line(capsys, earlier):
    spec, before = earlier
    for field in ("data.packing", "data.last_turn_only", "checkpoint.export"):
        line = refused(["run", str(spec), "--resume", "auto", "--set", f'{field}="yes"'], capsys)
        assert line == f"pgs: error: {field}: expected true or false, got a string ('yes')", line
    assert _files(spec.parent / "run") == before


BAD_RECORDS = {
    "deep": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "malformed JSON (nested too deep for a record)"),
    "surrogate": ('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}',
                  "malformed JSON (a lone UTF-16 surrogate in a string"),
    "speaker": ('{"conversations": [{"from": ["human"], "value": "hi"}, {"from": "gpt", "value": "ok"}]}',
                "turn 0: unknown speaker ['human']"),
}


@pytest.mark.parametrize("name", sorted(BAD_RECORDS))
def test_a_malformed_record_is_one_line_naming_file_and_line(name, tmp_path, capsys, earlier):
    spec, before = earlier
    text, expected = BAD_RECORDS[name]
    data = tmp_path / "train.jsonl"
    data.write_text(text + "\n")
    for command in (["run", str(spec), "--resume", "auto"], ["validate", str(spec)]):
        line = refused([*command, "--set", f'data.sources=[{{ path = "{data}" }}]'], capsys)
        assert line.startswith(f"pgs: error: {data}:1: {expected}"), line
    assert _files(spec.parent / "run") == before


def test_pgs_report_with_something_in_the_way_is_one_line(tmp_path, capsys):
    (tmp_path / "a" / "metrics.jsonl").mkdir(parents=True)
    line = refused(["report", str(tmp_path / "a")], capsys)
    assert line == f"pgs: error: {tmp_path / 'a' / 'metrics.jsonl'}: a folder, expected the run's metrics file"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "b" / "report").write_text("mine")
    line = refused(["report", str(tmp_path / "b")], capsys)
    assert line.startswith(f"pgs: error: {tmp_path / 'b' / 'report'}: a file is in the way of the report folder")
    assert (tmp_path / "b" / "report").read_text() == "mine"


def test_a_checkpoint_whose_manifest_lists_no_files_is_refused_in_one_line(tmp_path, capsys, earlier):
    spec, before = earlier
    folder = tmp_path / "step_4"
    folder.mkdir()
    (folder / "COMPLETE").write_text('{"format": 2, "step": 4, "chunk_bytes": 8388608, "files": {}}')
    line = refused(["run", str(spec), "--resume", str(folder)], capsys)
    assert "the COMPLETE manifest lists no files" in line, line
    assert _files(spec.parent / "run") == before


def test_a_disk_that_fills_while_metrics_are_written_is_exit_84_in_one_line(tmp_path, capsys, monkeypatch, one_thread):
    import errno

    from pgs.runtime.loop import metrics

    class FillsUp:
        """metrics.jsonl on a disk that takes three lines, then is full."""

        def __init__(self, inner):
            self.inner, self.lines = inner, 0

        def write(self, text):
            self.lines += 1
            if self.lines > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.inner.write(text)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real = metrics.MetricsLog.__init__

    def opened(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self._file = FillsUp(self._file)

    monkeypatch.setattr(metrics.MetricsLog, "__init__", opened)
    spec = tiny_spec(tmp_path, "run", steps=8, every=2)
    code = cli.main(["run", str(spec)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [x for x in err.splitlines() if x.startswith("pgs: error:")]
    assert code == 84 and len(errors) == 1, err
    assert errors[0].startswith(f"pgs: error: disk full while writing the metrics {tmp_path / 'run' / 'metrics.jsonl'}")


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_a_chat_template_with_a_syntax_error_is_blamed_on_the_template(on_bad_record, tmp_path, capsys, earlier):
    """Not on record 1 of the data, and not skipped record by record with ``on_bad_record = "skip"``."""
    spec, before = earlier
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}\n")
    sets = ["--set", f'data.chat_template="{template}"', "--set", f'data.on_bad_record="{on_bad_record}"']
    for command in (["run", str(spec), "--resume", "auto"], ["validate", str(spec)]):
        line = refused([*command, *sets], capsys)
        assert line == f"pgs: error: data.chat_template: {template}:2: Jinja syntax error: unexpected '}}'", line
    assert _files(spec.parent / "run") == before
