"""The execution layer: run a chain on the flat layout, fused and optionally in place.

``pf.compile(opt)`` returns a ``FlatChain`` with the same ``init``/``update`` contract as
``opt`` (same results), plus ``step`` (update and apply in one pass).  What it does:

1. Builds a ``Layout`` from the parameters once: one buffer per (dtype, device, labels)
   group, every tensor aligned to ``align`` elements.
2. Keeps the chain's state on that layout (one buffer per group per moment).
3. Runs ``opt.update`` on the flat trees — every elementwise stage sees one leaf per group;
   per-tensor reductions are segmented; transforms that need matrices get views.
4. With ``jit=True`` the whole update is one ``torch.compile`` graph: the elementwise stages
   fuse into a few kernels over the flat buffers, and hyperparameters are tensors in state,
   so nothing recompiles when the learning rate changes.
5. With ``donate=True`` the state (and, in ``step``, the parameters) are updated in place:
   the caller gives up the old buffers and no second copy of the state is ever allocated.

Gradients that already are views of the layout's buffers (the runtime arranges this with
``FlatChain.bind_buffers``) are read with no copy; otherwise they are gathered once.

Whether ``step`` runs a fused kernel instead of the generic graph is the plan registry's
decision (``pgs.func.plan.plan_for(opt, FLAT)``); the transforms see the layout as
``ctx.layout`` of their ``StepContext``.
"""

from __future__ import annotations

from typing import Callable

import torch

from pgs.errors import InvalidArgument
from pgs.func import fused_adamw_lion as _fused, tree as T
from pgs.func.apply import sr_seeds, step_count, stochastic_round_to_bf16
from pgs.func.base import Transform
from pgs.func.layout import Layout, call_init, call_update
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions, memory_options
from pgs.func.plan import FLAT, Plan, plan_for
from pgs.func.step import context_of


