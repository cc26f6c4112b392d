"""``pgs.runtime.pinned``: host buffers at their own size, and the pool that reuses them by size
(page-locking itself needs CUDA: tests/unit/test_checkpoint_offload.py and tests/unit/test_offload.py)."""

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


def test_pool_lends_a_free_buffer_of_up_to_twice_the_bytes_and_takes_it_back_whole():
    pool = HostPool(pin=False)
    big = pool.take((100,), torch.float32)  # 400 bytes
    ptr = big.data_ptr()
    pool.give(big)
    small = pool.take((30, 2), torch.float32)  # 240 bytes: the 400-byte buffer, its first 240
    assert pool.made == 1 and small.data_ptr() == ptr and small.shape == (30, 2)
    tiny = pool.take((10,), torch.float32)  # 40 bytes: no free buffer within twice that, a new one
    assert pool.made == 2 and tiny.data_ptr() != ptr
    pool.give(small)  # the whole 400 bytes come back, not the 240 viewed
    again = pool.take((100,), torch.float32)
    assert pool.made == 2 and again.data_ptr() == ptr
    pool.give(tiny)
    exact = pool.take((5, 2), torch.float32)  # an exact fit wins over a larger free buffer
    assert exact.data_ptr() == tiny.data_ptr()


def test_pool_of_varying_sizes_grows_with_the_widest_not_with_every_width():
    """Rows as wide as each step's longest completion (distillation): the pool makes buffers when
    a wider row than any before comes, not once per width."""
    pool = HostPool(pin=False)
    g = torch.Generator().manual_seed(0)
    widths = (512 + torch.randint(0, 257, (200,), generator=g)).tolist()
    records = 0
    for i, w in enumerate(widths):
        held = [pool.take((w, 8), torch.bfloat16) for _ in range(4)]  # four layers' inputs per step
        records += w > max(widths[:i], default=0)
        for t in held:
            pool.give(t)
    assert len(set(widths)) > 120  # most steps a width not seen before
    assert pool.made == 4 * records and records < 12


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
