"""The checkpoint manifest's file digest: sha256 over 8 MiB chunks, hashed in parallel.

One sha256 over a whole file is a single sequential pass at one core's speed, slower than the
page cache takes the bytes, so it would set the pace of every save (docs/performance.md,
"Checkpoint saves").  The chunks of a file are independent, so this digest hashes them on
several threads::

    chunk_i = file[i·C : min((i+1)·C, size)]        C = 8 MiB, i = 0 .. ceil(size / C) - 1
    digest  = sha256( sha256(chunk_0) ‖ sha256(chunk_1) ‖ … )   (raw 32-byte digests; sha256(b"") when empty)

It detects the same damage as a whole-file sha256 (any changed, missing or added byte changes
a chunk's digest, and the chunk count follows from the size); to check a file by hand::

    import hashlib
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            parts.append(hashlib.sha256(chunk).digest())
    hashlib.sha256(b"".join(parts)).hexdigest()

``ChunkedDigest`` computes it from bytes as they are written (the safetensors writer feeds it
each piece it writes); ``file_digest`` from a file on disk (the manifest's small text files,
and the check before a resume), reading chunks in parallel.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK_BYTES = 8 << 20
NAME = "sha256_chunks"  # the manifest's key for this digest


def workers() -> int:
    """Threads for hashing: the CPUs this process may run on, at most 8 (hashlib releases the
    GIL, so each thread hashes at a core's speed; 8 already outrun the disk)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


class ChunkedDigest:
    """The digest of a byte stream fed in order by ``update``.

    ``update(data, pool)`` splits ``data`` at chunk boundaries and hashes the parts on
    ``pool`` (inline without one); it returns their futures, and the caller must wait for them
    before the next ``update`` and before it reuses ``data``'s buffer.  Within one call every
    chunk receives at most one part, so no hasher is touched by two threads at once.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.size = 0
        self._digests: list[bytes | None] = []
        self._open = None  # the hashlib object of the chunk being filled

    def _whole(self, index: int, part) -> None:
        self._digests[index] = hashlib.sha256(part).digest()

    def _part(self, hasher, index: int | None, part) -> None:
        hasher.update(part)
        if index is not None:  # the part completed its chunk
            self._digests[index] = hasher.digest()

    def update(self, data, pool: ThreadPoolExecutor | None = None) -> list[Future]:
        view = memoryview(data).cast("B")
        futures: list[Future] = []
        pos = 0
        while pos < len(view):
            index, inside = divmod(self.size, self.chunk_bytes)
            take = min(self.chunk_bytes - inside, len(view) - pos)
            part = view[pos:pos + take]
            if index == len(self._digests):
                self._digests.append(None)
            if inside == 0 and take == self.chunk_bytes:
                task = (self._whole, index, part)
            else:
                if inside == 0:
                    self._open = hashlib.sha256()
                task = (self._part, self._open, index if inside + take == self.chunk_bytes else None, part)
            if pool is None:
                task[0](*task[1:])
            else:
                futures.append(pool.submit(*task))
            pos += take
            self.size += take
        return futures

    def hexdigest(self) -> str:
        """The digest of everything fed so far (every ``update``'s futures done)."""
        digests = list(self._digests)
        if digests and digests[-1] is None:  # a last, partial chunk
            digests[-1] = self._open.copy().digest()
        return hashlib.sha256(b"".join(digests)).hexdigest()


def file_digest(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES, *, threads: int | None = None) -> str:
    """The digest of the file at ``path``, its chunks read and hashed on ``threads`` threads."""
    size = os.path.getsize(path)
    count = -(-size // chunk_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(i: int) -> bytes:
            want = min(chunk_bytes, size - i * chunk_bytes)
            data = os.pread(fd, want, i * chunk_bytes)
            if len(data) != want:  # the file shrank while it was read
                raise OSError(f"{path}: short read at byte {i * chunk_bytes}")
            return hashlib.sha256(data).digest()

        n = threads or workers()
        if count <= 1 or n == 1:
            digests = [one(i) for i in range(count)]
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="pgs-digest") as pool:
                digests = list(pool.map(one, range(count)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(digests)).hexdigest()
