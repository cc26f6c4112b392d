"""The flat layout: one contiguous buffer per group of same-dtype, same-device tensors.

Why: a pure transform written as a ``tree_map`` over 300 tensors launches 300 kernels per
stage and is host-bound (docs/performance.md, "Peers and ceilings").  Run on the flat layout,
the same ``tree_map`` sees one leaf per group and every elementwise stage becomes one kernel
over one buffer (1.01 of copy bandwidth when compiled).

A ``Layout`` maps a pytree of tensors onto groups.  Inside a group every tensor starts at a
multiple of ``align`` elements (padding is zero), so the group is a sequence of *blocks* of
``align`` elements, each belonging to exactly one tensor (``block_seg``).  Per-tensor
reductions are then two steps: a reduction over each block, and a segment sum of the block
results (``index_add``) — no loop over tensors.  Block-wise 8-bit quantization uses the same
blocks.

Transforms see the layout as ``ctx.layout`` (``pgs.func.step.StepContext``); the helpers in this module
(``per_tensor_sumsq``, ``per_tensor_apply``, ``group_label``) make the same transform code
run on both the per-parameter tree and the flat tree.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable

import attrs
import torch

from pgs.errors import TreeMismatch
from pgs.func import tree as T


@attrs.frozen(eq=False)
class Group:
    """One flat buffer: which tensors it holds and where."""

    key: str
    dtype: torch.dtype
    device: torch.device
    paths: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    size: int
    align: int
    labels: tuple
    block_seg: torch.Tensor  # [size // align] int64: the tensor index of each block

    @property
    def num_tensors(self) -> int:
        return len(self.paths)

    @property
    def num_blocks(self) -> int:
        return self.size // self.align

    def meta(self, i: int = 0) -> torch.Tensor:
        """A meta tensor standing for member ``i`` (for masks that look at shape/ndim)."""
        return torch.empty(self.shapes[i], dtype=self.dtype, device="meta")


class Layout:
    """How a pytree of tensors maps onto flat per-group buffers (host-side metadata only)."""

    def __init__(self, params, *, align: int = 256, group_by: tuple = ()):
        T.check_tensor_leaves(params, "params")
        leaves, spec = T.flatten(params)
        paths = T.paths(params)
        self.spec = spec
        self.align = int(align)
        self.leaf_paths = tuple(paths)
        self.leaf_shapes = tuple(None if x is None else x.shape for x in leaves)
        self.leaf_dtypes = tuple(None if x is None else x.dtype for x in leaves)
        buckets: dict[tuple, list[int]] = {}
        for i, (path, x) in enumerate(zip(paths, leaves)):
            if x is None:
                continue
            labels = tuple(fn(path, x) for fn in group_by)
            buckets.setdefault((str(x.dtype), str(x.device), labels), []).append(i)
        self.groups: dict[str, Group] = {}
        self.leaf_slot: list[tuple[str, int] | None] = [None] * len(leaves)
        for gi, ((_, _, labels), idx) in enumerate(buckets.items()):
            key = f"g{gi}"
            offsets, numels, off = [], [], 0
            for j in idx:
                n = leaves[j].numel()
                offsets.append(off)
                numels.append(n)
                off += max(1, math.ceil(n / self.align)) * self.align
            seg = torch.empty(off // self.align, dtype=torch.int64)
            for s, (o, n) in enumerate(zip(offsets, numels)):
                nb = max(1, math.ceil(n / self.align))
                seg[o // self.align : o // self.align + nb] = s
            x0 = leaves[idx[0]]
            self.groups[key] = Group(
                key=key,
                dtype=x0.dtype,
                device=x0.device,
                paths=tuple(paths[j] for j in idx),
                shapes=tuple(leaves[j].shape for j in idx),
                offsets=tuple(offsets),
                numels=tuple(numels),
                size=off,
                align=self.align,
                labels=labels,
                block_seg=seg.to(x0.device),
            )
            for s, j in enumerate(idx):
                self.leaf_slot[j] = (key, s)
        # zero-copy flattens of plain dicts, by ``what``: (keys, leaves, addresses, shapes, buffers)
        self._views_cache: dict[str, tuple] = {}

    # -- structure ----------------------------------------------------------------------
    def signature(self) -> tuple:
        return (self.spec, self.leaf_shapes, self.leaf_dtypes, self.align)

    def matches(self, tree) -> bool:
        leaves, spec = T.flatten(tree)
        if spec != self.spec:
            return False
        return all(
            (x is None and s is None) or (x is not None and s is not None and x.shape == s)
            for x, s in zip(leaves, self.leaf_shapes)
        )

    def check(self, tree, what: str) -> None:
        leaves, spec = T.flatten(tree)
        if spec != self.spec or len(leaves) != len(self.leaf_shapes):
            got = T.paths(tree)
            missing = [p for p in self.leaf_paths if p not in set(got)]
            extra = [p for p in got if p not in set(self.leaf_paths)]
            if missing:
                raise TreeMismatch(f"{what} lacks leaf {missing[0]!r} that the optimizer state has")
            if extra:
                raise TreeMismatch(f"{what} has leaf {extra[0]!r} that the optimizer state lacks")
            raise TreeMismatch(f"{what} does not have the tree structure of the optimizer state")
        for path, x, s in zip(self.leaf_paths, leaves, self.leaf_shapes):
            if x is not None and not isinstance(x, torch.Tensor):
                raise TreeMismatch(f"{what} leaf {path!r} is a {type(x).__name__}, expected a torch.Tensor")
            if x is not None and s is None:
                raise TreeMismatch(f"{what} leaf {path!r}: present in one tree only")
            if x is not None and x.shape != s:
                raise TreeMismatch(f"{what} leaf {path!r} has shape {tuple(x.shape)}, "
                                   f"the optimizer state expects {tuple(s)}")

    # -- moving between the two forms ---------------------------------------------------
    def empty(self, dtype: torch.dtype | None = None, fill: float | None = 0.0) -> dict[str, torch.Tensor]:
        out = {}
        for k, g in self.groups.items():
            t = torch.empty(g.size, dtype=dtype or g.dtype, device=g.device)
            if fill is not None:
                t.fill_(fill)
            out[k] = t
        return out

    def views(self, key: str, flat: torch.Tensor) -> list[torch.Tensor]:
        g = self.groups[key]
        return [flat[o : o + n].view(s) for o, n, s in zip(g.offsets, g.numels, g.shapes)]

    def flat_view_of(self, key: str, members: list[torch.Tensor]) -> torch.Tensor | None:
        """The group buffer when ``members`` already are its views (zero-copy), else None."""
        g = self.groups[key]
        x0 = members[0]
        base_off = x0.storage_offset() - g.offsets[0]
        if base_off < 0:
            return None
        st = x0.untyped_storage()
        if (base_off + g.size) * x0.element_size() > st.nbytes():
            return None
        for x, o in zip(members, g.offsets):
            if (
                x.untyped_storage().data_ptr() != st.data_ptr()
                or x.storage_offset() != base_off + o
                or not x.is_contiguous()
            ):
                return None
        return torch.empty(0, dtype=x0.dtype, device=x0.device).set_(st, base_off, (g.size,), (1,))

    def flatten(self, tree, dtype: torch.dtype | None = None, *, what: str = "tree") -> dict[str, torch.Tensor]:
        """One buffer per group (zero-copy when the leaves are views of one already).

        A plain ``dict`` of tensors whose leaves are the same objects, at the same addresses and
        shapes, as the last zero-copy flatten under the same ``what`` gets that result again
        without walking the tree: the walk, the checks and the views are host time on every
        step over bound views (docs/performance.md)."""
        hit = self._cached_views(tree, dtype, what)
        if hit is not None:
            return hit
        self.check(tree, what)
        leaves, _ = T.flatten(tree)
        members: dict[str, list] = {k: [None] * g.num_tensors for k, g in self.groups.items()}
        for x, slot in zip(leaves, self.leaf_slot):
            if slot is not None:
                members[slot[0]][slot[1]] = x
        out = {}
        for k, g in self.groups.items():
            ms = members[k]
            if all(m is None for m in ms):
                continue  # a partition's subtree: this group belongs to another label
            if any(m is None for m in ms):
                raise TreeMismatch(f"{what}: leaf {g.paths[ms.index(None)]!r} is missing from its flat group")
            if dtype is None or dtype == ms[0].dtype:
                v = self.flat_view_of(k, ms)
                if v is not None:
                    out[k] = v
                    continue
            buf = torch.zeros(g.size, dtype=dtype or ms[0].dtype, device=g.device)
            torch._foreach_copy_(self.views(k, buf), [m.to(buf.dtype) if m.dtype != buf.dtype else m for m in ms])
            out[k] = buf
        if dtype is None and type(tree) is dict and len(out) == len(self.groups):
            leaves = tuple(tree.values())
            if all(isinstance(x, torch.Tensor) for x in leaves) and all(
                    out[k] is not None and self.flat_view_of(k, [leaves[i] for i, sl in enumerate(self.leaf_slot)
                                                                if sl is not None and sl[0] == k]) is not None
                    for k in out):
                self._views_cache[what] = (tuple(tree), leaves, tuple(x.data_ptr() for x in leaves),
                                           tuple(x.shape for x in leaves), dict(out))
            else:
                self._views_cache.pop(what, None)
        return out

    def _cached_views(self, tree, dtype, what: str):
        c = self._views_cache.get(what)
        if c is None or dtype is not None or type(tree) is not dict:
            return None
        keys, leaves, ptrs, shapes, out = c
        if len(tree) != len(leaves) or tuple(tree) != keys:
            return None
        for x, y, p, s in zip(tree.values(), leaves, ptrs, shapes):
            if x is not y or x.data_ptr() != p or x.shape != s:
                return None
        return dict(out)

    def zero_copy(self, flat: dict[str, torch.Tensor]) -> bool:
        """Whether every buffer of ``flat`` came from a cached zero-copy flatten (the leaves of
        that tree are views of these very buffers)."""
        bufs = [b for c in self._views_cache.values() for b in c[4].values()]
        return all(any(v is b for b in bufs) for v in flat.values())

    def unflatten(self, flat: dict[str, torch.Tensor]):
        """The pytree of views into the flat buffers (zero-copy)."""
        leaves: list[Any] = [None] * len(self.leaf_slot)
        views = {k: self.views(k, v) for k, v in flat.items()}
        for i, slot in enumerate(self.leaf_slot):
            if slot is not None and slot[0] in views:
                leaves[i] = views[slot[0]][slot[1]]
        return T.unflatten(leaves, self.spec)


# ----------------------------------------------------------------------------------------
# helpers that make one transform body serve both forms


def group_label(layout: Layout | None, tree, fn: Callable[[str, torch.Tensor], Hashable]) -> dict:
    """``{path_or_group_key: fn(path, param)}`` for the leaves of ``tree``.

    On the flat layout the label of a group is the label of its first member; grouping by
    ``fn`` (``Transform.group_by``) guarantees that all members agree.
    """
    if layout is None:
        return {p: fn(p, x) for p, x in T.leaves_with_paths(tree) if x is not None}
    out = {}
    for k, x in tree.items():
        if x is None:
            continue
        g = layout.groups[k]
        out[k] = fn(g.paths[0], g.meta(0))
    return out


def per_tensor_sumsq(tree, layout: Layout | None = None, reduce_sum: Callable | None = None):
    """Per-tensor sums of squares in fp32: a 0-d tensor per leaf, or ``[num_tensors]`` per group.

    ``reduce_sum``: the sharding hook (see ``reduced``); pass ``ctx.reduce_sum``.
    """
    if layout is None:
        return reduced(T.tree_map(lambda x: x.float().pow(2).sum(), tree), reduce_sum)
    out = {}
    for k, x in tree.items():
        if x is None:
            out[k] = None
            continue
        g = layout.groups[k]
        out[k] = _segment_sum(x.float().view(g.num_blocks, g.align).pow(2).sum(1), g)
    return reduced(out, reduce_sum)


def per_tensor_dot(a, b, layout: Layout | None = None, reduce_sum: Callable | None = None):
    """Per-tensor inner products ⟨a, b⟩ in fp32, shaped like ``per_tensor_sumsq``'s result."""
    if layout is None:
        return reduced(T.tree_map(lambda x, y: (x.float() * y.float()).sum(), a, b), reduce_sum)
    out = {}
    for k, x in a.items():
        if x is None:
            out[k] = None
            continue
        g = layout.groups[k]
        out[k] = _segment_sum((x.float() * b[k].float()).view(g.num_blocks, g.align).sum(1), g)
    return reduced(out, reduce_sum)


