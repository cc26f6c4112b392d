"""Page-locked host memory at its own size.

torch's pinned caching allocator (``torch.empty(..., pin_memory=True)``) rounds every block up
to the next power of two: a Qwen3-4B layer input of 1×4096×2560 bf16 (20 MiB) takes 32 MiB of
locked pages, a 14B one (40 MiB) 64 MiB, and an 8 GB optimizer state would take 16 GB.  Locked
pages are the host's scarcest memory (the kernel cannot swap or move them), so pgs registers
ordinary host tensors with ``cudaHostRegister`` instead: the same asynchronous copies, exactly
the bytes asked for.

``host_buffer`` makes one such buffer (the offloaded optimizer state: one buffer for all of
it); ``HostPool`` keeps buffers by size for tensors that come and go every step (the
checkpointed layer inputs of ``pgs.runtime.model.layers.OffloadedInput``), so each size is
registered once per live copy, in the first step, and reused after.
"""

from __future__ import annotations

import math
import threading

import torch

PAGE = 4096


def host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of host memory (uint8), page-locked when ``pin`` (device copies from and to it
    are asynchronous).  Registered with ``cudaHostRegister`` rather than taken from the pinned
    caching allocator; falls back to that allocator if the registration fails.
    ``(buffer, registered)``: a registered buffer stays registered until ``unregister``."""
    if not pin or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8), False
    # registered at page boundaries, whole pages (a view of a slightly larger block)
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    buf = raw[start:start + nbytes]
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), -(-nbytes // PAGE) * PAGE, 0))
    except Exception:  # pragma: no cover - no cudart binding
        err = -1
    if err != 0:  # pragma: no cover - depends on the driver
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    return buf, True


def unregister(buf: torch.Tensor) -> None:
    """Undo ``host_buffer``'s registration (call it while ``buf`` is still alive)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


class HostPool:
    """Host tensors reused by byte size: ``take(shape, dtype)`` hands out a free buffer (or makes
    one with ``host_buffer``) viewed as ``shape``/``dtype``, ``give(t)`` returns it.

    A free buffer of exactly the bytes asked for is taken first (a training run asks for the same
    sizes every step: no byte is locked twice); else the smallest free one of at most twice the
    bytes, its first bytes viewed; else a new one of exactly the bytes.  The second rule bounds
    the pool when the sizes vary from step to step (distillation's rows are as wide as the step's
    longest completion): a new buffer is made only when no free one fits, which, with widths drawn
    at random, happens less and less often (each new widest row), instead of once per width.

    Ordering is the caller's: a buffer may come back while device copies from it are still
    queued, so a caller that copies on several streams must order a new copy into a reused
    buffer after the old one (``OffloadedInput`` issues both directions on one side stream).
    Buffers stay in the pool (and registered) for the process's life, as the caching
    allocator's blocks would: freeing one would first have to wait for the copies queued on it."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a view handed out -> its whole buffer
        self._lock = threading.Lock()  # give() runs on autograd's thread, take() in forward
        self.made = 0  # buffers made so far
        self.bytes = 0  # their bytes

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            size = nbytes if self._free.get(nbytes) else min(
                (s for s, bufs in self._free.items() if bufs and nbytes < s <= 2 * nbytes), default=None)
            buf = self._free[size].pop() if size is not None else None
            if buf is None:
                self.made += 1
                self.bytes += nbytes
        if buf is None:
            buf, _ = host_buffer(nbytes, self.pin)
        with self._lock:
            self._lent[buf.data_ptr()] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor ``take`` handed out (no other use of it may follow)."""
        if t.numel() == 0:
            return
        with self._lock:
            buf = self._lent.pop(t.data_ptr(), None)
            if buf is None:  # not one of ours after all: pooled at its own bytes
                buf = t.reshape(-1).view(torch.uint8)
            self._free.setdefault(buf.numel(), []).append(buf)

    def free_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())
