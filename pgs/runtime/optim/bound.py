"""Binding a pure chain to a module's parameters: ``bind(chain, module)``.

The runtime side of the two-layer design.  A ``BoundOptimizer`` owns the chain's state and
applies ``chain.update`` to the module's gradients in place of ``torch.optim``:

    opt = pgs.runtime.bind(pf.adamw(3e-4, weight_decay=0.1), model, compile=True)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

With ``compile=True`` the parameters are moved into the flat layout's buffers (every
parameter becomes a view of one buffer per group) and every ``.grad`` is a view of a flat
gradient buffer, so the step reads and writes whole buffers: no gathering, no Python loop
over tensors, state and parameters updated in place (donated).  ``jit=True`` additionally
compiles the flat step with ``torch.compile``.  Without ``compile`` the chain runs on the
per-parameter tree (the reference path) and the result is written back into the parameters.
"""

from __future__ import annotations

import contextlib
import json
from typing import Iterator, Mapping

import torch

import pgs.func as pf
from pgs.errors import CheckpointError, InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.func.base import no_step_stage
from pgs.func.schedule_free_iterates import eval_point, has_schedule_free, schedule_free_state
from pgs.runtime.optim.interface import StepMetrics, binder_options, step_metrics

_LAYOUT_KEY = "__pgs_layout__"
#: Elements per slice when ``eval_weights`` writes a schedule-free chain's x into the weights.
_EVAL_SLICE = 1 << 24


