"""Optimizer state on the host, streamed through the device group by group inside backward.

``OffloadedRelease(chain, model, ...)`` is ``GradientRelease`` (pgs/runtime/optim/release.py)
whose per-group chain state lives in host memory (pinned where a CUDA device is present) and
visits the device only for its own group's step.  Why: at 8 B parameters the bf16 weights
(2 B/param) plus an 8-bit state (~1 B/param: codes + one fp32 absmax per block) are
8.2 B × 3 B ≈ 22.9 GiB, over a 20 GiB budget; with the state streamed, the device holds the
weights and ``slots`` staging slots (``slot_size``: a group larger than a slot takes them all).
ZeRO-Offload (Ren et al., arXiv 2101.06840) moves the optimizer to the host CPU; here the step
stays on the device and only the state travels, one release group at a time, as paged 8-bit optimizers
(Dettmers et al., arXiv 2110.02861) page their state under memory pressure.

Per group and step, over PCIe:

    host → device: S_g bytes (the group's state)   device → host: S_g bytes (the new state)
    per step:      2 · Σ_g S_g  ≈ 2 · (1 + 4/block) B per trainable parameter (8-bit state)

The order, for a group ``g`` whose gradients complete inside backward:

1. prefetch: ``g``'s state is copied host → device on a side stream (``h2d``) into a free
   staging slot, as soon as the group before it in backward order is acquired or written back
   (or, for the first groups of a step, at the end of the previous step), so the copy overlaps
   the backward of the layers in between.  The copy waits (stream events) for the slot's previous
   occupant to be written back and for ``g``'s own last write-back to the host.  A group larger
   than a slot takes every slot: a free one is filled at once, one whose group is stepping or
   still waiting to step as soon as that group is written back.
2. acquire: the compute stream waits for the copy's event; the group's state tree is rebuilt
   from views of the slot, and the ordinary step (fused or plain) runs on it, in place.  The
   weight stepped in row slabs (tied slabs) waits per slab instead, for the shares holding that
   slab's rows (``wait_for``: every share copy has its own event).
3. write-back: an event on the compute stream after the step; the ``d2h`` side stream waits
   for it and copies the slot back to the group's host buffer; that copy's event frees the
   slot and guards the next fetch of ``g``.

Only tensor leaves with at least one dimension travel (codes, absmax, moments); 0-d leaves
(step counts, the learning rate a schedule stored, per-tensor scalars) stay on the device, so
metrics and schedules read them as before.  The arithmetic is the same chain on the same
values, so the parameters and state equal the on-device release bit for bit
(tests/unit/test_offload.py); ``state_dict`` waits for the write-backs and reads the host copy,
so checkpoints are the same files, and a resume loads them into the host buffers.

Prediction of the order: the groups complete in the reverse order of the layers; the first
backward guesses ``reversed(groups)``, later ones reuse the order the previous backward saw.
A group that arrives unannounced is fetched at once (correct, not overlapped).

On a CPU-only machine the "device" and the host are both host memory: the same staging,
views and write-back run with synchronous copies (how the CPU tests exercise the logic).

Refused (spec error, ``make_optimizer``): without gradient release.  With several processes
(FSDP2) ``ShardedOffloadedRelease`` (pgs/runtime/optim/sharded_offload.py) streams each rank's
own shards' state the same way, one FSDP unit at a time.
"""

from __future__ import annotations

import time
import weakref

import torch

import pgs.func as pf
from pgs.errors import InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.runtime.optim.release import GradientRelease
from pgs.runtime.pinned import host_buffer, unregister

#: byte alignment of each leaf inside a group's buffers (vectorised kernels read 16 B at a time)
ALIGN = 64


