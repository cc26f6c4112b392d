"""A streaming safetensors writer: tensors on any device, of any layout, through one bounded buffer.

``safetensors.torch.save_file`` needs every tensor as a contiguous CPU tensor that shares
storage with no other (it refuses views of one buffer, which is what parameters bound with
``compile=True`` are), and it has no streaming writer: a caller must first make a full host
copy of everything it saves.  :func:`write` writes the same format itself, one tensor at a
time, each in pieces of at most ``chunk_bytes``:

* a contiguous CPU tensor (pinned host memory included) is written from its own memory;
* a CUDA tensor is copied piece by piece into a reusable pinned bounce buffer (two of them,
  so that the next piece's copy overlaps the file write of this one);
* a non-contiguous tensor is made contiguous a block of rows (dim 0) at a time, recursing
  into a row when one row alone is larger than a piece.

So the host memory a write adds is bounded by about two pieces, whatever the tensors' size.

The layout is the one safetensors' own serializer produces: an 8-byte little-endian header
length, a JSON header (``__metadata__`` first when given, then each tensor's ``dtype``,
``shape`` and ``data_offsets``, compact separators, non-ASCII kept as UTF-8) padded with
spaces to a multiple of 8, then the tensors' bytes back to back in the header's order, which
is by dtype (safetensors' ``Dtype`` enum order, descending: 8-byte types first, ``BOOL``
last) and then by name.  The one difference: safetensors writes the ``__metadata__`` keys in
a hash map's order (it varies between processes); this writer sorts them, so its files are
reproducible.  With at most one metadata key the files are byte-for-byte equal.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Mapping

import torch

from pgs.runtime.store.digest import ChunkedDigest, workers

#: chunk size of a write: the most host memory one piece of a tensor takes
CHUNK_BYTES = 64 << 20


def _dtypes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors dtype name, in safetensors' ``Dtype`` enum order (ascending)."""
    order = [
        ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"),
        ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e8m0fnu", "F8_E8M0"),
        ("int16", "I16"), ("uint16", "U16"), ("float16", "F16"), ("bfloat16", "BF16"),
        ("int32", "I32"), ("uint32", "U32"), ("float32", "F32"),
        ("complex64", "C64"), ("float64", "F64"), ("int64", "I64"), ("uint64", "U64"),
    ]
    return {getattr(torch, name): code for name, code in order if hasattr(torch, name)}


DTYPES = _dtypes()
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}
_BY_CODE = {code: dtype for dtype, code in DTYPES.items()}


def _check(name, t) -> torch.Tensor:
    if not isinstance(name, str):
        raise TypeError(f"safetensors names are strings, got {type(name).__name__} {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: a {t.layout} tensor cannot be saved (strided tensors only)")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
    return t.detach()


def layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in the order their bytes follow each other in the file."""
    items = [(name, _check(name, t)) for name, t in tensors.items()]
    return sorted(items, key=lambda item: (-_RANK[item[1].dtype], item[0].encode("utf-8")))


def header(entries: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None) -> bytes:
    """The file's first bytes: the length (u64, little-endian) and the padded JSON header."""
    head: dict = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata maps strings to strings, got {k!r}: {v!r}")
        head["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, t in entries:
        size = t.numel() * t.element_size()
        head[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element counts as contiguous whatever its stride
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s bytes in row-major order as contiguous flat uint8 tensors of at most ``limit``
    bytes each, on ``t``'s device; only a non-contiguous ``t`` is copied, a block of rows at a time."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        flat = _bytes(t)
        for start in range(0, flat.numel(), limit):
            yield flat[start:start + limit]
        return
    row = (t.numel() // t.shape[0]) * t.element_size()
    if row > limit:
        for i in range(t.shape[0]):
            yield from pieces(t[i], limit)
        return
    rows = max(1, limit // row)
    for start in range(0, t.shape[0], rows):
        yield _bytes(t[start:start + rows].contiguous())


class _Bounce:
    """Two pinned host buffers for device-to-host pieces: while one is written to the file,
    the next piece is copied into the other."""

    def __init__(self, limit: int):
        self.limit = limit  # bytes of each buffer: the largest piece it will hold
        self.buffers: list[torch.Tensor] = []
        self.events: list = []
        self.turn = 0

    def stage(self, piece: torch.Tensor):
        """Start copying ``piece`` (a device tensor) to the host; returns (host view, event)."""
        if not self.buffers:
            self.buffers = [torch.empty(self.limit, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        host = self.buffers[self.turn][:piece.numel()]
        self.turn ^= 1
        with torch.cuda.device(piece.device):
            host.copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return host, event


#: pieces at least this large are hashed on worker threads while the file write runs
OVERLAP_BYTES = 1 << 20


#: early writeback: once this many bytes beyond the last advice are in the page cache, the
#: kernel is asked to start writing them to the disk (``_Sink.writeback``)
WRITEBACK_BYTES = 256 << 20


class _Sink:
    """The open file and the digest of every byte handed to it (``pgs.runtime.store.digest``:
    sha256 over 8 MiB chunks): the checkpoint manifest takes it from here instead of reading
    the file back.

    A large piece's chunks are hashed on worker threads while this thread writes it (hashlib
    and the write system call both release the GIL), so the write runs at the page cache's
    speed rather than one sha256 core's; ``write`` returns once both are done, so the caller
    may reuse the buffer.

    Early writeback (:meth:`writeback`): every ``WRITEBACK_BYTES`` the kernel is told to start
    writing what this file has put in the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``,
    which on Linux starts an asynchronous writeback of the range's dirty pages and drops its
    clean ones).  Without it the disk idles while the file goes to the page cache, the final
    fsync then writes it all (docs/performance.md, "Checkpoint saves"), and a save leaves a
    whole checkpoint of dirty, then cached, pages in host memory."""

    def __init__(self, handle):
        self.handle = handle
        self.digest = ChunkedDigest()
        self._pool: ThreadPoolExecutor | None = None
        self._written = 0  # bytes handed to the file
        self._advised = 0  # writeback was started for [0, _advised)
        self._before = 0  # ... and asked of [_before, _advised) last time (its clean pages dropped next time)

    def write(self, data) -> None:
        if len(data) < OVERLAP_BYTES:
            self.digest.update(data)
            self.handle.write(data)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(workers(), thread_name_prefix="pgs-digest")
            hashed = self.digest.update(data, self._pool)
            try:
                self.handle.write(data)
            finally:
                for future in hashed:
                    future.result()
        self._written += len(data)
        if self._written - self._advised >= WRITEBACK_BYTES:
            self.writeback()

    def writeback(self) -> None:
        """Start the writeback of everything written since the last call, and drop the pages of
        the range before it that are written back by now (a no-op where ``posix_fadvise`` is
        missing)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return
        self.handle.flush()  # what the buffered writer still holds (the header) into the page cache
        advise(self.handle.fileno(), self._before, self._written - self._before, os.POSIX_FADV_DONTNEED)
        self._before, self._advised = self._advised, self._written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def _write_all(sink: _Sink, host: torch.Tensor) -> None:
    sink.write(memoryview(host.numpy()))


def _stream(sink: _Sink, t: torch.Tensor, bounce: _Bounce, limit: int) -> None:
    if t.device.type == "cpu":
        for piece in pieces(t, limit):
            _write_all(sink, piece)
        return
    if t.device.type != "cuda":
        for piece in pieces(t, limit):  # another accelerator: one piece at a time through the host
            _write_all(sink, piece.to("cpu"))
        return
    pending = None  # (host view, event) of the piece being copied
    for piece in pieces(t, limit):
        staged = bounce.stage(piece)
        if pending is not None:
            pending[1].synchronize()
            _write_all(sink, pending[0])
        pending = staged
    if pending is not None:
        pending[1].synchronize()
        _write_all(sink, pending[0])


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
          *, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Write ``tensors`` to ``path`` as a safetensors file, streaming each one's bytes;
    returns the file's digest (``pgs.runtime.store.digest``, hex), computed over the bytes as
    they are written.

    Tensors may live on any device, be non-contiguous and share storage with each other;
    none is copied whole.  Not fsynced (callers that publish a folder fsync it).  A failed
    write removes the partial file and raises (a full disk as ``OSError`` ``ENOSPC``).
    """
    if sys.byteorder != "little":
        raise RuntimeError("the safetensors writer needs a little-endian host")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    entries = layout(tensors)
    head = header(entries, metadata)
    on_cuda = [t.numel() * t.element_size() for _, t in entries if t.device.type == "cuda"]
    bounce = _Bounce(min(chunk_bytes, max(on_cuda, default=0)))
    try:
        with open(path, "wb") as handle:
            sink = _Sink(handle)
            try:
                sink.write(head)
                for _name, t in entries:
                    _stream(sink, t, bounce, chunk_bytes)
            finally:
                sink.close()
    except BaseException:
        try:
            os.remove(path)
        except OSError:
            pass
        raise
    return sink.digest.hexdigest()


class LazyFile(Mapping):
    """A safetensors file as a read-only ``{name: tensor}`` mapping that reads a tensor from the
    file each time it is looked up (plain reads into a fresh CPU tensor, no memory map), so that
    a caller that copies one tensor at a time somewhere else holds one tensor's bytes at most.

    ``metadata``: the file's ``__metadata__`` (empty when it has none).  Only the header is
    read on construction; the names, shapes and dtypes come from it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            text = handle.read(n)
            size = os.fstat(handle.fileno()).st_size
        if len(text) != n:
            raise ValueError(f"{self.path}: not a safetensors file (header of {n} bytes runs past the end)")
        head = json.loads(text.decode("utf-8"))
        self.metadata: dict[str, str] = head.pop("__metadata__", None) or {}
        self.start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in head.items():
            dtype = _BY_CODE.get(entry.get("dtype"))
            if dtype is None:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {entry.get('dtype')!r}, unknown to torch")
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0 or self.start + end > size:
                raise ValueError(f"{self.path}: tensor {name!r}'s data_offsets {[begin, end]} do not fit "
                                 f"its shape {list(shape)} and dtype, or the file")
            self.entries[name] = (dtype, shape, begin, end)

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            target = memoryview(_bytes(out).numpy())
            with open(self.path, "rb") as handle:
                handle.seek(self.start + begin)
                got = handle.readinto(target)
            if got != end - begin:
                raise ValueError(f"{self.path}: tensor {name!r} is cut short ({got} of {end - begin} bytes)")
        return out

    def __contains__(self, name) -> bool:  # from the header (Mapping's default would read the tensor)
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]


def read(path: str | os.PathLike) -> LazyFile:
    """The tensors of a safetensors file, each read from the file when looked up (:class:`LazyFile`)."""
    return LazyFile(path)
