"""Fused AdamW/Lion kernels standing in for recognised chains (the ``adamw_lion`` entry of
the plan registry, ``pgs.func.plan``).

``match(opt)`` says whether the chain is one that a hand-written kernel implements exactly:
``chain(scale_by_adam | scale_by_lion, [add_decayed_weights], scale_by_learning_rate)`` with
Python-number hyperparameters (identities anywhere are ignored).
If so, and the buffers live on a device the kernel runs on, the plan's step
runs one kernel per group that reads gradient, parameter and moments once and writes
parameter and moments once — the byte floor.  The per-step scalars (lr from the schedule,
bias corrections) are computed first by a few 0-d tensor ops on the device, so the host
never synchronises and nothing recompiles.

The state produced is the chain's own state (same NamedTuples, same buffers), so a run can
switch between the fused kernel, the compiled graph and the reference path at any step.
Everything else falls back to the generic ``torch.compile`` graph.

Papers: AdamW, Loshchilov & Hutter arXiv 1711.05101 (Adam: Kingma & Ba arXiv 1412.6980);
Lion, Chen et al. arXiv 2302.06675.
"""

from __future__ import annotations

import attrs
import torch

from pgs.func._common import increment
from pgs.func.layout import Layout, group_label
from pgs.func.learning_rate import ScaleByLearningRateState, lr_value
from pgs.func.memory_options import MemoryOptions
from pgs.func.step import StepContext


@attrs.frozen
class FusedPlan:
    kind: str  # "adam" | "lion"
    direction_key: str
    decay_key: str | None
    lr_key: str
    direction: dict
    decay: dict | None
    lr: dict


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def match(opt) -> FusedPlan | None:
    """A ``FusedPlan`` when ``opt`` is a chain a fused kernel implements exactly, else None."""
    if opt.name != "chain" or not opt.children:
        return None
    keys = [f"{i}_{c.name}" for i, c in enumerate(opt.children)]
    items = [(k, c.fused) for k, c in zip(keys, opt.children)]
    if any(f is None for _, f in items):
        return None
    items = [(k, f) for k, f in items if f[0] != "identity"]
    kinds = [f[0] for _, f in items]
    if kinds not in (["adam", "lr"], ["adam", "decay", "lr"], ["lion", "lr"], ["lion", "decay", "lr"]):
        return None
    direction = items[0][1][1]
    if not all(_is_number(v) for v in direction.values()):
        return None
    if kinds[0] == "adam" and direction["eps_root"] != 0:
        return None
    decay = items[1][1][1] if kinds[1] == "decay" else None
    if decay is not None and not _is_number(decay["weight_decay"]):
        return None
    lr = items[-1][1][1]
    if not lr["flip_sign"] or isinstance(lr["learning_rate"], torch.Tensor):
        return None
    return FusedPlan(
        kind=kinds[0],
        direction_key=items[0][0],
        decay_key=items[1][0] if decay is not None else None,
        lr_key=items[-1][0],
        direction=direction,
        decay=decay,
        lr=lr,
    )


def available(layout: Layout) -> bool:
    """Whether the fused kernels can run on this layout's devices."""
    return available_on({g.device.type for g in layout.groups.values()})


def available_on(devs: set[str]) -> bool:
    """Whether the fused kernels can run on tensors of these device types (``{"cuda"}``, ...)."""
    from pgs.func.kernels import elementwise as K

    if not K.HAVE_TRITON:
        return False
    if devs == {"cuda"}:
        return True
    # On CPU only in Triton's interpreter, and only when asked (tests): it is slow.
    from pgs.func import kernels

    return devs == {"cpu"} and kernels.triton_on_cpu()


def plan_step(plan: FusedPlan):
    """The registry's step function for ``plan``: None (the generic path) where the kernels
    do not run, i.e. devices without them, or stochastic rounding of a flat layout.  Per-tensor
    trees (gradient release) round bf16 parameters stochastically in the kernel, with the
    noise the plain path draws (``pf.apply_updates``: tensor i of the call seeded by
    ``sr_seed(count, ctx.sr_offset + i)`` of the new state's count)."""

    def fused_step(grads, state, params, *, ctx: StepContext, donate, memory: MemoryOptions, extra=None):
        layout = ctx.layout
        if layout is not None:
            if memory.stochastic_rounding or not available(layout):
                return None
        elif not available_on({t.device.type for t in params.values()}):
            return None
        return step(plan, layout, grads, state, params, donate=donate,
                    sr_offset=ctx.sr_offset if memory.stochastic_rounding else None)

    return fused_step


def step(plan: FusedPlan, layout: Layout, grads: dict, state: dict, params: dict, *, donate: bool,
         sr_offset: int | None = None):
    """One fused update-and-apply; returns ``(new_params, new_state)`` in the chain's state form.
    ``sr_offset`` (per-tensor trees only): round bf16 parameters stochastically, tensor i with the
    seed ``sr_seed(new count, sr_offset + i)``."""
    from pgs.func.apply import step_count
    from pgs.func.kernels import elementwise as K
    from pgs.func.kernels.fused_transform import sr_seeds

    sd = state[plan.direction_key]
    sl = state[plan.lr_key]
    lr = lr_value(plan.lr["learning_rate"], sl.count)
    count = increment(sd.count)
    if plan.kind == "adam":
        t = count.to(torch.float64)
        bc1 = 1.0 - plan.direction["b1"] ** t
        bc2 = 1.0 - plan.direction["b2"] ** t
        scalars = torch.stack([lr, bc1, bc2]).to(torch.float32)
    else:
        scalars = lr.reshape(1).to(torch.float32)
    wd_by_group = {}
    if plan.decay is not None:
        mask = plan.decay["mask"]
        labels = group_label(layout, params, mask) if mask is not None else None
        for k in params:
            wd_by_group[k] = float(plan.decay["weight_decay"]) if labels is None or labels[k] else 0.0
    new_p = {}
    moments = [sd.mu] + ([sd.nu] if plan.kind == "adam" else [])
    if not donate:
        params = {k: v.clone() for k, v in params.items()}
        moments = [{k: v.clone() for k, v in m.items()} for m in moments]
    new_state = dict(state)  # the moments are updated in place below
    if plan.kind == "adam":
        new_state[plan.direction_key] = type(sd)(count, moments[0], moments[1])
    else:
        new_state[plan.direction_key] = type(sd)(count, moments[0])
    new_state[plan.lr_key] = ScaleByLearningRateState(increment(sl.count), lr)
    seeds = [None] * len(params)
    if sr_offset is not None and any(p.dtype == torch.bfloat16 for p in params.values()):
        seeds = sr_seeds(step_count(new_state), sr_offset, len(params)).unbind(0)
    for (k, p), seed in zip(params.items(), seeds):
        wd = wd_by_group.get(k, 0.0)
        if plan.kind == "adam":
            K.adamw_step_(p, grads[k], moments[0][k], moments[1][k], scalars,
                          plan.direction["b1"], plan.direction["b2"], plan.direction["eps"], wd, seed=seed)
        else:
            K.lion_step_(p, grads[k], moments[0][k], scalars, plan.direction["b1"], plan.direction["b2"], wd,
                         seed=seed)
        new_p[k] = p
    return new_p, new_state