def trainable_parameters(module_or_params, who: str) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` of the trainable parameters of a module or a name -> Parameter dict
    (tied weights once); an empty set or another type is refused, naming ``who``."""
    if isinstance(module_or_params, torch.nn.Module):
        params = {n: p for n, p in module_or_params.named_parameters() if p.requires_grad}
    elif isinstance(module_or_params, dict):
        params = {n: p for n, p in module_or_params.items() if p.requires_grad}
    else:
        raise InvalidArgument(f"{who}: expected an nn.Module or a dict name -> Parameter")
    if not params:
        raise InvalidArgument(f"{who}: the module has no trainable parameters")
    return params


class BoundOptimizer:
    """A pure chain bound to live parameters (a ``pgs.runtime.optim.Optimizer``).  See the
    module docstring."""

    in_backward = False
    defers_contributions = True

    def __init__(
        self,
        chain: pf.Transform,
        module_or_params,
        *,
        compile: bool = False,
        jit: bool = False,
        donate: bool = True,
        memory: pf.MemoryOptions = pf.NO_MEMORY_OPTIONS,
        align: int = 256,
        fused: bool = True,
    ):
        if not isinstance(chain, pf.Transform):
            raise InvalidArgument(f"bind: expected a pgs.func.Transform, got {type(chain).__name__}")
        why = no_step_stage(chain)
        if why:
            raise InvalidArgument(f"bind: {why}")
        params = trainable_parameters(module_or_params, "bind")
        self.chain = chain
        self.params = params
        self.compiled = bool(compile)
        self.memory = binder_options(memory, "bind")
        self._last_grads = None
        self._before: dict[str, list] = {}
        if self.compiled:
            self.flat = pf.compile(chain, jit=jit, donate=donate, align=align, memory=self.memory, fused=fused)
            with torch.no_grad():
                self.param_bufs = self.flat.bind_buffers(params)
            self.grad_bufs = {k: torch.zeros_like(b) for k, b in self.param_bufs.items()}
            self._attach_grads()
            self.state = self.flat.init(self.param_bufs_tree())
        else:
            self.flat = None
            self.state = chain.init(self._detached())

    # -- helpers -------------------------------------------------------------------------
    def _detached(self):
        return {n: p.detach() for n, p in self.params.items()}

    def param_bufs_tree(self):
        return self._detached()

    def _attach_grads(self):
        self._grad_views = T.leaves(self.flat.unflatten(self.grad_bufs))
        for p, v in zip(self.params.values(), self._grad_views):
            p.grad = v

    def _grads_tree(self):
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}

    # -- the torch.optim-like surface -------------------------------------------------
    def before_step(self, param: torch.Tensor, contribution) -> None:
        """At the next ``step()``, add ``contribution`` into ``param``'s gradient first (a function
        ``fn(grad)`` adding in place, or an object with ``add_to(grad)``); dropped by ``zero_grad``."""
        name = next((n for n, p in self.params.items() if p is param), None)
        if name is None:
            raise InvalidArgument("BoundOptimizer.before_step: not one of the bound parameters")
        fn = contribution if callable(contribution) else getattr(contribution, "add_to", None)
        if not callable(fn):
            raise InvalidArgument("BoundOptimizer.before_step: expected fn(grad) or an object with add_to(grad)")
        self._before.setdefault(name, []).append(fn)

    @torch.no_grad()
    def _run_before(self) -> None:
        for name, fns in self._before.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            for fn in fns:
                fn(p.grad)
        self._before.clear()

    @torch.no_grad()
    def step(self, **extra) -> None:
        """Apply the chain to the current gradients and update the parameters in place."""
        self._run_before()
        if self.compiled:
            for p, v in zip(self.params.values(), self._grad_views):
                if p.grad is not v:
                    # someone replaced .grad (e.g. module.zero_grad() set it to None, and
                    # backward allocated a new one): bring it back into the flat buffer
                    if p.grad is None:
                        v.zero_()
                    else:
                        v.copy_(p.grad)
                    p.grad = v
            new_p, self.state = self.flat.step_flat(self.grad_bufs, self.state, self.param_bufs, **extra)
            if new_p is not self.param_bufs:
                for k, buf in self.param_bufs.items():
                    if new_p[k].data_ptr() != buf.data_ptr():
                        buf.copy_(new_p[k])
            return
        grads = self._grads_tree()
        params = self._detached()
        updates, self.state = self.chain.update(grads, self.state, params, **extra)
        new = pf.apply_updates(params, updates, memory=self.memory, state=self.state)
        for n, p in self.params.items():
            p.copy_(new[n])

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the flat path zeroes its gradient buffers and keeps the views)."""
        self._before.clear()
        if self.compiled:
            for b in self.grad_bufs.values():
                b.zero_()
            self._attach_grads()
            return
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- where the model is evaluated ---------------------------------------------------
    @property
    def evaluates_elsewhere(self) -> bool:
        """Whether the chain's evaluation point is not the parameters it steps (schedule-free:
        gradients are taken at y, the model is evaluated and exported at x)."""
        return has_schedule_free(self.state)

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        """Inside: the parameters hold the chain's evaluation point (``pf.schedule_free_eval_params``:
        x); after: the parameters it steps, bit for bit (kept on the CPU meanwhile).  x is
        written in place slice by slice, so the device holds no second copy of the weights.
        Nothing moves for a chain that evaluates where it steps."""
        if not self.evaluates_elsewhere:
            yield
            return
        live = self.param_bufs if self.compiled else self._detached()
        sf = schedule_free_state(self.state)
        T.check_same_structure(live, sf.z, "parameters", "schedule-free z")
        kept = {}
        with torch.no_grad():
            for k, y in live.items():
                z = sf.z[k]
                kept[k] = y.to("cpu", copy=True)
                if not (y.is_contiguous() and z.is_contiguous()):
                    y.copy_(eval_point(y, z, sf.b1))
                    continue
                fy, fz = y.view(-1), z.view(-1)
                for s in range(0, fy.numel(), _EVAL_SLICE):
                    fy[s:s + _EVAL_SLICE].copy_(eval_point(fy[s:s + _EVAL_SLICE], fz[s:s + _EVAL_SLICE], sf.b1))
        try:
            yield
        finally:
            with torch.no_grad():
                for k, y in live.items():
                    y.copy_(kept[k])

    # -- state --------------------------------------------------------------------------
    def _layout_fingerprint(self) -> torch.Tensor:
        if self.compiled:
            desc = {k: list(g.paths) for k, g in self.flat.layout.groups.items()}
        else:
            desc = {"tree": list(self.params)}
        return torch.frombuffer(bytearray(json.dumps(desc, sort_keys=True).encode()), dtype=torch.uint8).clone()

    def state_dict(self, device: str | torch.device | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
        """The chain's state as ``{path: tensor}`` (safetensors-ready), plus a layout fingerprint;
        ``device``: copy each tensor straight there (``"cpu"`` for a checkpoint); ``copy=False``:
        the live state's tensors themselves (``pf.state_to_dict``), for a streaming write."""
        d = pf.state_to_dict(self.state, device, copy)
        d[_LAYOUT_KEY] = self._layout_fingerprint()
        return d

    @torch.no_grad()
    def load_state_dict(self, d: Mapping[str, torch.Tensor]) -> None:
        """Restore state written by ``state_dict``; refuses a different parameter layout.

        Each entry is copied into the state's own tensor (the donated buffers of a compiled
        chain stay), one at a time: ``d`` may be a lazily read file
        (``Checkpoint.optimizer``), and no second copy of the state is ever made on the device."""
        fp = d.get(_LAYOUT_KEY)
        if fp is None or not torch.equal(fp.to(torch.uint8), self._layout_fingerprint()):
            raise TreeMismatch(
                "optimizer state was saved for a different set of trainable parameters "
                "(freeze policy, model or compile setting changed)"
            )
        for leaf, entry in pf.state_entries(self.state, d, ignore=lambda k: k == _LAYOUT_KEY):
            leaf.copy_(entry)

    def dcp_state(self) -> dict[str, torch.Tensor]:
        """The state as DCP entries (by path, no fingerprint); the per-parameter path only, so
        that one process can load what several wrote (``pgs.runtime.store.dcp``)."""
        if self.compiled:
            raise CheckpointError("a sharded checkpoint loads into an optimizer bound without compile=True only")
        return pf.state_to_dict(self.state)

    def load_dcp_state(self, loaded: dict[str, torch.Tensor]) -> None:
        if self.compiled:
            raise CheckpointError("a sharded checkpoint loads into an optimizer bound without compile=True only")
        self.state = pf.state_from_dict(self.state, {k: v.detach().clone() for k, v in loaded.items()})

    def state_bytes(self) -> int:
        """Bytes of the chain's state."""
        return int(pf.state_bytes(self.state))

    # -- what the runtime logs ----------------------------------------------------------
    def metrics(self, *, tensors: bool = False) -> StepMetrics:
        """What the chain's state reports for the last step (``pf.reported_metrics``)."""
        return step_metrics(self.state, self.chain, tensors=tensors)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The global norm of the current gradients (fp32)."""
        if self.compiled:
            return float(pf.global_norm(self.grad_bufs))
        return float(pf.global_norm(self._grads_tree()))


def bind(chain: pf.Transform, module_or_params, **kwargs) -> BoundOptimizer:
    """Bind ``chain`` to ``module``'s trainable parameters.  See ``BoundOptimizer``."""
    return BoundOptimizer(chain, module_or_params, **kwargs)
