"""Sources other than JSONL (JSON arrays, Parquet, Arrow files, ``datasets`` folders) behind the
same index: the same conversations, the same mixed and packed stream, exact resume, and the
loader's worker process."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pgs.errors import DataError, MissingExtra
from pgs.runtime.data import DataConfig, DataSource, TrainStream, read_conversations
from pgs.runtime.data.loader import StepLoader
from pgs.runtime.data.readers import open_reader
from pgs.runtime.data.synthetic import generate, write_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

N = 48


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")


def write_all(folder, records) -> dict[str, str]:
    """The same records as JSONL, a JSON array, Parquet (row groups of 7 rows), a datasets folder
    and that folder's Arrow file."""
    paths = {"jsonl": str(folder / "data.jsonl"), "json": str(folder / "data.json"),
             "parquet": str(folder / "data.parquet"), "datasets": str(folder / "saved")}
    write_jsonl(paths["jsonl"], records)
    with open(paths["json"], "w") as handle:
        json.dump(records, handle, indent=1)
    table = pa.Table.from_struct_array(pa.array(records))  # the columns of every row, not of the first only
    pq.write_table(table, paths["parquet"], row_group_size=7)
    datasets.Dataset(table).save_to_disk(paths["datasets"])
    (arrow,) = sorted((folder / "saved").glob("*.arrow"))
    paths["arrow"] = str(arrow)
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    return write_all(folder, generate(N, seed=3, weather_share=0.5))


FORMATS = ["json", "parquet", "datasets", "arrow"]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_reads_the_conversations_of_the_jsonl(files, kind):
    want = list(read_conversations(files["jsonl"]))
    got = list(read_conversations(files[kind]))
    assert [(c.messages, c.tools) for c in got] == [(c.messages, c.tools) for c in want]
    label = "item" if kind == "json" else "row"
    assert [c.origin for c in got] == [f"{files[kind]}:{label} {i}" for i in range(N)]


def test_parquet_reads_row_groups_lazily(files):
    reader = open_reader(files["parquet"])
    assert reader.read(45)["messages"] == reader.read(45)["messages"]
    assert len(reader._groups) == 1  # only the row group of row 45 was decoded
    assert reader._file.metadata.num_row_groups == 7


def batches(stream, n):
    return [stream.next_batch(2) for _ in range(n)]


@pytest.mark.parametrize("kind", FORMATS)
def test_stream_equals_the_jsonl_stream(files, tok, kind):
    a = TrainStream(DataConfig(sources=[files["jsonl"]], max_seq_len=160), tok, pack_window=16)
    b = TrainStream(DataConfig(sources=[files[kind]], max_seq_len=160), tok, pack_window=16)
    for want, got in zip(batches(a, 6), batches(b, 6)):
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.labels.tolist() == want.labels.tolist()


def mixed(files, **kw):
    return DataConfig(sources=[DataSource(files["parquet"], weight=2.0), DataSource(files["json"]),
                               DataSource(files["datasets"])], max_seq_len=160, **kw)


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_resume_of_a_parquet_mix_continues_with_the_next_batch(files, tok, steps):
    stream = TrainStream(mixed(files), tok, pack_window=16)
    for _ in range(steps):
        stream.next_batch(2)
    state = json.loads(json.dumps(stream.state_dict()))
    expected = batches(stream, 3)
    resumed = TrainStream(mixed(files), tok, pack_window=16)
    resumed.load_state_dict(state)
    for want, got in zip(expected, batches(resumed, 3)):
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.labels.tolist() == want.labels.tolist()
    assert resumed.stats.as_dict() == stream.stats.as_dict()
    other = TrainStream(DataConfig(sources=[DataSource(files["parquet"], weight=2.0, messages_field="messages"),
                                            DataSource(files["json"]), DataSource(files["datasets"])],
                                   max_seq_len=160), tok, pack_window=16)
    with pytest.raises(DataError, match="sources"):
        other.load_state_dict(state)


def test_the_loaders_worker_process_reads_parquet_and_arrow(files, tok):
    def steps(worker):
        stream = TrainStream(mixed(files), tok, pack_window=16)
        with StepLoader(stream, micro_batch=2, grad_accum=1, device="cpu", worker=worker) as loader:
            return [loader.next_step()[0].input_ids.tolist() for _ in range(5)]

    assert steps("process") == steps("thread")


def test_named_columns_in_a_table(tmp_path, tok):
    records = [{"conversation": r["messages"], "id": i} for i, r in enumerate(generate(8, seed=4, weather_share=0.0))]
    path = str(tmp_path / "named.parquet")
    pq.write_table(pa.Table.from_pylist(records), path)
    source = DataSource(path, messages_field="conversation")
    assert [c.messages for c in read_conversations(source)] == [r["conversation"] for r in records]
    stream = TrainStream(DataConfig(sources=[source], max_seq_len=160), tok, pack_window=8)
    assert stream.next_batch(1).num_docs >= 1


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    records = generate(4, seed=5, weather_share=0.0)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                          "test": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits test, train; point the source at one of them"):
        list(read_conversations(str(tmp_path / "dd")))
    assert len(list(read_conversations(str(tmp_path / "dd" / "train")))) == 4


def test_a_missing_extra_names_it(tmp_path, monkeypatch, files):
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *args, **kw):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(MissingExtra) as err:
        list(read_conversations(files["parquet"]))
    assert str(err.value) == f"{files['parquet']}: reading it needs pyarrow, which is not installed (pip install 'pgs[data]')"
    assert err.value.exit_code == 2


def test_preference_pairs_from_a_json_array_and_parquet(tmp_path, tok):
    from pgs.runtime.data.preference import read_pairs

    with open("pgs/assets/quickstart/pairs_train.jsonl") as handle:
        records = [json.loads(next(handle)) for _ in range(12)]
    paths = write_all(tmp_path, records)
    config = DataConfig(sources=[paths["jsonl"]], max_seq_len=256)
    want = read_pairs([paths["jsonl"]], tok, config)
    for kind in FORMATS:
        got = read_pairs([paths[kind]], tok, config)
        assert [(p.chosen.input_ids, p.rejected.input_ids, p.chosen.train_mask) for p in got] == \
            [(p.chosen.input_ids, p.rejected.input_ids, p.chosen.train_mask) for p in want]
        label = "item" if kind == "json" else "row"
        assert got[3].chosen.origin == f"{paths[kind]}:{label} 3"