#: Partial sums per tensor in ``_segment_sum``: consecutive blocks go to different slots.
SEGMENT_LANES = 64


def _segment_sum(blocks: torch.Tensor, g: Group) -> torch.Tensor:
    """``[num_blocks]`` block results summed per tensor: ``[num_tensors]`` fp32.

    A tensor's blocks are consecutive, so a plain ``index_add`` over ``block_seg`` sends
    thousands of atomic adds in a row to one address (compiled for the GPU: one atomic per
    block), which the GPU serialises.  Block ``b`` adds into slot ``b % SEGMENT_LANES`` of its
    tensor instead, and the slots are summed afterwards.
    """
    lanes = SEGMENT_LANES
    idx = segment_slots(g, lanes)
    part = torch.zeros(g.num_tensors * lanes, dtype=torch.float32, device=blocks.device).index_add_(0, idx, blocks)
    return part.view(g.num_tensors, lanes).sum(1)


def segment_slots(g: Group, lanes: int) -> torch.Tensor:
    """The slot each block of ``g`` adds into for a per-tensor sum split over ``lanes`` partial
    sums: ``tensor * lanes + block % lanes`` (``[num_blocks]``, on ``g``'s device)."""
    return g.block_seg * lanes + torch.arange(g.num_blocks, device=g.block_seg.device) % lanes