def _travels(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0


class StateLayout:
    """Where each travelling leaf of one group's state sits in its byte buffer."""

    def __init__(self, state):
        leaves, self.spec = T.flatten(state)
        self.structure = T.Structure(self.spec)  # rebuilt twice per group and step: compiled walks
        self.entries = []  # (leaf index, offset, nbytes, dtype, shape)
        at = 0
        # smaller leaves first: a group streamed in several shares (one per staging slot) then has
        # its scales (absmax) in the first share and its codes' rows in order after them, so a
        # step that reads the state a row range at a time (tied slabs) waits only for the shares
        # holding its rows (``StateStager.wait_for``)
        sized = sorted((x.numel() * x.element_size(), i) for i, x in enumerate(leaves) if _travels(x))
        for nb, i in sized:
            x = leaves[i]
            self.entries.append((i, at, nb, x.dtype, tuple(x.shape)))
            at += -(-nb // ALIGN) * ALIGN
        self.nbytes = at

    def views(self, buf: torch.Tensor) -> dict[int, torch.Tensor]:
        return {i: buf[off:off + nb].view(dtype).view(shape) for i, off, nb, dtype, shape in self.entries}

    def tree(self, leaves: list, views: dict[int, torch.Tensor]):
        """The state whose flat leaves are ``leaves``, its travelling ones replaced by ``views``."""
        return self.structure.build([views.get(i, x) for i, x in enumerate(leaves)])


def auto_slots(sizes: list[int], most: int = 16) -> int:
    """The staging slot count ``OffloadedRelease`` takes by default: as many slots as make the
    largest group's share of them no larger than the third-largest group (so a slot is sized by
    the regular groups, not by an embedding or untied head), at least 2, at most ``most``.

    The slots' total stays about the largest group, as with two slots of half of it, but more
    groups are in flight: with ``n`` slots the fetches run ``n − 1`` groups ahead of backward,
    so the copies of groups whose gradients complete close together (a layer's last ones, then
    the next layer's first) overlap each other's steps instead of waiting for one slot."""
    if len(sizes) < 3:
        return 2
    ordered = sorted(sizes, reverse=True)
    return max(2, min(int(most), -(-ordered[0] // max(ordered[2], 1))))


def slot_size(sizes: list[int], slots: int) -> int:
    """Bytes of one staging slot for groups of ``sizes`` bytes: the largest group that is not one
    of the two largest, or the largest's share of all the slots, whichever is more (64-byte
    multiples).  A group larger than a slot (an embedding, an untied head) takes every slot at
    once; the others one each, so a 151k-vocabulary embedding does not size every slot."""
    if not sizes:
        return 0
    ordered = sorted(sizes, reverse=True)
    rest = ordered[2] if len(ordered) > 2 else ordered[-1]
    size = max(rest, -(-ordered[0] // slots))
    return -(-size // ALIGN) * ALIGN


class _Slot:
    def __init__(self, index: int, buf: torch.Tensor):
        self.index, self.buf = index, buf
        self.group: str | None = None  # the group fetched (or being fetched) into it
        self.active = False  # its group's step is running (between acquire and release)
        self.ready = None  # event: the host → device copy into it is done (None: nothing to wait for)
        self.seq = 0  # when that copy was queued on the in-order fetch stream (later = after it)
        self.free = None  # event: the device → host copy of its last occupant is done
        self.reserved: str | None = None  # a big group that takes this slot once its step is written back
        self.age = 0


class StateStager:
    """Pinned host homes and ``slots`` device staging slots for a release's group states.

    ``home(group)``: the group's state tree with travelling leaves on the host (what the
    release keeps between steps).  ``prefetch(group)`` starts a host → device copy into free
    slots (one, or all of them for a group larger than a slot); ``acquire(group)`` returns the
    state tree on the device (views of the slots), fetching first if no prefetch did;
    ``release(group, new)`` copies the step's new state into the slots where the step did not
    write in place, writes it back to the host and returns the home tree (with ``new``'s
    scalars); ``synchronize()`` waits for every copy.
    """

    def __init__(self, layouts: dict, states, *, slots: int = 2):
        """``layouts``: ``{group: state}`` to size the buffers from (meta tensors do: only shapes
        and dtypes are read); ``states``: an iterable of ``(group, state)`` whose values are
        copied to the host one at a time (a generator that inits each group's state on the
        device, so that the whole state never exists there at once)."""
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise InvalidArgument(f"offload_optimizer: slots={slots!r} must be an int >= 1")
        self.layouts = {g: StateLayout(s) for g, s in layouts.items()}
        self.device = None
        self.cuda = False
        self.host, at = {}, 0
        self.page_locked = False
        total = sum(lay.nbytes for lay in self.layouts.values())
        self._whole = None
        self.homes = {}
        # each group's home tree flattened, kept beside it: a step's acquire and release rebuild
        # trees from leaf lists (torch's pytree walk costs tens of µs per group and call, on the
        # host, inside backward)
        self.home_leaves: dict[str, list] = {}
        for g, s in states:
            if self._whole is None:  # the device is the first state's; the host buffer is made then
                self.device = next((x.device for x in T.leaves(s) if _travels(x)), torch.device("cpu"))
                self.cuda = self.device.type == "cuda"
                self._whole, registered = host_buffer(total, self.cuda)
                if registered:
                    weakref.finalize(self, unregister, self._whole)
                # registered memory is page-locked, though torch's is_pinned() (which asks its own
                # pinned allocator) says False for it
                self.page_locked = registered or self._whole.is_pinned()
                for h, lay in self.layouts.items():
                    self.host[h] = self._whole[at:at + lay.nbytes]
                    at += lay.nbytes
            self.homes[g] = self._store(g, s)
            del s
        if self.device is None:
            self.device = torch.device("cpu")
        if self.cuda:  # the states' device copies are gone: hand their blocks back before the slots are made
            torch.cuda.empty_cache()
        self.slot_bytes = slot_size([lay.nbytes for lay in self.layouts.values()], slots)
        self.stage = torch.empty(self.slot_bytes * slots, dtype=torch.uint8, device=self.device)
        self.slots = [_Slot(i, self.stage[i * self.slot_bytes:(i + 1) * self.slot_bytes]) for i in range(slots)]
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self.written: dict[str, torch.cuda.Event] = {}
        self.h2d_bytes = self.d2h_bytes = 0
        self.fetches = self.unannounced = 0
        self._clock = 0
        self._seq = 0  # fetch copies queued so far (``_Slot.seq``)
        self._waited: dict[str, int] = {}  # group -> the last share its step's compute stream waited for
        self._views: dict[tuple[str, int], dict] = {}  # (group, first slot) -> views of the staged leaves

    # -- host side ----------------------------------------------------------------------------
    @torch.no_grad()
    def _store(self, group: str, state):
        """Copy ``state``'s travelling leaves into ``group``'s host buffer; the home tree (views
        of that buffer, and ``state``'s own 0-d leaves, which stay on the device)."""
        lay = self.layouts[group]
        views = lay.views(self.host[group])
        leaves, spec = T.flatten(state)
        storages = set()
        for i, off, nb, dtype, shape in lay.entries:
            x = leaves[i]
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise InvalidArgument(f"offload_optimizer: group {group!r}'s state leaf {i} changed shape or dtype")
            key = x.untyped_storage().data_ptr()
            if key in storages and key != 0:  # a shared buffer would be streamed as two copies
                raise InvalidArgument(f"offload_optimizer: two leaves of group {group!r}'s chain state share "
                                      "storage; the state must be separate tensors per leaf to be streamed")
            storages.add(key)
            views[i].copy_(x)
        self.home_leaves[group] = [views.get(i, x) for i, x in enumerate(leaves)]
        return T.unflatten(self.home_leaves[group], spec)

    def home(self, group: str):
        return self.homes[group]

    def host_bytes(self) -> int:
        """Host memory the state occupies (pinned on CUDA)."""
        return sum(h.numel() for h in self.host.values())

    def staging_bytes(self) -> int:
        """Device memory of the staging slots."""
        return self.stage.numel()

    def bytes_per_step(self) -> int:
        """PCIe bytes of one step: every group's state in and out once."""
        return 2 * sum(lay.nbytes for lay in self.layouts.values())

    def synchronize(self) -> None:
        """Wait for every copy (before the host buffers are read or overwritten)."""
        if self.cuda:
            self.d2h.synchronize()
            self.h2d.synchronize()

    def load(self, group: str, state):
        """Replace ``group``'s state by ``state`` (a resume): into the host buffer; any staged copy is dropped."""
        self.synchronize()
        self._evict(group)
        self.homes[group] = self._store(group, state)
        return self.homes[group]

    # -- device side --------------------------------------------------------------------------
    def _slots_of(self, group: str) -> list[_Slot]:
        return [s for s in self.slots if s.group == group]

    def _staged(self, group: str) -> bool:
        """``group`` is in the slots, or on its way there (a big group waiting for a busy slot)."""
        return any(s.group == group or s.reserved == group for s in self.slots)

    def _big(self, group: str) -> bool:
        return self.layouts[group].nbytes > self.slot_bytes

    def forget(self, group: str) -> None:
        """Drop ``group``'s staged copy (its host buffer was written: a resume)."""
        self.synchronize()
        self._evict(group)

    def _evict(self, group: str) -> None:
        """Forget a staged group that no step is using (its copy is dropped, the host has it)."""
        for s in self.slots:
            if s.group == group and not s.active:
                s.group = None
            if s.reserved == group:
                s.reserved = None

    def rotate(self, first: int) -> None:
        """The empty slots are taken from slot ``first`` on, in index order, by the next
        regular fetches (their ages set older than any other, ``first`` the oldest)."""
        n = len(self.slots)
        for s in self.slots:
            if s.group is None and s.reserved is None and not s.active:
                s.age = -n + (s.index - first) % n

    def prefetch(self, group: str, *, evict: bool = False) -> None:
        """Start copying ``group``'s state to the device, if it is not staged already and there
        is room (a staged group waiting for its step is not evicted unless ``evict``).

        A regular group takes one empty slot.  A group larger than a slot takes every slot: the
        empty ones are filled now, and a slot whose group is stepping, or holds a group still
        waiting for its step, is reserved and filled as soon as that group is written back
        (``release``).  So the big group's shares arrive while the groups before it step, one
        behind the other, and only the share of the last slot to be written back is left when
        its step comes (an embedding's state, ~0.4 GB at Qwen3-4B, whose copy
        would otherwise start only when every group before it had stepped).  With ``evict`` the
        waiting groups are dropped instead (fetched again on demand)."""
        lay = self.layouts.get(group)
        if lay is None or lay.nbytes == 0 or self._staged(group):
            return
        if self._big(group):
            other_big = any(s.reserved is not None or (s.group is not None and self._big(s.group)) for s in self.slots)
            if other_big and not evict:  # another big group's shares own the slots: its step comes first
                return
            if evict:
                for g in {s.group for s in self.slots if s.group is not None and not s.active}:
                    self._evict(g)
            self._clock += 1
            for slot in self.slots:
                slot.age = self._clock
                if slot.active or slot.group is not None:
                    slot.reserved = group
                else:
                    slot.group = group
                    self._copy_in(group, slot)
        else:
            usable = [s for s in self.slots if not s.active and (evict or (s.group is None and s.reserved is None))]
            if not usable:
                return
            # an empty one, else the oldest; on demand a big group's reservation gives way too
            slot = min(usable, key=lambda s: (s.group is not None, s.reserved is not None, s.age))
            if slot.reserved is not None:
                self._evict(slot.reserved)
            if slot.group is not None:
                self._evict(slot.group)
            self._clock += 1
            slot.group, slot.age = group, self._clock
            self._copy_in(group, slot)
        self.h2d_bytes += lay.nbytes
        self.fetches += 1

    def _copy_in(self, group: str, slot: _Slot) -> None:
        """Host → device copy of ``group``'s bytes that belong in ``slot`` (the whole state for a
        regular group; the slot's share of a big one), after the slot's last write-back and the
        group's own."""
        lay = self.layouts[group]
        if self._big(group):
            lo, hi = slot.index * self.slot_bytes, min((slot.index + 1) * self.slot_bytes, lay.nbytes)
            dst_at = lo
        else:
            lo, hi, dst_at = 0, lay.nbytes, slot.index * self.slot_bytes
        slot.ready, slot.seq = None, 0
        if hi <= lo:
            return
        src, dst = self.host[group][lo:hi], self.stage[dst_at:dst_at + hi - lo]
        self._seq += 1
        slot.seq = self._seq
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                if slot.free is not None:
                    self.h2d.wait_event(slot.free)
                if group in self.written:
                    self.h2d.wait_event(self.written[group])
                dst.copy_(src, non_blocking=True)
                slot.ready = torch.cuda.Event()
                slot.ready.record(self.h2d)
        else:
            dst.copy_(src)

    def _wait(self, group: str, slots) -> None:
        """The compute stream waits for ``group``'s shares in ``slots``: for the one queued last
        (the fetch stream runs in order, so the earlier ones are done by then), unless an earlier
        wait of this step already covered it."""
        last = max(slots, key=lambda s: s.seq, default=None)
        if last is None or last.seq <= self._waited.get(group, 0):
            return
        self._waited[group] = last.seq
        if self.cuda and last.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(last.ready)

    def covering(self, group: str, tensors) -> list[_Slot]:
        """The staging slots holding the bytes of ``tensors`` (views of ``group``'s staged state;
        other tensors are ignored)."""
        base, size = self.stage.data_ptr(), self.slot_bytes
        out = set()
        for t in tensors:
            if not _travels(t) or t.numel() == 0:
                continue
            lo = t.data_ptr() - base
            span = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
            if lo < 0 or lo + span > self.stage.numel() * self.stage.element_size():
                continue  # not in the staging buffer (a 0-d scalar, a host tensor)
            out.update(range(lo // size, (lo + span - 1) // size + 1))
        return [s for s in self.slots if s.index in out and s.group == group]

    def wait_for(self, group: str, tensors) -> None:
        """Order the compute stream after the fetch of the shares that hold ``tensors`` (after
        ``acquire(group, wait=False)``): a step that reads its state a part at a time starts on
        the first part while the last share is still on its way."""
        self._wait(group, self.covering(group, tensors))

    def acquire(self, group: str, *, wait: bool = True):
        """``group``'s state on the device (views of its staging slots), ordered after its fetch
        (``wait``; else the caller orders each use by ``wait_for``, and ``release`` waits for the
        rest before the write-back)."""
        lay = self.layouts[group]
        if lay.nbytes == 0:
            return self.homes[group]
        held = self._slots_of(group)
        whole = len(held) == (len(self.slots) if self._big(group) else 1)
        if not whole or any(s.reserved == group for s in self.slots):
            if held:  # a share still reserved: a group ahead of it in the slots did not step (order mispredicted)
                self._evict(group)
            self.unannounced += 1
            self.prefetch(group, evict=True)
            held = self._slots_of(group)
            if not held or any(s.reserved == group for s in self.slots):  # pragma: no cover - re-entrant step
                raise RuntimeError(f"offload_optimizer: no free staging slot for group {group!r}")
        for slot in held:
            slot.active = True
        self._waited[group] = 0
        if wait:
            self._wait(group, held)
        return lay.tree(self.home_leaves[group], self._device_views(group, held[0].index))

    def _device_views(self, group: str, first: int) -> dict:
        key = (group, first)
        views = self._views.get(key)
        if views is None:
            lay = self.layouts[group]
            at = first * self.slot_bytes
            views = self._views[key] = lay.views(self.stage[at:at + lay.nbytes])
        return views

    @torch.no_grad()
    def release(self, group: str, new_state):
        """After ``group``'s step: its new state written back to the host; the home tree."""
        lay = self.layouts[group]
        if lay.nbytes == 0:
            self.homes[group] = new_state
            return new_state
        held = self._slots_of(group)
        self._wait(group, held)  # a step that waited part by part: the write-back reads every share
        views = self._device_views(group, held[0].index)
        try:
            leaves = lay.structure.read(new_state)
        except TreeMismatch as why:
            raise InvalidArgument(f"offload_optimizer: the chain returned a state of another structure for "
                                  f"{group!r} ({why})") from None
        for i, v in views.items():
            x = leaves[i]
            if x.data_ptr() != v.data_ptr():  # the plain path returns new tensors; the fused one writes in place
                v.copy_(x)
        home_views = self._views.get((group, -1))
        if home_views is None:
            home_views = self._views[(group, -1)] = lay.views(self.host[group])
        self.home_leaves[group] = [home_views.get(i, x) for i, x in enumerate(leaves)]
        home = lay.structure.build(self.home_leaves[group])
        start = held[0].index * self.slot_bytes
        src, dst = self.stage[start:start + lay.nbytes], self.host[group]
        if self.cuda:
            stepped = torch.cuda.Event()
            stepped.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(stepped)
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h)
            self.written[group] = done
        else:
            dst.copy_(src)
            done = None
        for slot in held:  # free once ``done`` has fired (every later copy into it waits for it)
            slot.active, slot.group, slot.free = False, None, done
            if slot.reserved is not None:  # a big group waited for this slot: its share comes now
                slot.group, slot.reserved = slot.reserved, None
                self._copy_in(slot.group, slot)
        self.d2h_bytes += lay.nbytes
        self.homes[group] = home
        return home


def stager_for(chain, groups, tensors, slots: int | None, **hooks) -> StateStager:
    """The ``StateStager`` of a release's ``groups`` (``tensors(group)``: the tensors its state
    is made for): each group's state made on the device and moved to the host before the next
    one's is made (the whole state never exists on the device); the buffers sized from a meta
    init; ``slots`` None: ``auto_slots`` of the groups' state sizes.  ``hooks``: ``chain.init``'s
    keyword arguments (the sharded step context)."""
    shapes = {g: chain.init({n: torch.empty_like(t, device="meta") for n, t in tensors(g).items()}, **hooks)
              for g in groups}
    if slots is None:
        slots = auto_slots([StateLayout(s).nbytes for s in shapes.values()])
    return StateStager(shapes, ((g, chain.init(tensors(g), **hooks)) for g in groups), slots=slots)


class StreamedStates:
    """What the offloaded releases share (``OffloadedRelease`` here, ``ShardedOffloadedRelease``
    in pgs/runtime/optim/sharded_offload.py): the order the groups' states are fetched in,
    learned from the backward before, and the fetch, step, write-back of one group.

    The class using it has ``stager`` (a ``StateStager``), ``states`` (``{group: state}``) and
    calls ``_start_streaming(groups)`` once, ``_stream_begin()`` when a backward starts,
    ``_stream_step(group, step)`` for each group's step and ``_stream_end(groups)`` when the
    backward is over (its result: what the step record logs, ``offload/…``)."""

    stager: StateStager

    def _start_streaming(self, groups: list[str]) -> None:
        self._set_order(list(reversed(groups)))  # first guess: backward runs the layers in reverse
        self._seen: list[str] = []
        self._counted = (0, 0)  # the stager's (fetches, unannounced) at the end of the last step
        self._stager_s = 0.0  # host seconds in the stager's calls since the last step's end

    def _set_order(self, order: list[str]) -> None:
        self._order = order
        self._position = {g: i for i, g in enumerate(order)}  # (a list search per group step otherwise)

    def _expected_after(self, group: str | None) -> list[str]:
        """The next groups backward should complete after ``group`` (the first ones for None)."""
        n = len(self.stager.slots)
        if group is None:
            return self._order[:n]
        i = self._position.get(group)
        if i is None:
            return []
        return self._order[i + 1:i + n]

    def _stream_begin(self) -> None:
        self._seen = []
        for g in self._expected_after(None):
            self.stager.prefetch(g)

    def _stream_step(self, group: str, step, *, wait: bool = True) -> None:
        """``step(group)`` on ``group``'s state fetched to the device (``states[group]``: views
        of its staging slots; ``wait=False``: the step orders its reads by ``state_ready``), then
        written back to the host; the next groups' fetches started around it."""
        t = time.perf_counter()
        self.states[group] = self.stager.acquire(group, wait=wait)
        for g in self._expected_after(group):
            self.stager.prefetch(g)
        t1 = time.perf_counter()
        try:
            step(group)
        finally:
            t2 = time.perf_counter()
            self.states[group] = self.stager.release(group, self.states[group])
        self._seen.append(group)
        if self.stager._big(group):  # every slot free at once: where the next run of groups starts
            self._rotate(self._position.get(group, len(self._order)) + 1)
        for g in self._expected_after(group):  # room again (a group larger than a slot held them all)
            self.stager.prefetch(g)
        self._stager_s += (t1 - t) + (time.perf_counter() - t2)

    def _rotate(self, start: int) -> None:
        """Choose the slot where the groups from ``order[start]`` on begin to be fetched, so that
        the last of them before the next group larger than a slot sits in the last slot.  Each
        group is fetched into the slot its predecessor ``n`` places before freed, so the slots go
        round in order; the big group's shares then free in the order of its own bytes (share 0,
        the scales and first rows, first), and its row slabs start on the early shares while the
        last one is still on its way (``state_ready``)."""
        n = len(self.stager.slots)
        regular = 0
        for g in self._order[start:]:
            if self.stager._big(g):
                self.stager.rotate((-regular) % n)
                return
            regular += self.stager.layouts[g].nbytes > 0

    def state_ready(self, group: str, part) -> None:
        """Before a slab's step reads ``part`` (views of the group's staged state): the compute
        stream waits for the fetch of the shares that hold it."""
        self.stager.wait_for(group, T.leaves(part))

    def _stream_end(self, groups) -> dict[str, float]:
        """After a backward: the order it completed the groups in kept for the next one, whose
        first groups are fetched now (during its forward); what the step record logs beside
        release/host_ms: fetches started during this step (the next step's first ones
        included), how many groups arrived unannounced (fetched on demand: the compute stream
        waited for the whole copy), and the host's time in the stager (fetch, acquire,
        write-back: Python, events, copies queued)."""
        t = time.perf_counter()
        if sorted(self._seen) == sorted(groups):
            self._set_order(list(self._seen))
        self._rotate(0)
        for i, g in enumerate(self._expected_after(None)):  # the next step's first groups, during its forward
            self.stager.prefetch(g, evict=i == 0)  # (a staged group that this step never used makes room)
        self._stager_s += time.perf_counter() - t
        s = self.stager
        extras = {"offload/fetches": s.fetches - self._counted[0],
                  "offload/unannounced": s.unannounced - self._counted[1], "offload/host_ms": self._stager_s * 1e3}
        self._counted = (s.fetches, s.unannounced)
        self._stager_s = 0.0
        return extras

    def offload_stats(self) -> dict:
        """Host bytes of the state, device staging bytes, PCIe bytes moved so far and per step
        (this process's: with several, each holds and moves its own shards' state)."""
        s = self.stager
        return {"host_state_bytes": s.host_bytes(), "staging_bytes": s.staging_bytes(),
                "pcie_bytes_per_step": s.bytes_per_step(), "h2d_bytes": s.h2d_bytes, "d2h_bytes": s.d2h_bytes,
                "fetches": s.fetches, "unannounced_fetches": s.unannounced}


class OffloadedRelease(StreamedStates, GradientRelease):
    """``GradientRelease`` with each group's chain state in host memory, streamed through
    ``slots`` device staging buffers inside backward.  See the module docstring.

    Takes ``GradientRelease``'s arguments, plus ``slots`` (staging slots, ``slot_size`` each;
    None: ``auto_slots`` of the groups' state sizes; 2: one group steps while the next one's
    state arrives).
    """

    def __init__(self, chain, model, *, slots: int | None = None, **kw):
        self._slots = slots
        super().__init__(chain, model, **kw)
        self._start_streaming(list(self.groups))

    def _init_states(self) -> dict:
        """Each group's state made on the device and moved to the host before the next one's is
        made (``stager_for``)."""
        self.stager = stager_for(self.chain, self.groups, lambda g: self._group_tensors(g)[0], self._slots)
        return {g: self.stager.home(g) for g in self.groups}

    def _begin(self) -> None:
        super()._begin()
        self._stream_begin()

    @torch.no_grad()
    def _step_group(self, group: str) -> None:
        # the weight stepped in row slabs (tied_slabs) reads its state a slab at a time: each slab
        # waits for the shares holding its rows (state_ready), so the first slabs step while the
        # last share of a state larger than a slot is still being copied
        slabbed = self._slab_name is not None and self.groups[group] == [self._slab_name]
        self._stream_step(group, super()._step_group, wait=not slabbed)

    def finish(self) -> None:
        active = self._arrivals.active
        super().finish()
        if active:
            self.step_extras = {**self.step_extras, **self._stream_end(self.groups)}

    def state_dict(self, device=None, copy: bool = True):
        """As ``GradientRelease.state_dict``, once every copy is done; ``copy=False``: views of
        the pinned host buffer (the 0-d leaves stay on the device)."""
        self.stager.synchronize()
        return super().state_dict(device, copy)

    @torch.no_grad()
    def load_state_dict(self, d) -> None:
        self.stager.synchronize()
        super().load_state_dict(d)

    def _load_states(self, d, ignore) -> None:
        """Group by group: the group's entries read from ``d`` and stored into its host buffer
        (``StateStager.load``), so the host holds one group's entries beside the state at a
        time (``d`` a lazily read file); the 0-d leaves go where they live (the device)."""
        pairs = pf.state_entries(self.states, d, ignore=ignore)  # the groups' leaves, in order
        for g in list(self.states):
            self._load_group(g, pairs)  # its entries are freed before the next group's are read
        next(pairs, None)  # past the last leaf: refuses the entries the optimizer lacks

    def _load_group(self, g: str, pairs) -> None:
        leaves, spec = T.flatten(self.states[g])
        loaded = [x if x is None else next(pairs)[1].to(x.device) for x in leaves]
        self.states[g] = self.stager.load(g, T.unflatten(loaded, spec))
