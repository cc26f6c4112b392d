"""Sources on disk and the deterministic order in which their records are drawn.

Each source is indexed once (one streaming pass that validates every record and keeps the
locators of the good ones: byte offsets, item offsets, row numbers); records are then read one
at a time by locator, never all at once.  The mixed order is a pure function of the seed and a few counters:

* which source the ``k``-th draw comes from: a hash of ``(seed, k)`` turned into a uniform
  number and compared with the cumulative weights, so proportions converge to the weights;
* which record: each source walks its own permutation, reshuffled every epoch of that
  source from ``(seed, source, epoch)``.

The counters (draws, and per source its epoch and cursor) are the whole state: plain ints.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from array import array

import numpy as np

from pgs.errors import DataError
from pgs.runtime.data.config import DataSource
from pgs.runtime.data.readers import open_reader
from pgs.runtime.data.records import Conversation, conversation
from pgs.runtime.data.stats import DataStats
from pgs.runtime.store.digest import file_digest

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, k: int) -> float:
    """A uniform number in [0, 1) determined by ``(seed, k)`` alone."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ k) >> 11) / float(1 << 53)


class SourceIndex:
    """The valid records of one source (JSONL, JSON array, Parquet, Arrow, ``datasets`` folder),
    by locator: every record is validated once, bad ones raise or are counted, and the good
    ones are read again one at a time (``readers``)."""

    def __init__(self, source: DataSource, on_bad_record: str = "error", stats: DataStats | None = None):
        self.source = source
        self.path = source.path
        self.reader = open_reader(self.path)
        self._fields = source.fields()
        self.offsets = array("q")
        self.lines = array("q")
        self.skipped: list[str] = []
        for locator, label, raw in self.reader.scan():
            origin = self.reader.origin(label)
            try:
                conversation(self.reader.record(raw, origin), origin, source.format, self._fields)
            except DataError as err:
                if on_bad_record != "skip":
                    raise
                self.skipped.append(str(err))
                continue
            self.offsets.append(locator)
            self.lines.append(label)
        if stats is not None:
            stats.bad_records += len(self.skipped)
        if not self.offsets:
            raise DataError(f"{self.path}: no valid records")
        self.digest = content_digest(self.path)


    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> Conversation:
        origin = self.reader.origin(self.lines[i])
        raw = self.reader.read(self.offsets[i])
        return conversation(self.reader.record(raw, origin), origin, self.source.format, self._fields)

    def close(self) -> None:
        self.reader.close()


def content_digest(path: str) -> str:
    """What a resume compares to know the source is the one the checkpoint read: the sha256
    over 8 MiB chunks of its bytes (``pgs.runtime.store.digest.file_digest``, the chunks hashed
    on several threads); for a folder (a ``datasets`` folder), the sha256 of each file's
    relative name and digest, in name order.  A record edited in place, same size and count,
    changes it; a copy or a touch (a new mtime) does not."""
    try:
        if not os.path.isdir(path):
            return file_digest(path)
        whole = hashlib.sha256()
        for folder, subfolders, files in os.walk(path):
            subfolders.sort()
            for name in sorted(files):
                full = os.path.join(folder, name)
                whole.update(f"{os.path.relpath(full, path)}\0{file_digest(full)}\0".encode())
        return whole.hexdigest()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err})") from None


class MixedOrder:
    """The infinite, deterministic sequence of ``(source, record)`` draws of a weighted mix."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        self.sizes = list(sizes)
        self.seed = int(seed)
        total = float(sum(weights))
        self._cumulative = list(np.cumsum([w / total for w in weights]))
        self._cumulative[-1] = 1.0
        self.draws = 0
        self.epochs = [0] * len(sizes)
        self.cursors = [0] * len(sizes)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _permutation(self, s: int) -> np.ndarray:
        cached = self._perms.get(s)
        if cached is None or cached[0] != self.epochs[s]:
            rng = np.random.default_rng([self.seed, s, self.epochs[s]])
            cached = (self.epochs[s], rng.permutation(self.sizes[s]))
            self._perms[s] = cached
        return cached[1]

    def pick_source(self, k: int) -> int:
        if len(self.sizes) == 1:
            return 0
        return min(bisect.bisect_right(self._cumulative, uniform(self.seed, k)), len(self.sizes) - 1)

    def next(self) -> tuple[int, int]:
        s = self.pick_source(self.draws)
        self.draws += 1
        record = int(self._permutation(s)[self.cursors[s]])
        self.cursors[s] += 1
        if self.cursors[s] == self.sizes[s]:
            self.cursors[s] = 0
            self.epochs[s] += 1
        return s, record

    @property
    def epoch(self) -> int:
        """Complete passes over the whole mix: every source seen that many times at least."""
        return min(self.epochs)

    def state_dict(self) -> dict:
        return {"draws": self.draws, "epochs": list(self.epochs), "cursors": list(self.cursors)}

    def load_state_dict(self, state: dict) -> None:
        self.draws = int(state["draws"])
        self.epochs = [int(e) for e in state["epochs"]]
        self.cursors = [int(c) for c in state["cursors"]]
