"""Where records come from: JSONL, JSON arrays, Parquet, Arrow files and ``datasets`` folders.

Every reader gives the same three things, so that the index, the mix, packing and exact resume
(``sources.SourceIndex``, ``stream.TrainStream``) are the same for all of them:

* ``scan()``: every record in file order, as ``(locator, label, raw)``, streaming;
* ``read(locator)``: one record again, by its locator, without reading the others;
* ``record(raw, origin)``: the decoded record (a ``dict`` for a good one).

The *locator* is what ``read`` needs (a byte offset in a JSONL file, a character offset in a
JSON array, a row number in a table); the *label* is what an error names: ``file:line`` for
JSONL, ``file:item N`` for JSON arrays, ``file:row N`` for tables (items and rows count from 0,
as ``records[N]`` and ``dataset[N]`` do).

Which reader: a folder is a ``datasets`` folder (``Dataset.save_to_disk``); ``.parquet`` is
Parquet (read one row group at a time; ``read`` decodes the row group of a row and keeps the
last few); ``.arrow`` is an Arrow IPC file or stream, memory-mapped (what ``datasets`` writes);
anything else is JSON: an array when its first character is ``[``, JSON Lines otherwise.
pyarrow and datasets are the optional extra ``pgs[data]``, imported only when such a source is
read.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from typing import Any, Iterator

from pgs.errors import DataError, MissingExtra
from pgs.runtime.data.records import Conversation, conversation, decode_object, iter_lines, json_reason, read_line

TABLE_SUFFIXES = (".parquet", ".arrow")
#: decoded Parquet row groups kept for ``read`` (a window's draws fall in few of them when the
#: row groups are large, in many when the data is shuffled over many small ones)
ROW_GROUP_CACHE = 4


def _import(name: str, path: str):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        package = name.split(".")[0]
        raise MissingExtra(f"{path}: reading it needs {package}, which is not installed "
                           "(pip install 'pgs[data]')") from None


class Reader:
    """One source's records (see the module docstring); subclasses fill in the three methods.

    ``_transient`` names the open files and caches: ``None`` until used, and left out of a
    pickled copy (the loader's worker process reopens them); ``ORIGIN`` is how an error names a
    record."""

    _transient: tuple[str, ...] = ()
    ORIGIN = "{path}:row {label}"

    def __init__(self, path: str):
        self.path = path
        for key in self._transient:
            setattr(self, key, None)

    def origin(self, label: int) -> str:
        return self.ORIGIN.format(path=self.path, label=label)

    def scan(self) -> Iterator[tuple[int, int, Any]]:
        raise NotImplementedError

    def read(self, locator: int) -> Any:
        raise NotImplementedError

    def record(self, raw: Any, origin: str) -> Any:
        return raw

    def close(self) -> None:
        """Let go of open files and caches (``read`` opens them again)."""

    def __getstate__(self):
        return {key: (None if key in self._transient else value) for key, value in self.__dict__.items()}


class JsonLinesReader(Reader):
    """One JSON object per line; blank lines are skipped; labels are line numbers."""

    _transient = ("_handle",)
    ORIGIN = "{path}:{label}"

    def scan(self):
        for number, offset, raw in iter_lines(self.path):
            yield offset, number, raw

    def read(self, locator: int) -> bytes:
        if self._handle is None:
            self._handle = open(self.path, "rb")
        self._handle.seek(locator)
        return read_line(self._handle)

    def record(self, raw, origin):
        return decode_object(raw, origin)

    def close(self):
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _text(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class JsonArrayReader(Reader):
    """A JSON file holding one array of objects; labels are item numbers (from 0).

    The file is decoded item by item and only the items' offsets are kept; ``read`` decodes one
    item again.  A syntax error ends the array (nothing after it can be read), so it fails the
    source whatever ``on_bad_record`` says."""

    _transient = ("_text",)
    ORIGIN = "{path}:item {label}"

    def _loaded(self) -> str:
        if self._text is None:
            self._text = _text(self.path)
        return self._text

    def scan(self):
        text, decoder = self._loaded(), json.JSONDecoder()
        i = _skip_space(text, 0)
        if i == len(text) or text[i] != "[":
            raise DataError(f"{self.path}: expected a JSON array of records (or one JSON object per line)")
        i = _skip_space(text, i + 1)
        if i < len(text) and text[i] == "]":
            return
        n = 0
        while True:
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as err:
                raise DataError(f"{self.origin(n)}: malformed JSON ({json_reason(err)})") from None
            yield i, n, value
            i = _skip_space(text, end)
            if i < len(text) and text[i] == ",":
                i, n = _skip_space(text, i + 1), n + 1
                continue
            if i < len(text) and text[i] == "]":
                return
            line = text.count("\n", 0, i) + 1
            raise DataError(f"{self.origin(n)}: malformed JSON (expected ',' or ']' after the item at line {line})")

    def read(self, locator: int):
        return json.JSONDecoder().raw_decode(self._loaded(), locator)[0]

    def record(self, raw, origin):
        if not isinstance(raw, dict):
            raise DataError(f"{origin}: expected a JSON object per item, got {type(raw).__name__}")
        return raw

    def close(self):
        self._text = None


class ParquetReader(Reader):
    """A Parquet file, one row group at a time."""

    _transient = ("_file", "_groups", "_starts")

    def _opened(self):
        if self._file is None:
            pq = _import("pyarrow.parquet", self.path)
            try:
                self._file = pq.ParquetFile(self.path)
            except Exception as err:  # pyarrow's ArrowInvalid and OSError: the user's file
                raise DataError(f"{self.path}: not a readable Parquet file ({_first_line(err)})") from None
            meta = self._file.metadata
            starts, total = [], 0
            for g in range(meta.num_row_groups):
                starts.append(total)
                total += meta.row_group(g).num_rows
            self._starts = starts
            self._groups = OrderedDict()
        return self._file

    def _group(self, g: int):
        self._opened()
        table = self._groups.get(g)
        if table is None:
            try:
                table = self._file.read_row_group(g)
            except Exception as err:
                raise DataError(f"{self.path}: row group {g} cannot be read ({_first_line(err)})") from None
            self._groups[g] = table
            while len(self._groups) > ROW_GROUP_CACHE:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(g)
        return table

    def scan(self):
        self._opened()
        for g, start in enumerate(self._starts):
            for r, row in enumerate(self._group(g).to_pylist()):
                yield start + r, start + r, row

    def read(self, locator: int):
        self._opened()
        g = bisect.bisect_right(self._starts, locator) - 1
        return self._group(g).slice(locator - self._starts[g], 1).to_pylist()[0]

    def close(self):
        self._file, self._groups = None, None


class ArrowReader(Reader):
    """An Arrow IPC file or stream (``datasets`` writes streams), memory-mapped; or, given a
    ``datasets`` folder, the dataset ``load_from_disk`` maps."""

    _transient = ("_table",)
    BATCH = 1024

    def _load(self):
        if os.path.isdir(self.path):
            return _dataset_table(self.path)
        pa = _import("pyarrow", self.path)
        try:
            source = pa.memory_map(self.path)
            try:
                return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                return pa.ipc.open_stream(pa.memory_map(self.path)).read_all()
        except Exception as err:  # pyarrow's ArrowInvalid and OSError: the user's file
            raise DataError(f"{self.path}: not a readable Arrow file ({_first_line(err)})") from None

    def _opened(self):
        if self._table is None:
            self._table = self._load()
        return self._table

    def scan(self):
        table = self._opened()
        for start in range(0, table.num_rows, self.BATCH):
            for r, row in enumerate(table.slice(start, self.BATCH).to_pylist()):
                yield start + r, start + r, row

    def read(self, locator: int):
        return self._opened().slice(locator, 1).to_pylist()[0]

    def close(self):
        self._table = None


def _dataset_table(path: str):
    """The Arrow table of a ``Dataset.save_to_disk`` folder (memory-mapped by ``datasets``)."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise DataError(f"{path}: a DatasetDict with splits {', '.join(splits)}; point the source at one of them "
                        f"({os.path.join(path, splits[0] if splits else 'train')})")
    if not os.path.exists(os.path.join(path, "state.json")):
        raise DataError(f"{path}: a folder, but not one saved by datasets' save_to_disk (no state.json)")
    datasets = _import("datasets", path)
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as err:  # a folder datasets cannot read: the user's data
        raise DataError(f"{path}: datasets cannot load it ({_first_line(err)})") from None
    if getattr(dataset, "_indices", None) is not None:
        dataset = dataset.flatten_indices()
    return dataset.data.table


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _first_char(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(4096)
                if not chunk:
                    return b""
                stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
                if stripped:
                    return stripped[:1]
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None


def open_reader(path: str) -> Reader:
    """The reader for ``path`` (see the module docstring for how it is chosen)."""
    if os.path.isdir(path):
        return ArrowReader(path)
    lower = path.lower()
    if lower.endswith(".parquet"):
        return ParquetReader(path)
    if lower.endswith(".arrow"):
        return ArrowReader(path)
    if _first_char(path) == b"[":
        return JsonArrayReader(path)
    return JsonLinesReader(path)


def _source_args(source) -> tuple[str, str, dict[str, str]]:
    if isinstance(source, (str, os.PathLike)):
        return str(source), "auto", {}
    return source.path, source.format, source.fields()


def read_conversations(source, format: str | None = None, on_bad_record: str = "error",
                       skipped: list | None = None) -> Iterator[Conversation]:
    """Stream the valid conversations of one source (a ``DataSource``, or a path read with
    ``format``, ``"auto"`` by default), in file order.

    With ``on_bad_record="skip"`` a bad record is left out and its ``DataError`` message is
    appended to ``skipped`` (when given), so nothing is lost silently.
    """
    path, source_format, fields = _source_args(source)
    reader = open_reader(path)
    format = format or source_format
    try:
        for _, label, raw in reader.scan():
            origin = reader.origin(label)
            try:
                yield conversation(reader.record(raw, origin), origin, format, fields)
            except DataError as err:
                if on_bad_record != "skip":
                    raise
                if skipped is not None:
                    skipped.append(str(err))
    finally:
        reader.close()


def has_records(path: str) -> bool:
    """Whether the source holds at least one record (good or bad)."""
    reader = open_reader(path)
    try:
        return next(iter(reader.scan()), None) is not None
    finally:
        reader.close()
