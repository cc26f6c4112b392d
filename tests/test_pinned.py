"""``pgs.runtime.pinned``: host buffers at their own size, and the pool that reuses them by size
(page-locking itself needs CUDA: tests/test_checkpoint_offload.py and tests/test_offload.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from pgs.runtime.pinned import HostPool, host_buffer


def test_host_buffer_without_pinning_is_plain_memory_of_that_size():
    buf, registered = host_buffer(1000, pin=False)
    assert buf.dtype == torch.uint8 and buf.numel() == 1000 and not registered
    assert host_buffer(0, pin=True)[0].numel() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_buffer_is_page_aligned_registered_and_copies_asynchronously():
    buf, registered = host_buffer(20 << 20, pin=True)
    assert registered and buf.numel() == 20 << 20 and buf.data_ptr() % 4096 == 0
    dev = torch.arange(20 << 20, dtype=torch.int64, device="cuda").to(torch.uint8)
    buf.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, dev.cpu())


def test_pool_views_reuses_by_size_and_counts_what_it_made():
    pool = HostPool(pin=False)
    a = pool.take((2, 3, 4), torch.bfloat16)
    assert a.shape == (2, 3, 4) and a.dtype == torch.bfloat16 and a.is_contiguous()
    b = pool.take((6, 4), torch.bfloat16)  # same bytes, another live buffer
    assert pool.made == 2 and pool.bytes == 2 * 48 and a.data_ptr() != b.data_ptr()
    a.fill_(1.5)
    ptr = a.data_ptr()
    pool.give(a)
    assert pool.free_count() == 1
    c = pool.take((12, 2), torch.float32)  # 96 bytes: a different size, a new buffer
    assert pool.made == 3 and c.data_ptr() != ptr
    d = pool.take((4, 2, 3), torch.float16)  # 48 bytes again: the returned buffer, viewed anew
    assert pool.made == 3 and d.data_ptr() == ptr and d.shape == (4, 2, 3) and d.dtype == torch.float16
    assert pool.free_count() == 0
    e = pool.take((0, 5), torch.float32)
    assert e.shape == (0, 5)


def test_pool_give_and_take_from_two_threads_lose_nothing():
    pool = HostPool(pin=False)
    held = [pool.take((256,), torch.float32) for _ in range(64)]
    ptrs = {t.data_ptr() for t in held}

    def give(ts):
        for t in ts:
            pool.give(t)

    threads = [threading.Thread(target=give, args=(held[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    taken = [pool.take((16, 16), torch.float32) for _ in range(32)]  # while the others give
    for t in threads:
        t.join()
    reused = sum(t.data_ptr() in ptrs for t in taken)
    assert pool.free_count() == 64 - reused and pool.made == 64 + (32 - reused)
    rest = [pool.take((256,), torch.float32) for _ in range(64 - reused)]
    assert {t.data_ptr() for t in taken + rest} >= ptrs and pool.free_count() == 0
