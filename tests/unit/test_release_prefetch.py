"""CUDAPrefetcher: passthrough on CPU (order, identity, structures), real copies on CUDA."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import pytest
import torch

from pgs.runtime.data.prefetch import CUDAPrefetcher, map_tensors, tensors_of


class Pair(NamedTuple):
    x: torch.Tensor
    tag: str


@attrs.frozen
class Packed:
    input_ids: torch.Tensor
    cu_seqlens: list
    num_docs: int


def make_batches(n=5):
    return [{"ids": torch.full((2, 3), i), "pair": Pair(torch.tensor([i]), f"b{i}"), "n": i} for i in range(n)]


def test_cpu_is_a_passthrough_in_order():
    data = make_batches()
    out = list(CUDAPrefetcher(data, "cpu"))
    assert len(out) == len(data)
    assert all(a is b for a, b in zip(out, data))
    assert len(CUDAPrefetcher(data, "cpu")) == 5


def test_cpu_passthrough_of_a_generator_and_errors():
    def gen():
        yield torch.zeros(1)
        yield torch.ones(1)
        raise RuntimeError("loader broke")

    it = iter(CUDAPrefetcher(gen(), "cpu"))
    assert float(next(it)) == 0 and float(next(it)) == 1
    with pytest.raises(RuntimeError, match="loader broke"):
        next(it)
    assert list(CUDAPrefetcher([], "cpu")) == []


def test_map_tensors_walks_batch_structures():
    b = Packed(torch.arange(4), [torch.tensor([0, 4])], 1)
    doubled = map_tensors(lambda t: t * 2, {"a": [b, (torch.ones(1),)], "s": "x"})
    assert torch.equal(doubled["a"][0].input_ids, torch.arange(4) * 2)
    assert torch.equal(doubled["a"][0].cu_seqlens[0], torch.tensor([0, 8]))
    assert doubled["a"][0].num_docs == 1 and doubled["s"] == "x"
    assert len(tensors_of(make_batches(1)[0])) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_ahead_in_order():
    data = make_batches(6) + [Packed(torch.arange(4), [torch.tensor([0, 4])], 1)]
    out = []
    for batch in CUDAPrefetcher(data, "cuda"):
        for t in tensors_of(batch):
            assert t.is_cuda
        out.append(batch)
        torch.cuda._sleep(1000)  # some compute for the next copy to overlap
    for i, batch in enumerate(out[:6]):
        assert int(batch["ids"][0, 0]) == i and batch["pair"].tag == f"b{i}" and batch["n"] == i
    assert torch.equal(out[6].input_ids.cpu(), torch.arange(4))
