"""pgs.runtime.store.digest: the checkpoint manifest's chunked sha256, streamed and from a file.

Property: for any bytes, any chunk size and any way of cutting the stream into ``update``
calls, inline or on a thread pool, ``ChunkedDigest`` equals the definition computed directly
(sha256 of the chunks' raw sha256 digests) and ``file_digest`` of the same bytes on disk.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.runtime.store import digest


def definition(data: bytes, chunk: int) -> str:
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + chunk]).digest()
                                   for i in range(0, len(data), chunk))).hexdigest()


POOL = ThreadPoolExecutor(4)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=600), chunk=st.integers(1, 70), cuts=st.lists(st.integers(0, 600), max_size=8),
       threaded=st.booleans())
def test_streamed_digest_equals_the_definition_for_any_cutting(data, chunk, cuts, threaded):
    d = digest.ChunkedDigest(chunk)
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for a, b in zip(bounds, bounds[1:]):
        for future in d.update(memoryview(data)[a:b], POOL if threaded else None):
            future.result()
    assert d.size == len(data)
    assert d.hexdigest() == definition(data, chunk)
    assert d.hexdigest() == definition(data, chunk)  # reading it changes nothing


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3000), chunk=st.integers(1, 500), threads=st.integers(1, 4))
def test_file_digest_equals_the_definition(tmp_path_factory, data, chunk, threads):
    path = tmp_path_factory.mktemp("digest") / "f.bin"
    path.write_bytes(data)
    assert digest.file_digest(path, chunk, threads=threads) == definition(data, chunk)


def test_empty_stream_and_file_are_sha256_of_nothing(tmp_path):
    empty = hashlib.sha256(b"").hexdigest()
    assert digest.ChunkedDigest().hexdigest() == empty
    (tmp_path / "e").write_bytes(b"")
    assert digest.file_digest(tmp_path / "e") == empty


def test_default_chunk_size_is_8_mib_and_differs_from_a_whole_file_sha256(tmp_path):
    data = bytes(range(256)) * (40_000 * 4 // 256 * 256)  # ~10 MB: two chunks
    (tmp_path / "f").write_bytes(data)
    assert digest.CHUNK_BYTES == 8 << 20
    got = digest.file_digest(tmp_path / "f")
    assert got == definition(data, 8 << 20) != hashlib.sha256(data).hexdigest()


def test_refuses_a_non_positive_chunk():
    with pytest.raises(ValueError, match="chunk_bytes"):
        digest.ChunkedDigest(0)