def reduced(sums, reduce_sum: Callable | None):
    """``sums`` completed across shards: ``reduce_sum(sums)`` when a hook is given, else ``sums``.

    Under FSDP2 a transform sees each parameter's local shard only, so a per-tensor sum is a
    partial sum.  The sharded binding passes ``StepContext.reduce_sum``: a function that
    sums a pytree of tensors over the ranks (one all-reduce for the whole tree) and returns
    it.  Transforms that reduce over whole tensors forward ``ctx.reduce_sum`` to
    ``per_tensor_sumsq`` / ``per_tensor_dot``
    / ``global_norm``; on one process the hook is absent and nothing changes.
    """
    return sums if reduce_sum is None else reduce_sum(sums)


def per_tensor_apply(fn: Callable, tree, *scalar_trees, layout: Layout | None = None):
    """``fn(leaf, *per_tensor_scalars)`` with scalars broadcast over each tensor's elements.

    On the flat layout, a group is viewed as ``[num_blocks, align]`` and each scalar tree's
    ``[num_tensors]`` vector is gathered to ``[num_blocks, 1]`` — one kernel per group.
    """
    if layout is None:
        return T.tree_map(fn, tree, *scalar_trees)
    out = {}
    for k, x in tree.items():
        if x is None:
            out[k] = None
            continue
        g = layout.groups[k]
        sc = [s[k][g.block_seg].unsqueeze(1) for s in scalar_trees]
        out[k] = fn(x.view(g.num_blocks, g.align), *sc).reshape(g.size)
    return out


