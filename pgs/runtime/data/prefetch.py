"""Host-to-device prefetch: the next batch is copied while the current step computes.

``CUDAPrefetcher(batches, device)`` wraps any iterable of batches (a tensor, or dicts,
lists, tuples, NamedTuples and attrs classes such as ``PackedBatch`` holding tensors;
other leaves pass through).  On CUDA it keeps one batch in flight: each batch's tensors are
pinned in host memory and copied with ``non_blocking=True`` on a side stream, so the PCIe
transfer of batch k+1 overlaps the forward and backward of batch k.  Handing a batch out makes
the compute stream wait for its copy (an event, not a host sync) and records the tensors on the compute stream so the
caching allocator does not reuse their memory early.

On a CPU device (or without CUDA) it is a passthrough that yields the batches unchanged, in
order, so a training loop can use it unconditionally.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import attrs
import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``fn`` applied to every tensor of a batch: tensors, dicts, lists, tuples, NamedTuples
    and attrs classes (``PackedBatch``); other leaves are returned unchanged."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if attrs.has(type(batch)):
        changes = {(f.alias or f.name): map_tensors(fn, getattr(batch, f.name))
                   for f in attrs.fields(type(batch)) if f.init}
        return attrs.evolve(batch, **changes)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(fn, v)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a batch (the structures ``map_tensors`` walks)."""
    out: list[torch.Tensor] = []
    map_tensors(lambda x: out.append(x) or x, batch)
    return out


def copy_ahead(batch: Any, device: torch.device, stream: "torch.cuda.Stream", *, pin_memory: bool = True):
    """Issue the copy of ``batch``'s tensors to ``device`` on ``stream``; returns ``(moved, ready)``.

    Host tensors are pinned first (unless already pinned, or ``pin_memory`` is off) so that the
    ``non_blocking`` copy is truly asynchronous; ``ready`` is an event recorded on ``stream``
    after the copies.  Nothing waits: hand the batch out with :func:`hand_over`.
    """

    def move(x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and pin_memory and not x.is_pinned():
            x = x.pin_memory()
        return x.to(device, non_blocking=True)

    with torch.cuda.stream(stream):
        moved = map_tensors(move, batch)
        ready = torch.cuda.Event()
        ready.record(stream)
    return moved, ready


def hand_over(batch: Any, ready: "torch.cuda.Event", device: torch.device) -> Any:
    """Make ``device``'s current stream wait for ``ready`` (an event, not a host sync) and record
    the batch's device tensors on it, so the caching allocator does not reuse their memory
    while the compute stream may still read them.  Returns ``batch``."""
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    for x in tensors_of(batch):
        if x.device.type == "cuda":
            x.record_stream(current)
    return batch


class CUDAPrefetcher:
    """Iterate ``batches`` with the next one already on ``device``.  See the module docstring.

    Args:
        batches: any iterable of batches.
        device: the target device (``"cuda"``, ``"cuda:1"``, ``"cpu"``, ...).
        pin_memory: pin host tensors before the copy (needed for a truly asynchronous copy).

    Example::

        for batch in CUDAPrefetcher(loader, "cuda"):
            loss = step(batch)
    """

    def __init__(self, batches: Iterable[Any], device: str | torch.device = "cuda", *, pin_memory: bool = True):
        self.batches = batches
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.active = self.device.type == "cuda" and torch.cuda.is_available()

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if not self.active:
            yield from self.batches
            return
        stream = torch.cuda.Stream(device=self.device)
        source = iter(self.batches)
        pending = self._launch(source, stream)
        while pending is not None:
            batch, ready = pending
            pending = self._launch(source, stream)  # the next copy starts before we hand this one out
            yield hand_over(batch, ready, self.device)

    def _launch(self, source: Iterator[Any], stream: torch.cuda.Stream):
        try:
            batch = next(source)
        except StopIteration:
            return None
        return copy_ahead(batch, self.device, stream, pin_memory=self.pin_memory)
