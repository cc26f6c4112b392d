"""ZClip: z-score spike clipping on the global gradient norm (docs/techniques/zclip.md).

Kumar, Owen, Roy Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
arXiv 2504.02507.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import device_of, f32_scalar, increment, zero_count
from pgs.func.base import DIRECTION, GLOBAL, Transform, check_range
from pgs.func.clip import global_norm
from pgs.func.step import NO_CONTEXT, StepContext

MODES = ("clip", "skip")


class ZClipState(NamedTuple):
    count: torch.Tensor  # int32: updates seen so far
    mean: torch.Tensor  # fp32 μ of the global norm
    var: torch.Tensor  # fp32 σ² of the global norm
    norm: torch.Tensor  # fp32: the last incoming global norm (before clipping), for logging
    spike: torch.Tensor  # bool: whether the last step was a spike
    skipped: torch.Tensor  # int32: spikes skipped so far (mode "skip")

    reports = (("grad_norm", "norm"), ("spike", "spike"), ("spikes_skipped", "skipped"))  # pgs.func.reported


def zclip(alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25, mode: str = "clip",
          max_grad_norm: float | None = None, eps: float = 1e-6, clip_factor: float = 1.0) -> Transform:
    """Clip (or skip) a gradient whose global norm is a z-score outlier of its recent history.

    g_t = ‖g‖ global.  Warmup (t ≤ W): μ, σ² = running mean and population variance of
    g_1..g_t; no z-clipping (only ``max_grad_norm``).  After warmup:

        z_t  = (g_t − μ)/(σ + ε) ;  spike = z_t > z_thr
        g*_t = clip_factor·(μ + z_thr² σ / z_t)  on a spike, else g_t
        eff  = min(g*_t, max_grad_norm) ;  g ← g·eff/(g_t + ε) when g_t > eff
        μ ← αμ + (1−α) g*_t ;  σ² ← ασ² + (1−α)(g*_t − μ_new)²        (EMA of the CLIPPED norm)

    mode "clip" does the above.  mode "skip" emits zero updates on a spike, leaves μ, σ
    untouched and *vetoes the step* (``Transform.skip_of``): the chain that holds it carries
    every other stage's state over unchanged and emits no update, so the weights and, e.g.,
    Adam's moments after a skipped spike are bit for bit what they were before it
    (``state.skipped`` counts these; the runtime logs them as skipped steps).  A non-finite
    norm always counts as a spike, never touches the statistics and vetoes the step in either
    mode (clipping cannot make it finite).  ``state.spike`` says whether the last step was a
    spike; ``state.norm`` is the incoming norm.

    Args:
        alpha: α in [0, 1), EMA decay of the statistics.
        z_thresh: z_thr > 0.
        warmup_steps: W ≥ 1, steps used to seed μ and σ.
        mode: "clip" | "skip".
        max_grad_norm: optional absolute cap on the global norm (as clip_by_global_norm).
        eps: ε ≥ 0.
        clip_factor: the factor on the clipped norm (1.0 in the paper's defaults).

    Example::

        opt = pf.chain(pf.zclip(mode="skip"), pf.adamw(3e-4))

    Paper: arXiv 2504.02507 (zscore mode, adaptive scaling).
    """
    who = "zclip"
    check_range("alpha", alpha, 0.0, 1.0, hi_open=True, who=who)
    check_range("z_thresh", z_thresh, 0.0, None, lo_open=True, who=who)
    check_range("warmup_steps", warmup_steps, 1.0, None, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    check_range("clip_factor", clip_factor, 0.0, None, lo_open=True, who=who)
    if max_grad_norm is not None:
        check_range("max_grad_norm", max_grad_norm, 0.0, None, lo_open=True, who=who)
    if mode not in MODES:
        raise InvalidArgument(f"{who}: mode={mode!r}, expected one of {MODES}")

    def init(params, **extra):
        dev = device_of(params)
        z = torch.zeros((), dtype=torch.float32, device=dev)
        return ZClipState(zero_count(params), z, z.clone(), z.clone(), torch.zeros((), dtype=torch.bool, device=dev),
                          torch.zeros((), dtype=torch.int32, device=dev))

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        count = increment(state.count)
        g = global_norm(updates, ctx.layout, ctx.reduce_sum)
        alpha_, z_thr, eps_, cf = (f32_scalar(v, g) for v in (alpha, z_thresh, eps, clip_factor))
        cap = None if max_grad_norm is None else f32_scalar(max_grad_norm, g)
        finite = torch.isfinite(g)
        warm = count <= warmup_steps
        mu, var = state.mean, state.var
        std = var.clamp(min=0.0).sqrt()
        z = (g - mu) / (std + eps_)
        spike = (~warm & (z > z_thr)) | ~finite
        z_safe = torch.where(spike & finite, z, torch.ones_like(z))
        g_star = torch.where(spike & finite, cf * (mu + z_thr * z_thr * std / z_safe), g)
        eff = g_star if max_grad_norm is None else torch.minimum(g_star, cap)
        scale = torch.where(g > eff, eff / (g + eps_), torch.ones_like(g))
        if mode == "skip":
            scale = torch.where(spike, torch.zeros_like(scale), scale)

        # statistics: Welford during warmup, EMA of the clipped norm afterwards
        k = count.to(torch.float32)
        d = g - mu
        mu_w = mu + d / k
        var_w = var + (d * (g - mu_w) - var) / k
        mu_e = alpha_ * mu + (1.0 - alpha_) * g_star
        var_e = alpha_ * var + (1.0 - alpha_) * (g_star - mu_e) ** 2
        keep = ~finite | (spike if mode == "skip" else torch.zeros_like(spike))
        new_mu = torch.where(keep, mu, torch.where(warm, mu_w, mu_e))
        new_var = torch.where(keep, var, torch.where(warm, var_w, var_e))

        def one(x):
            cd = torch.promote_types(x.dtype, torch.float32)
            y = x.to(cd) * scale.to(cd)
            if mode == "skip":  # a spike emits exact zeros, even for non-finite gradients
                y = torch.where(spike, torch.zeros_like(y), y)
            return y.to(x.dtype)

        skipped = state.skipped + (spike.to(torch.int32) if mode == "skip" else 0)
        return T.tree_map(one, updates), ZClipState(count, new_mu, new_var, g, spike, skipped)

    if mode == "skip":
        skip_of = lambda state: state.spike  # noqa: E731
    else:
        skip_of = lambda state: ~torch.isfinite(state.norm)  # noqa: E731
    return Transform(init, update, name="zclip", locality=GLOBAL, shard_aware=True, skip_of=skip_of,
                     stage=DIRECTION)