def _without_layout(extra: dict) -> dict:
    """``extra`` with its step context's layout removed (what a non-flat transform sees)."""
    ctx = extra.get("ctx")
    return {**extra, "ctx": ctx.evolve(layout=None)}


def _flat_layout(extra: dict):
    ctx = extra.get("ctx")
    return None if ctx is None else ctx.layout


def call_init(t, params, extra: dict):
    """Call ``t.init``, handing a non-flat transform per-parameter views on the flat layout.

    ``extra``: the keyword arguments of the call, the ``StepContext`` under ``"ctx"``."""
    layout = _flat_layout(extra)
    if layout is not None and not t.flat_ok:
        return t.init(layout.unflatten(params), **_without_layout(extra))
    return t.init(params, **extra)


def call_update(t, updates, state, params, extra: dict):
    """Call ``t.update``; on the flat layout a non-flat transform gets views (zero-copy in)."""
    layout = _flat_layout(extra)
    if layout is not None and not t.flat_ok:
        uv = layout.unflatten(updates)
        pv = None if params is None else layout.unflatten(params)
        new_u, new_s = t.update(uv, state, pv, **_without_layout(extra))
        keys = set(updates)
        flat = layout.flatten(new_u, what="updates")
        return {k: v for k, v in flat.items() if k in keys}, new_s
    return t.update(updates, state, params, **extra)
