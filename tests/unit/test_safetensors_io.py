"""pgs.runtime.store.safetensors_io: the streaming writer writes what safetensors' save_file writes."""

from __future__ import annotations

import errno
import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pgs.runtime.store import safetensors_io as sio
from pgs.runtime.store.digest import file_digest


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "w.bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "b.bf16": torch.randn(3, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(4, 3, 2, generator=g),
        "fp16": torch.randn(9, generator=g).half(),
        "fp64": torch.randn(2, generator=g).double(),
        "int8": torch.randint(-128, 127, (11,), dtype=torch.int8, generator=g),
        "uint8": torch.randint(0, 255, (6, 2), dtype=torch.uint8, generator=g),
        "int16": torch.randint(-9, 9, (3,), dtype=torch.int16, generator=g),
        "int32": torch.randint(-9, 9, (3,), dtype=torch.int32, generator=g),
        "int64": torch.randint(-2**40, 2**40, (5,), dtype=torch.int64, generator=g),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar.fp32": torch.tensor(3.5),
        "scalar.int64": torch.tensor(7),
        "scalar.bool": torch.tensor(True),
        "empty": torch.zeros(0, 4),
        "empty.bf16": torch.zeros(3, 0, dtype=torch.bfloat16),
        "Zeta": torch.ones(1),
        "é.unicode": torch.ones(2),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["fp8"] = torch.randn(4, generator=g).to(torch.float8_e4m3fn)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (compares float8 and NaNs exactly)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def assert_same_tensors(path, expected):
    got = load_file(str(path))
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bytes_of(got[k]), _bytes_of(v)), k


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {"pgs": "optimizer"}])
def test_bytes_equal_save_file(tmp_path, metadata):
    tensors = mixed()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    sio.write(tmp_path / "ours.safetensors", tensors, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_empty_file_equals_save_file(tmp_path):
    save_file({}, str(tmp_path / "ref.safetensors"))
    sio.write(tmp_path / "ours.safetensors", {})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_several_metadata_keys_sorted_otherwise_equal(tmp_path):
    """safetensors writes ``__metadata__`` in a hash map's order; ours sorts it: same header
    length, same JSON, same data."""
    tensors = mixed()
    metadata = {"pgs": "model", "format": "pt", "a": "1"}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    sio.write(tmp_path / "ours.safetensors", tensors, metadata)
    ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
    n = struct.unpack("<Q", ours[:8])[0]
    assert ours[:8] == ref[:8] and ours[8 + n:] == ref[8 + n:]
    assert json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + n])
    assert list(json.loads(ours[8:8 + n])["__metadata__"]) == ["a", "format", "pgs"]


def test_small_chunks_non_contiguous_and_shared_storage(tmp_path):
    """Views of one buffer (as compile-bound parameters are), transposed, strided and expanded
    tensors, written in pieces smaller than a row: the file equals save_file's of copies."""
    flat = torch.arange(4 * 6 * 5, dtype=torch.float32)
    big = torch.randn(7, 3, 5)
    tensors = {
        "a": flat[:24].view(4, 6),
        "b": flat[24:].view(4, 6, 4),
        "overlap": flat[10:40],
        "t": flat[:24].view(4, 6).t(),
        "strided": big[:, 1, ::2],
        "perm": big.permute(2, 0, 1),
        "expanded": torch.arange(3, dtype=torch.int64).view(3, 1).expand(3, 4),
        "bf16.t": big.to(torch.bfloat16).transpose(0, 2),
        "bool.strided": (big > 0)[::2],
    }
    copies = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(copies, str(tmp_path / "ref.safetensors"), metadata={"x": "y"})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    for chunk in (1, 3, 7, 16, 64, 1 << 20):
        digest = sio.write(tmp_path / "ours.safetensors", tensors, {"x": "y"}, chunk_bytes=chunk)
        assert (tmp_path / "ours.safetensors").read_bytes() == ref, chunk
        assert digest == file_digest(tmp_path / "ours.safetensors"), chunk  # the digest of the bytes written


def test_large_pieces_hashed_beside_the_write_give_the_file_s_digest(tmp_path, monkeypatch):
    """Pieces of at least ``OVERLAP_BYTES`` are hashed on worker threads during the write, cut
    at the digest's chunk boundaries: the digest still equals the file's, for pieces above, at
    and below the threshold and the chunk size."""
    from pgs.runtime.store import digest

    monkeypatch.setattr(sio, "OVERLAP_BYTES", 4096)
    monkeypatch.setattr(digest, "CHUNK_BYTES", 3000)
    monkeypatch.setattr(sio, "ChunkedDigest", lambda: digest.ChunkedDigest(3000))
    g = torch.Generator().manual_seed(3)
    tensors = {"big": torch.randn(300, 100, generator=g), "t": torch.randn(64, 90, generator=g).t(),
               "small": torch.arange(7, dtype=torch.int32)}
    for chunk in (1000, 4096, 8192, 1 << 20):
        got = sio.write(tmp_path / "f.safetensors", tensors, {"k": "v"}, chunk_bytes=chunk)
        data = (tmp_path / "f.safetensors").read_bytes()
        assert got == file_digest(tmp_path / "f.safetensors", 3000), chunk
        assert got == hashlib.sha256(b"".join(hashlib.sha256(data[i:i + 3000]).digest()
                                              for i in range(0, len(data), 3000))).hexdigest()
    assert_same_tensors(tmp_path / "f.safetensors", {k: v.contiguous() for k, v in tensors.items()})