class FlatChain:
    """A transform run on the flat layout.  See the module docstring."""

    def __init__(self, opt: Transform, *, jit: bool = True, donate: bool = False, align: int = 256,
                 memory: MemoryOptions = NO_MEMORY_OPTIONS, compile_options: dict | None = None, fused: bool = True):
        if not isinstance(opt, Transform):
            raise InvalidArgument(f"compile: expected a pgs.func.Transform, got {type(opt).__name__}")
        self.opt = opt
        self.jit = jit
        self.donate = donate
        self.memory = memory_options(memory, "compile")
        import math

        self.align = math.lcm(int(align), opt.max_align())
        self.group_by = opt.all_group_by()
        self.layout: Layout | None = None
        self._compile_options = compile_options or {}
        self._update_fn = None
        self._step_fn = None
        #: the fused plan ``step`` tries first (None: always the generic graph)
        self.plan: Plan | None = plan_for(opt, FLAT) if fused else None

    # -- layout ------------------------------------------------------------------------
    def layout_for(self, params) -> Layout:
        if self.layout is None or not self.layout.matches(params):
            self.layout = Layout(params, align=self.align, group_by=self.group_by)
            self._update_fn = self._step_fn = None
        return self.layout

    def flatten(self, tree, dtype=None, what="tree"):
        if self.layout is None:
            raise InvalidArgument("compile: call init(params) before update()")
        return self.layout.flatten(tree, dtype, what=what)

    def unflatten(self, flat):
        return self.layout.unflatten(flat)

    # -- the Transform contract --------------------------------------------------------
    def init(self, params, **extra):
        layout = self.layout_for(params)
        flat_p = layout.flatten(params, what="params")
        return call_init(self.opt, flat_p, {**extra, "ctx": context_of(extra).evolve(layout=layout)})

    def update(self, updates, state, params=None, **extra):
        """Same contract and results as ``opt.update`` on the per-parameter tree."""
        layout = self.layout
        if layout is None:
            raise InvalidArgument("compile: call init(params) before update()")
        fu = layout.flatten(updates, what="updates")
        fp = None if params is None else layout.flatten(params, what="params")
        if self._update_fn is None:
            self._update_fn = self._build(self._flat_update)
        u, s = self._update_fn(fu, state, fp, extra)
        return layout.unflatten(u), s

    def update_flat(self, flat_updates: dict, state, flat_params: dict | None = None, **extra):
        """``update`` on trees already in flat form (what the runtime calls)."""
        if self._update_fn is None:
            self._update_fn = self._build(self._flat_update)
        return self._update_fn(flat_updates, state, flat_params, extra)

    def step(self, grads, state, params, **extra):
        """Update and apply in one pass: returns ``(new_params, new_state)``.

        With ``donate=True`` the parameters' and the state's buffers are overwritten in place
        (when ``params`` are views of one flat buffer per group, e.g. after ``bind_buffers``,
        the caller's tensors see the new values with no copy at all).
        """
        layout = self.layout
        if layout is None:
            raise InvalidArgument("compile: call init(params) before step()")
        fg = layout.flatten(grads, what="grads")
        fp = layout.flatten(params, what="params")
        new_p, new_s = self.step_flat(fg, state, fp, **extra)
        if self.donate:
            if all(new_p.get(k) is v for k, v in fp.items()) and layout.zero_copy(fp):
                return params, new_s  # updated in place: the parameters are views of these buffers
            leaves, _ = T.flatten(params)
            views = T.leaves(layout.unflatten(new_p))
            for p, v in zip(leaves, views):
                if p is not None and p.data_ptr() != v.data_ptr():
                    p.copy_(v)
            return params, new_s
        return layout.unflatten(new_p), new_s

    def step_flat(self, flat_grads: dict, state, flat_params: dict, **extra):
        if self.plan is not None:  # a fused update-and-apply; None where it cannot serve this call
            ctx = context_of(extra).evolve(layout=self.layout)
            rest = {k: v for k, v in extra.items() if k != "ctx"}
            out = self.plan.step(flat_grads, state, flat_params, ctx=ctx, donate=self.donate,
                                 memory=self.memory, extra=rest)
            if out is not None:
                return out
        if self._step_fn is None:
            self._step_fn = self._build(self._flat_step)
        return self._step_fn(flat_grads, state, flat_params, extra)

    def uses_fused_kernel(self) -> bool:
        """True when ``step`` runs the hand-written AdamW/Lion kernels (``pgs.func.fused_adamw_lion``)."""
        if (self.plan is None or self.plan.name != "adamw_lion" or self.memory.stochastic_rounding
                or self.layout is None):
            return False

        return _fused.available(self.layout)

    # -- internals ---------------------------------------------------------------------
    def _flat_update(self, fu, state, fp, extra):
        u, s = call_update(self.opt, fu, state, fp, {**extra, "ctx": context_of(extra).evolve(layout=self.layout)})
        if self.donate:
            s = T.donate(state, s)
        return u, s

    def _flat_step(self, fg, state, fp, extra):
        ctx = context_of(extra).evolve(layout=self.layout)
        u, s = call_update(self.opt, fg, state, fp, {**extra, "ctx": ctx})
        new_p = {}
        seeds = None
        for j, (k, p) in enumerate(fp.items()):
            cd = torch.promote_types(p.dtype, torch.float32)
            x = p.to(cd) + u[k].to(cd)
            if self.memory.stochastic_rounding and p.dtype == torch.bfloat16:
                # group buffer j's noise: the hash stream of the new state's step count and the
                # buffer's index (pgs.func.apply), never torch's global generator
                if seeds is None:
                    seeds = sr_seeds(step_count(s), ctx.sr_offset, len(fp))
                x = stochastic_round_to_bf16(x, seed=seeds[j])
            else:
                x = x.to(p.dtype)
            if self.donate:
                p.copy_(x)
                x = p
            new_p[k] = x
        if self.donate:
            s = T.donate(state, s)
        return new_p, s

    def _build(self, fn: Callable):
        if not self.jit:
            return fn
        opts = {"fullgraph": False, "dynamic": False, **self._compile_options}
        return torch.compile(fn, **opts)

    def bind_buffers(self, params) -> dict[str, torch.Tensor]:
        """Re-home ``params`` (leaf tensors) into the layout's flat buffers; returns the buffers.

        Afterwards every parameter is a view of its group's buffer, so ``flatten`` is free.
        Used by the runtime for parameters and for gradient buffers.
        """
        layout = self.layout_for(params)
        flat = layout.flatten(params, what="params")
        views = T.leaves(layout.unflatten(flat))
        for p, v in zip(T.leaves(params), views):
            if p is not None and p.data_ptr() != v.data_ptr():
                p.data = v
        return flat


def compile(opt: Transform, *, jit: bool = True, donate: bool = False, align: int = 256,
            memory: MemoryOptions = NO_MEMORY_OPTIONS, compile_options: dict | None = None,
            fused: bool = True) -> FlatChain:
    """Run ``opt`` on the flat layout (see ``pgs.func.flat_chain`` module docs).

    Args:
        opt: any transform or chain.
        jit: wrap the flat update in ``torch.compile`` (False: the same flat code, eager).
        donate: update state (and parameters in ``step``) in place.
        align: element alignment of each tensor inside its group (a multiple of every
            transform's own ``align``, e.g. the 8-bit block size).
        memory: a ``pf.MemoryOptions``; with ``stochastic_rounding`` ``step`` rounds bf16
            parameters stochastically, with noise seeded by the chain state's step count
            (``pgs.func.apply``; the fused plans seed theirs alike),
            so ``step`` is a function of (grads, state, params).
        fused: let ``step`` use the fused plan the registry has for the chain
            (``pgs.func.plan``: the 8-bit and Muon chains' own steps, AdamW/Lion kernels, the
            AdaGC/MONA/Lion8bit/hyperball passes) where the device supports it.

    Example::

        fast = pf.compile(pf.adamw(1e-3), donate=True)
        state = fast.init(params)
        params, state = fast.step(grads, state, params)
    """
    return FlatChain(opt, jit=jit, donate=donate, align=align, memory=memory,
                     compile_options=compile_options, fused=fused)
