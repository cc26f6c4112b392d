"""Gradient release's tied weight stepped in row slabs (``memory.tied_slabs``).

``TiedSlabs(release, model, rows)`` is what ``GradientRelease`` (pgs/runtime/optim/release.py) makes
when ``tied_slabs`` is set: it checks the chain and the weight, and replaces the input
embedding's forward (``pgs.runtime.model.build.row_grad_embedding``) so that its backward keeps the
looked-up rows' gradients instead of building a dense V×D gradient.  When the weight's group
steps, ``step(release, group)`` steps the weight slab by slab over the vocabulary: each slab's
gradient is the rows' sums that fall in it plus each ``before_step`` contribution's
``add_rows_to`` (the deferred head gradient rebuilt for those vocabulary rows only), then the
chain's update on the slab alone (the fused kernel on the slab's views of parameter and state,
or the plain update on a one-leaf sub-tree).  Needs an elementwise chain (``slab_refusal``);
equal to the dense path up to summation order (tests/unit/test_release_slabs.py, docs/memory.md).
"""

from __future__ import annotations

import torch

import pgs.func as pf
from pgs.errors import InvalidArgument, TreeMismatch
from pgs.func.base import ELEMENTWISE
from pgs.func.quant8 import Quantized8bit
from pgs.runtime.model.build import TokenRowGrads, row_grad_embedding


def slab_refusal(chain: pf.Transform) -> str | None:
    """Why ``chain`` cannot step a weight slab by slab (``tied_slabs``; a sentence), or None.

    A slab's update must equal the rows of the whole tensor's update, so every transform must
    be elementwise: a per-tensor norm (``clip_by_norm_per_tensor``, hyperball, AdaGC), a
    matrix rule (Muon, Newton-Schulz) or a global one reads the whole tied weight at once."""

    def walk(t: pf.Transform, where: str) -> str | None:
        for i, c in enumerate(t.children):
            found = walk(c, f"{where}[{i}] ({c.name})" if t.name == "chain" else f"{where} > {c.name}")
            if found:
                return found
        if t.locality != ELEMENTWISE:
            return (f"{where} is {t.locality} (its update of a row depends on the whole tensor), so the "
                    "tied weight's update is not row-separable and cannot be stepped in row slabs; use an "
                    "elementwise chain (lion8bit, adamw8bit, adamw, lion) or tied_slabs=0")
        return None

    return walk(chain, f"the chain ({chain.name})" if chain.name != "chain" else "chain")


