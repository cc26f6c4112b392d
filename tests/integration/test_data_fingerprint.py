"""The resume fingerprint covers the data's content (``sources.content_digest``): a record edited
in place — the same size, the same record count — is refused with one line naming the file,
where before the fingerprint (path, format, weight, record count) let the resume go on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pgs import cli
from pgs.errors import DataError
from pgs.runtime.data import DataConfig, DataSource, TrainStream
from pgs.runtime.data.sources import content_digest
from helpers import QUICKSTART, cli_error, quickstart_head, records, tiny_spec


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))


def _edit_in_place(path: Path) -> None:
    """Change one character of the last record's answer: the same size, the same records."""
    lines = path.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[-1])
    text = record["messages"][-1]["content"]
    record["messages"][-1]["content"] = text[:-1] + ("1" if text[-1] != "1" else "2")
    edited = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    assert len(edited) == len(lines[-1]) and edited != lines[-1]
    lines[-1] = edited
    size = path.stat().st_size
    path.write_bytes(b"".join(lines))
    assert path.stat().st_size == size


def _config(path: Path) -> DataConfig:
    return DataConfig(sources=[DataSource(str(path))], max_seq_len=96)


def test_a_record_edited_in_place_is_refused_on_resume(tmp_path, tok):
    data = quickstart_head("train.jsonl", 40, tmp_path / "train.jsonl")
    stream = TrainStream(_config(data), tok, pack_window=8)
    stream.next_batch(2)
    state = json.loads(json.dumps(stream.state_dict()))
    _edit_in_place(data)
    resumed = TrainStream(_config(data), tok, pack_window=8)
    assert len(resumed._sources[0]) == len(stream._sources[0])  # the record count did not change
    with pytest.raises(DataError) as err:
        resumed.load_state_dict(state)
    message = str(err.value)
    assert "\n" not in message and f"{data}: the content changed since the checkpoint" in message


def test_a_copy_or_a_new_mtime_resumes_and_a_checkpoint_without_content_resumes(tmp_path, tok):
    data = quickstart_head("train.jsonl", 40, tmp_path / "train.jsonl")
    stream = TrainStream(_config(data), tok, pack_window=8)
    stream.next_batch(2)
    state = json.loads(json.dumps(stream.state_dict()))
    expected = stream.next_batch(2).input_ids.tolist()
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(data, copy)  # a new inode and mtime, the same bytes
    assert content_digest(str(copy)) == content_digest(str(data))
    data.touch()
    again = TrainStream(_config(data), tok, pack_window=8)
    again.load_state_dict(state)
    assert again.next_batch(2).input_ids.tolist() == expected
    older = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "content"}}
    before = TrainStream(_config(data), tok, pack_window=8)  # a checkpoint of pgs before the digest
    before.load_state_dict(older)
    assert before.next_batch(2).input_ids.tolist() == expected


def test_a_datasets_folder_digest_sees_each_file(tmp_path):
    folder = tmp_path / "ds"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.arrow").write_bytes(b"abc")
    (folder / "sub" / "b.arrow").write_bytes(b"def")
    first = content_digest(str(folder))
    (folder / "sub" / "b.arrow").write_bytes(b"deg")
    assert content_digest(str(folder)) != first


def test_pgs_run_resume_after_an_edit_in_place_is_refused_with_one_line(tmp_path, capsys, one_thread):
    data = quickstart_head("train.jsonl", 64, tmp_path / "train.jsonl")
    spec = tiny_spec(tmp_path, "run", steps=4, every=4)
    spec.write_text(spec.read_text().replace("pgs:quickstart/train.jsonl", str(data)))
    assert cli.main(["run", str(spec)]) == 0
    capsys.readouterr()
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    _edit_in_place(data)
    code, line = cli_error(["run", str(spec), "--resume", "auto"], capsys)
    assert code == 2 and f"{data}: the content changed since the checkpoint" in line, line
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before  # the refused resume wrote nothing
    assert [r["event"] for r in records(tmp_path / "run") if "event" in r].count("resume") == 0