def test_early_writeback_covers_the_file_in_order_and_changes_no_byte(tmp_path, monkeypatch):
    """Every ``WRITEBACK_BYTES`` the writer asks the kernel to write back what it wrote since
    the last time, and again (to drop the pages by then clean) the range before it: the ranges
    asked tile the file from its start, each at most two steps long; the bytes are safetensors'."""
    import os

    calls = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((offset, length, os.fstat(fd).st_size))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setattr(sio, "WRITEBACK_BYTES", 5_000)
    g = torch.Generator().manual_seed(4)
    tensors = {"a": torch.randn(100, 100, generator=g), "b": torch.randn(37, 29, generator=g).t()}
    sio.write(tmp_path / "f.safetensors", tensors, chunk_bytes=4096)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"))
    data = (tmp_path / "f.safetensors").read_bytes()
    assert data == (tmp_path / "ref.safetensors").read_bytes()
    assert len(calls) >= 4
    before = advised = 0
    for offset, length, size in calls:
        assert offset == before and offset + length == size  # from the range before the last one to what is written
        assert size - advised >= 5_000 and size <= len(data)
        before, advised = advised, size


def test_pieces_stay_bounded():
    t = torch.randn(100, 30).t()  # non-contiguous, rows of 400 bytes
    for limit in (64, 400, 1000, 4096):
        sizes = [p.numel() for p in sio.pieces(t, limit)]
        assert max(sizes) <= limit and sum(sizes) == t.numel() * 4
    sizes = [p.numel() for p in sio.pieces(torch.randn(1000), 100)]
    assert max(sizes) == 100 and sum(sizes) == 4000


def test_parameters_and_grad_tensors(tmp_path):
    layer = torch.nn.Linear(3, 2)
    sio.write(tmp_path / "p.safetensors", dict(layer.named_parameters()))
    assert_same_tensors(tmp_path / "p.safetensors", {k: v.detach() for k, v in layer.named_parameters()})


def test_safe_open_reads_it(tmp_path):
    tensors = mixed()
    sio.write(tmp_path / "m.safetensors", tensors, {"format": "pt"})
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for k in ("w.bf16", "scalar.int64", "empty", "bool"):
            assert torch.equal(f.get_tensor(k), tensors[k])


def test_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(TypeError):
        sio.write(tmp_path / "x", {"a": [1, 2]})
    with pytest.raises(ValueError, match="sparse"):
        sio.write(tmp_path / "x", {"a": torch.eye(2).to_sparse()})
    with pytest.raises(TypeError, match="metadata"):
        sio.write(tmp_path / "x", {}, {"a": 1})


def test_failed_write_removes_the_partial_file(tmp_path, monkeypatch):
    calls = []

    def full(handle, host):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        handle.write(memoryview(host.numpy()))

    monkeypatch.setattr(sio, "_write_all", full)
    with pytest.raises(OSError) as err:
        sio.write(tmp_path / "x.safetensors", {"a": torch.randn(100)}, chunk_bytes=64)
    assert err.value.errno == errno.ENOSPC
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stream_through_pinned_pieces(tmp_path):
    g = torch.Generator().manual_seed(1)
    host = {
        "w": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "m": torch.randn(40, 9, generator=g),
        "i": torch.arange(50, dtype=torch.int64),
        "s": torch.tensor(2.0),
        "e": torch.zeros(0, 3),
    }
    flat = torch.randn(200, generator=g).cuda()
    cuda = {k: v.cuda() for k, v in host.items()}
    cuda["view.a"], cuda["view.b"] = flat[:100].view(10, 10), flat[100:].view(10, 10).t()
    host["view.a"], host["view.b"] = flat[:100].view(10, 10).cpu(), flat[100:].view(10, 10).t().contiguous().cpu()
    cuda["t"], host["t"] = cuda["m"].t(), host["m"].t().contiguous()
    save_file(host, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    for chunk in (16, 100, 1 << 20):
        digest = sio.write(tmp_path / "ours.safetensors", cuda, {"format": "pt"}, chunk_bytes=chunk)
        assert (tmp_path / "ours.safetensors").read_bytes() == ref, chunk
        assert digest == file_digest(tmp_path / "ours.safetensors"), chunk


def test_lazy_read_of_save_file_output(tmp_path):
    tensors = mixed()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    lazy = sio.read(tmp_path / "ref.safetensors")
    assert lazy.metadata == {"format": "pt"} and set(lazy) == set(tensors) and len(lazy) == len(tensors)
    for k, v in tensors.items():
        got = lazy[k]
        assert got.dtype == v.dtype and got.shape == v.shape and lazy.shape(k) == tuple(v.shape), k
        assert torch.equal(_bytes_of(got), _bytes_of(v)), k
    assert lazy["w.bf16"] is not lazy["w.bf16"]  # read afresh each time


def test_lazy_read_refuses_a_cut_file(tmp_path):
    sio.write(tmp_path / "a.safetensors", {"x": torch.randn(100)})
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="data_offsets"):
        sio.read(tmp_path / "b.safetensors")
    (tmp_path / "c.safetensors").write_bytes(data[:5])
    with pytest.raises(ValueError, match="not a safetensors file"):
        sio.read(tmp_path / "c.safetensors")