class TiedSlabs:
    """The input embedding's weight of a ``GradientRelease``, stepped in row slabs.  See the
    module docstring.

    Attributes: ``rows`` (rows per slab), ``name`` (the weight's parameter name), ``block``
    (the 8-bit state's block size, 1 without 8-bit state), ``row_grads`` (the
    ``TokenRowGrads`` the embedding's backward fills), ``undo_embedding`` (restores the
    embedding's forward; None once undone).
    """

    def __init__(self, release, model, rows) -> None:
        """Check ``tied_slabs`` and make the input embedding hand over its rows' gradients."""

        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise InvalidArgument(f"GradientRelease: tied_slabs={rows!r} must be an int >= 1 (rows per slab)")
        why = slab_refusal(release.chain)
        if why:
            raise InvalidArgument(f"GradientRelease: tied_slabs: {why}")
        embed = model.get_input_embeddings() if isinstance(model, torch.nn.Module) else None
        if embed is None or not hasattr(embed, "weight"):
            raise InvalidArgument("GradientRelease: tied_slabs needs the model (an nn.Module whose "
                                  "get_input_embeddings() is an embedding), not a dict of parameters")
        name = release.name_of(embed.weight)
        if name is None:
            raise InvalidArgument("GradientRelease: tied_slabs: the input embedding's weight is not trainable")
        group = release.group_of(name)
        if release.groups[group] != [name]:
            raise InvalidArgument(f"GradientRelease: tied_slabs: the embedding's weight {name!r} shares its release "
                                  f"group {group!r} with {len(release.groups[group]) - 1} other parameters; "
                                  "it must step alone")
        W = release.params[name]
        if W.dim() != 2:
            raise InvalidArgument(f"GradientRelease: tied_slabs: {name!r} is not a [V, D] matrix")
        V, D = W.shape
        leaves = self._slab_leaves(release.states[group], W.shape, name)
        quantized = [x for x in leaves if isinstance(x, Quantized8bit)]
        block = release.chain.max_align() if quantized else 1
        for q in quantized:
            if q.absmax.numel() != -(-V * D // block):
                raise InvalidArgument(f"GradientRelease: tied_slabs: cannot tell the 8-bit block size of {name!r}'s "
                                      f"state ({q.absmax.numel()} blocks for {V}×{D} elements, align {block})")
        if (rows * D) % block:
            raise InvalidArgument(f"GradientRelease: tied_slabs={rows}: the 8-bit state's blocks of {block} elements "
                                  f"must be whole rows of a slab, but {rows}×{D} = {rows * D} is not a multiple of "
                                  f"{block}; pick rows so that rows·{D} is a multiple of {block}")
        sink = TokenRowGrads()
        try:
            self.undo_embedding = row_grad_embedding(model, sink)
        except ValueError as e:
            raise InvalidArgument(f"GradientRelease: tied_slabs: {e}") from None
        sink.on_backward = release.backward_started
        self.rows, self.name, self.block, self.row_grads = rows, name, block, sink

    def remove(self) -> None:
        """Give the input embedding its own forward back (once)."""
        if self.undo_embedding is not None:
            self.undo_embedding()
            self.undo_embedding = None

    @staticmethod
    def _slab_leaves(state, shape, name: str) -> list:
        """The leaves of a slabbed weight's group state; refuses leaves that are neither the
        weight's shape (sliced by rows), 8-bit state of it, nor scalars (shared by all slabs)."""
        import torch.utils._pytree as _pt

        leaves = _pt.tree_leaves(state, is_leaf=lambda x: x is None or isinstance(x, Quantized8bit))
        for x in leaves:
            ok = (x is None or (isinstance(x, Quantized8bit) and tuple(x.codes.shape) == tuple(shape))
                  or (isinstance(x, torch.Tensor) and (tuple(x.shape) == tuple(shape) or x.numel() == 1))
                  or not isinstance(x, (torch.Tensor, Quantized8bit)))
            if not ok:
                raise InvalidArgument(f"GradientRelease: tied_slabs: the chain keeps a state leaf of shape "
                                      f"{tuple(getattr(x, 'shape', ()))} for {name!r} {tuple(shape)}, which is "
                                      "not per element, so it cannot be cut into row slabs")
        return leaves

    def _slab_state(self, state, shape, r0: int, r1: int, D: int):
        """``state`` with every per-element leaf cut to rows [r0, r1) (views)."""
        import torch.utils._pytree as _pt

        b = self.block

        def cut(x):
            if isinstance(x, Quantized8bit):
                return Quantized8bit(x.codes[r0:r1], x.absmax[r0 * D // b: -(-r1 * D // b)])
            if isinstance(x, torch.Tensor) and tuple(x.shape) == tuple(shape) and x.numel() != 1:
                return x[r0:r1]
            return x

        return _pt.tree_map(cut, state, is_leaf=lambda x: x is None or isinstance(x, Quantized8bit))

    @staticmethod
    def _write_back(full, views, new, shape) -> None:
        """Copy a slab's new per-element state into the full state's row views (skipped where
        the update already wrote in place); scalars are left alone (``_merge_state``)."""
        import torch.utils._pytree as _pt

        is_leaf = lambda x: x is None or isinstance(x, Quantized8bit)  # noqa: E731
        for f, v, n in zip(_pt.tree_leaves(full, is_leaf=is_leaf), _pt.tree_leaves(views, is_leaf=is_leaf),
                           _pt.tree_leaves(new, is_leaf=is_leaf)):
            if isinstance(f, Quantized8bit):
                pairs = list(zip(v, n))
            elif isinstance(f, torch.Tensor) and tuple(f.shape) == tuple(shape) and f.numel() != 1:
                pairs = [(v, n)]
            else:
                continue
            for a, c in pairs:
                if a.data_ptr() != c.data_ptr():
                    a.copy_(c)

    def _merge_state(self, full, new_last, shape):
        """The group's state after all slabs: the full per-element leaves (written slab by slab)
        and the scalars (counts, lr) of the last slab's new state (the same for every slab)."""
        import torch.utils._pytree as _pt

        is_leaf = lambda x: x is None or isinstance(x, Quantized8bit)  # noqa: E731
        f_leaves, spec = _pt.tree_flatten(full, is_leaf=is_leaf)
        n_leaves, n_spec = _pt.tree_flatten(new_last, is_leaf=is_leaf)
        if n_spec != spec:
            raise TreeMismatch("tied_slabs: the chain returned a state of another structure")
        out = []
        for f, n in zip(f_leaves, n_leaves):
            per_element = isinstance(f, Quantized8bit) or (
                isinstance(f, torch.Tensor) and tuple(f.shape) == tuple(shape) and f.numel() != 1)
            out.append(f if per_element else n)
        return _pt.tree_unflatten(out, spec)

    def _taken_rows(self, W: torch.Tensor):
        """``(ids [N], rows [N, D], accumulation dtype)`` of the rows the embedding's backward
        kept, on W's device (fp32 sums for low-precision weights), or None when it kept none."""
        parts = self.row_grads.take()
        if not parts:
            return None
        one = len(parts) == 1  # the usual case: no concatenated copy
        ids = (parts[0][0] if one else torch.cat([i for i, _ in parts])).to(W.device).reshape(-1)
        rows = (parts[0][1] if one else torch.cat([r for _, r in parts])).to(W.device)
        acc_dtype = torch.float32 if W.dtype in (torch.bfloat16, torch.float16) else W.dtype
        return ids, rows, acc_dtype

    def _row_grad_sums(self, W: torch.Tensor):
        """The embedding's gradient as (unique ids ascending, their summed rows in W's dtype),
        from the rows its backward kept (fp32 sums for low-precision weights).  ``torch.unique``
        sizes its output by the data: a host sync at the end of backward (a sync-free variant measured
        no faster: docs/performance.md)."""
        taken = self._taken_rows(W)
        if taken is None:
            return None, None
        ids, rows, acc_dtype = taken
        del taken
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        del ids
        sums = torch.zeros(uniq.numel(), W.shape[1], dtype=acc_dtype, device=W.device)
        sums.index_add_(0, inverse, rows if rows.dtype == acc_dtype else rows.to(acc_dtype))
        del rows, inverse
        return uniq, sums.to(W.dtype)

    def step(self, release, group: str) -> None:
        """Step the slabbed weight rows [r0, r0 + rows) at a time: the slab's gradient is
        W.grad's rows (if autograd gave one) + the embedding rows' sums that fall in it + every
        row-addressable contribution (``add_rows_to``), then the chain's update on the slab
        alone (fused kernel on the slab's views, or the plain update on a sub-tree)."""
        name = self.name
        live = release.params[name]
        V, D = live.shape
        target = release.masters.get(name, live.detach())
        sources = release.take_contributions(name)
        uniq, sums = self._row_grad_sums(live)
        starts = list(range(0, V, self.rows))
        bounds = None
        if uniq is not None:
            edges = torch.tensor([*starts, V], device=uniq.device, dtype=uniq.dtype)
            bounds = torch.searchsorted(uniq, edges).tolist()
        full = release.states[group]
        new_last, fused = None, None
        for s, r0 in enumerate(starts):
            r1 = min(r0 + self.rows, V)
            g = torch.zeros(r1 - r0, D, dtype=live.dtype, device=live.device)
            if live.grad is not None:
                g.add_(live.grad[r0:r1])
            if bounds is not None and bounds[s + 1] > bounds[s]:
                lo, hi = bounds[s], bounds[s + 1]
                g.index_add_(0, uniq[lo:hi] - r0, sums[lo:hi])
            for src in sources:
                src.add_rows_to(g, r0, r1)
            p_slab = target[r0:r1]
            g = g.to(p_slab.dtype) if g.dtype != p_slab.dtype else g
            release.record_norm(g)
            views = self._slab_state(full, live.shape, r0, r1, D)
            release.state_ready(group, views)  # (offloaded: this slab's share of the state is there)
            new = None
            if fused is not False:
                new = release.fused_slab_update(views, {name: p_slab}, {name: g}, s)
                fused = new is not None
            if new is not None:
                self._write_back(full, views, new, live.shape)
                if name in release.masters:
                    live[r0:r1].copy_(p_slab)
            else:
                updates, new = release.chain.update({name: g}, views, {name: p_slab})
                del g
                self._write_back(full, views, new, live.shape)
                # rows [r0, r1) draw the whole weight's noise at their offsets: as the dense step
                piece = pf.apply_updates({"p": p_slab}, {"p": updates[name]}, start=r0 * D,
                                         **release.rounding(name, new))["p"]
                if name in release.masters:
                    p_slab.copy_(piece)
                live[r0:r1].copy_(piece)
            new_last = new
        live.grad = None
        for src in sources:
            src.discard()
        release.states[group] = self._merge_state(full, new_last, live.shape)
        if fused:
            release.fused_group_steps += 1
        else:
            release.plain_group_steps += 1
