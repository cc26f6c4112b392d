"""The fused step of ``chain(adagc, mona, scale_by_lion8bit, hyperball)``.

``pf.compile(pf.chain(pf.adagc(), pf.mona(), pf.scale_by_lion8bit(), pf.hyperball(lr)))``
recognises this exact four-stage pattern (``match``) and its ``step`` then runs three
hand-written passes per flat group instead of the generic graph (``pgs.func.kernels.chain8bit``):

Pass A (2 B/param: read g).  Per-block Σg², segment-summed per tensor (as ``layout._segment_sum``).
AdaGC (Wang et al., arXiv 2502.11034; docs/techniques/adagc.md), on the host over ``[num_tensors]``:

    warmup (t < T_w, and t = 1):  h = min(λ_abs/(‖g‖_global + ε), 1)
                                   γ_i = ‖ĝ_i‖ at t = 1, then min(γ_i, ‖ĝ_i‖)
    after:                         h_i = min(λ_rel γ_i/(‖g_i‖ + ε), 1);  γ_i ← β γ_i + (1−β)‖ĝ_i‖

Pass B (bf16 g, θ, MONA buffers, 8-bit m: 14.25 B/param on constrained tensors, 16 on the
others).  One kernel: ĝ = h_i g; MONA (docs/techniques/mona.md; Δ = ĝ − prev, A ← β A + (1−β) Δ, G̃ = ĝ + α A);
Lion with a block-wise 8-bit momentum (Chen et al. arXiv 2302.06675, Dettmers et al.
arXiv 2110.02861; docs/techniques/lion.md, 8bit.md): c = β1 m + (1−β1) G̃, u = sign(c), m ← β2 m + (1−β2) G̃, m
dequantized and requantized in registers with the codes of ``blockwise8.lion8bit_kernel``.
On tensors hyperball constrains it stores u in 2 bits (int8 for odd block sizes) and per-block Σu²,
Σθu, Σθ²; on the others it applies θ ← θ + rnd(−η u) directly (hyperball's base rule).

Hyperball (Wen et al. arXiv 2606.16899, Algorithm 1; docs/techniques/hyperball.md) on the host over ``[num_tensors]``:
coef = η R/max(‖u‖, ε), ‖θ̃‖² = ‖θ‖² − 2 coef ⟨θ, u⟩ + coef² ‖u‖² (θ̃ = θ − coef u, expanded
so that θ̃ is never stored), shrink = R/max(‖θ̃‖, ε).

Pass C (4.25 B/param on constrained tensors: read θ and u, write θ).  θ ← θ + rnd(shrink·θ̃ − θ).

Total 20.5 B/param on constrained tensors (22 with an int8 direction) against the
single-pass floor of 16 (the second reads of g and θ and the direction's write and read are
the price of the two per-tensor norms).
``rnd`` rounds to the gradient's dtype as the generic path's intermediate ``updates`` do;
every cast of the generic path is reproduced, so the result equals ``pf.compile(...,
jit=False)`` except for the order of the norms' sums (fp32, a few ulp of a per-tensor
scalar) and, on a GPU, FMA contraction.

Falls back (``fused_step`` returns None; the generic path runs) when: no Triton for the
lion stage's ``backend`` (``"auto"`` on CPU, ``"torch"``), tensor hyperparameters in adagc /
mona / lion, a sharded binding (``reduce_sum``), parameter or gradient dtypes other than
bf16 / fp32, MONA buffers in fp16 or in two dtypes, a flat layout whose ``align`` is not
the quantization block size, absent gradients.  ``update()`` (no apply) is never fused.
Stochastic rounding of bf16 parameters is done in-kernel (the 8-bit kernels' hash noise,
seeded from hyperball's step count and the group), so it equals the generic path in
distribution, not bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func._common import increment
from pgs.func.adagc_clip import AdaGCState
from pgs.func.hyperball_sphere import HyperballState
from pgs.func.kernels.fused_transform import hp_tensor, one_minus, sr_seed
from pgs.func.layout import group_label, segment_slots
from pgs.func.learning_rate import lr_value
from pgs.func.lion8bit_direction import ScaleByLion8bitState
from pgs.func.mona_acceleration import MonaState
from pgs.func.quant8 import Quantized8bit
from pgs.func.memory_options import MemoryOptions
from pgs.func.step import StepContext

#: Blocks per program of the passes (4 warps: one warp per 256-element block).  Pass B holds
#: more live values than the Lion kernel (g, prev, acc, θ), so it uses 4 (Lion uses 8).
ROWS = 4
#: Blocks per program of pass A (Σg² per block: a pure stream, bigger programs; chosen together
#: with ``LANES`` by measurement: docs/performance.md, "Kernel defaults").
ROWS_A = 16
#: Slots per tensor of the per-block → per-tensor sums (consecutive blocks add into different
#: slots, then the slots are summed): fewer atomics on one address than the layout's
#: ``SEGMENT_LANES`` (64).
LANES = 512
ROWS_C = 8
NUM_WARPS = 4
#: The direction between pass B and pass C is stored in 2 bits per element (4 per byte):
#: 0.5 instead of 2 B/param of traffic, for an in-register repacking of each thread's
#: contiguous elements; block sizes that are not a multiple of 4 store one int8 per element.

_DT = {torch.float32: 0, torch.bfloat16: 1}
_PATTERN = ("adagc", "mona", "lion8bit", "hyperball")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def match(opt) -> Callable | None:
    """The fused step when ``opt`` is exactly ``chain(adagc, mona, scale_by_lion8bit, hyperball)``
    with number hyperparameters (hyperball's learning rate may be anything it accepts), else None."""
    if getattr(opt, "name", None) != "chain" or len(opt.children) != 4:
        return None
    fused = [getattr(c, "fused", None) for c in opt.children]
    if any(not (isinstance(f, tuple) and len(f) == 2) for f in fused) or tuple(f[0] for f in fused) != _PATTERN:
        return None
    ada, mona, lion, hb = (f[1] for f in fused)
    if not all(_number(ada[k]) for k in ("lambda_rel", "beta", "lambda_abs", "warmup_steps", "eps")):
        return None
    if not all(_number(mona[k]) for k in ("alpha", "beta")) or not all(_number(lion[k]) for k in ("b1", "b2")):
        return None
    if "backend" not in lion or not _number(hb["eps"]):
        return None
    keys = [f"{i}_{c.name}" for i, c in enumerate(opt.children)]
    constrained = opt.children[3].group_by[0]
    return _make_step(keys, ada, mona, lion, hb, constrained)


def _chunks(n: int, bs: int):
    return K._chunks(n, bs)


def _dir_slice(u: torch.Tensor, s: int, n: int, pack: bool) -> torch.Tensor:
    """The direction buffer of elements ``s .. s+n`` (4 elements per byte when packed)."""
    return u[s // 4:(s + n) // 4] if pack else u[s:s + n]


_SEG_INDEX: dict = {}


def _segment_sums(blocks: torch.Tensor, grp) -> torch.Tensor:
    """``layout._segment_sum`` for ``[c, num_blocks]`` block results at once (``[c, num_tensors]``),
    with the slot index of each block built once per group instead of once per call."""
    lanes = LANES
    hit = _SEG_INDEX.get(id(grp))
    if hit is None or hit[0] is not grp or hit[2] != lanes:
        if len(_SEG_INDEX) > 64:
            _SEG_INDEX.clear()
        hit = _SEG_INDEX[id(grp)] = (grp, segment_slots(grp, lanes), lanes)
    c = blocks.shape[0]
    part = torch.zeros(grp.num_tensors * lanes, c, dtype=torch.float32, device=blocks.device)
    part.index_add_(0, hit[1], blocks.t())
    return part.view(grp.num_tensors, lanes, c).sum(1).t()


def _accepts(fg, state, fp, ctx: StepContext, keys, bs: int, backend) -> bool:
    """Whether the fused step runs these gradients, parameters and state (else the chain's own
    path runs: None from ``fused_step``)."""
    layout = ctx.layout
    if layout is None or ctx.reduce_sum is not None or layout.align != bs:
        return False
    if list(state) != list(keys) or set(fg) != set(fp) or not fg:
        return False
    s_ada, s_mona, s_lion, s_hb = (state[k] for k in keys)
    for k, g in fg.items():
        p = fp[k]
        if g is None or p is None or g.dtype not in (torch.bfloat16, torch.float32):
            return False
        if p.dtype not in (torch.bfloat16, torch.float32) or not (g.is_contiguous() and p.is_contiguous()):
            return False
        if g.numel() != layout.groups[k].size or not K.use_triton(backend, g, bs):
            return False
        if s_mona.acc[k].dtype not in _DT or s_mona.prev[k].dtype != s_mona.acc[k].dtype:
            return False
        m = s_lion.mu[k]
        if not isinstance(m, Quantized8bit) and m.dtype != torch.float32:
            return False
    return True


def _pass_a(fg, layout, s_ada, ada, bs: int, dev, KC):
    """Pass A and AdaGC's per-tensor clip factor (adagc_clip.py's arithmetic, op for op): the step's
    count, each tensor's clip factor and its new γ."""
    warmup_steps = ada["warmup_steps"]
    count = increment(s_ada.count)
    first = count == 1
    warm = (count < warmup_steps) | first
    sq = {}
    for k, g in fg.items():
        grp = layout.groups[k]
        part = torch.empty(grp.num_blocks, dtype=torch.float32, device=dev)
        fgk = g.view(-1)
        for s, n in _chunks(grp.size, bs):
            b, nb = s // bs, -(-n // bs)
            KC.sumsq_kernel[(-(-nb // ROWS_A),)](fgk[s:s + n], part[b:b + nb], n, BLOCK=bs, ROWS=ROWS_A,
                                                 num_warps=NUM_WARPS)
        sq[k] = _segment_sums(part.view(1, -1), grp)[0]
    norms = {k: torch.sqrt(x) for k, x in sq.items()}
    total = None
    for x in T.leaves(sq):
        total = x.sum() if total is None else total + x.sum()
    gnorm = total.sqrt()
    hp_ada = hp_tensor(dev, ada["lambda_abs"], ada["lambda_rel"], ada["beta"], 1.0 - ada["beta"], ada["eps"])
    l_abs, l_rel, b, omb, eps_ = hp_ada[0], hp_ada[1], hp_ada[2], hp_ada[3], hp_ada[4]
    clip, gamma = {}, {}
    for k in fg:
        n_, g_ = norms[k], s_ada.gamma[k]
        h_warm = torch.clamp(l_abs / (gnorm + eps_), max=1.0)
        h_rel = torch.clamp(l_rel * g_ / (n_ + eps_), max=1.0)
        h = torch.where(warm, h_warm, h_rel)
        clipped = h * n_
        g_warm = torch.where(first, clipped, torch.minimum(g_, clipped))
        clip[k] = h.contiguous()
        gamma[k] = torch.where(warm, g_warm, b * g_ + omb * clipped)
    return count, clip, gamma


def _pass_b(fg, fp, layout, s_mona, s_lion, s_hb, mona, hb, clip, w1, w2, bs: int, dev, code, btab, constrained,
            donate, memory: MemoryOptions, KC):
    """Pass B: Mona's accumulators, Lion8bit's moment and the direction; the tensors hyperball
    projects keep their packed direction and block sums for pass C (``proj``)."""
    learning_rate = hb["learning_rate"]
    lr = lr_value(learning_rate, s_hb.count)
    hp_b = hp_tensor(dev, (s_mona.count == 0).to(torch.float64), mona["alpha"], mona["beta"],
                     1.0 - mona["beta"], w1, w2, -lr)
    labels = group_label(layout, fg, constrained)
    new_p, new_prev, new_acc, new_mu = {}, {}, {}, {}
    proj = {}
    for gi, (k, g) in enumerate(fg.items()):
        grp = layout.groups[k]
        p, prev, acc, m = fp[k], s_mona.prev[k], s_mona.acc[k], s_lion.mu[k]
        q8 = isinstance(m, Quantized8bit)
        sr = memory.stochastic_rounding and p.dtype == torch.bfloat16
        on = bool(labels[k])
        out = p if donate else torch.empty_like(p)
        prev_o = prev if donate else torch.empty_like(prev)
        acc_o = acc if donate else torch.empty_like(acc)
        if q8:
            m_o = m if donate else Quantized8bit(torch.empty_like(m.codes), torch.empty_like(m.absmax))
        else:
            m_o = m if donate else torch.empty_like(m)
        nbk = grp.num_blocks
        pack = bs % 4 == 0
        if on:
            u8 = torch.empty(grp.size // 4 if pack else grp.size, dtype=torch.uint8 if pack else torch.int8,
                             device=dev)
            parts = torch.empty(3, nbk, dtype=torch.float32, device=dev)
        seed = sr_seed(s_hb.count, gi, salt=0x5EED) if sr else torch.zeros(1, dtype=torch.int64, device=dev)
        chunks = _chunks(grp.size, bs)
        for ci, (s, n) in enumerate(chunks):
            b0, nb = s // bs, -(-n // bs)
            e = slice(s, s + n)
            r = slice(b0, b0 + nb)
            fl = lambda t: t.view(-1)[e]  # noqa: E731
            codes_i = fl(m.codes) if q8 else fl(g)
            absmax_i = m.absmax[r] if q8 else fl(g)
            codes_o = fl(m_o.codes) if q8 else fl(g)
            absmax_o = m_o.absmax[r] if q8 else fl(g)
            m_i = fl(g) if q8 else fl(m)
            m_oi = fl(g) if q8 else fl(m_o)
            u_i = _dir_slice(u8, s, n, pack) if on else fl(g)
            uu, pu, pp = (parts[0, r], parts[1, r], parts[2, r]) if on else (fl(g),) * 3
            KC.chain_b_kernel[(-(-nb // ROWS),)](
                fl(g), fl(p), fl(out), grp.block_seg[r], clip[k],
                fl(prev), fl(acc), fl(prev_o), fl(acc_o),
                codes_i, absmax_i, codes_o, absmax_o, m_i, m_oi,
                u_i, uu, pu, pp,
                code, btab, hp_b, K._chunk_seed(seed, ci), n,
                BLOCK=bs, ROWS=ROWS, GDT=_DT[g.dtype], PDT=_DT[p.dtype], ADT=_DT[acc.dtype], Q8=q8, PROJ=on,
                SR=sr and not on,
                PACK=pack, num_warps=NUM_WARPS, **K._split(), **K._fusion(),
            )
        new_p[k], new_prev[k], new_acc[k], new_mu[k] = out, prev_o, acc_o, m_o
        if on:
            proj[k] = (u8, parts, seed, sr, pack)
    return lr, new_p, new_prev, new_acc, new_mu, proj


def _pass_c(fg, fp, layout, s_hb, lr, new_p, proj, hb_eps, bs: int, KC) -> None:
    """Hyperball's per-tensor scalars, then pass C: the projected step written into ``new_p``."""
    lr32 = lr.to(torch.float32)
    for k, (u8, parts, seed, sr, pack) in proj.items():
        grp = layout.groups[k]
        r_ = s_hb.radius[k]
        uu, pu, pp = _segment_sums(parts, grp).unbind(0)
        coef = lr32 * r_ / torch.sqrt(uu).clamp(min=hb_eps)
        tsq = pp - 2.0 * coef * pu + coef * coef * uu
        shrink = r_ / torch.sqrt(tsq.clamp(min=0.0)).clamp(min=hb_eps)
        p, out = fp[k], new_p[k]
        for ci, (s, n) in enumerate(_chunks(grp.size, bs)):
            b0, nb = s // bs, -(-n // bs)
            e = slice(s, s + n)
            KC.chain_c_kernel[(-(-nb // ROWS_C),)](
                p.view(-1)[e], _dir_slice(u8, s, n, pack), out.view(-1)[e], grp.block_seg[b0:b0 + nb],
                coef.contiguous(), shrink.contiguous(), K._chunk_seed(seed, ci), n,
                BLOCK=bs, ROWS=ROWS_C, GDT=_DT[fg[k].dtype], PDT=_DT[p.dtype], SR=sr,
                PACK=pack, num_warps=NUM_WARPS, **K._split(), **K._fusion(),
            )


def _make_step(keys, ada, mona, lion, hb, constrained) -> Callable:
    k_ada, k_mona, k_lion, k_hb = keys
    bs = int(lion["block_size"])
    backend = lion["backend"]
    w1, w2 = one_minus(lion["b1"]), one_minus(lion["b2"])
    hb_eps = hb["eps"]

    def fused_step(fg, state, fp, *, ctx: StepContext, donate, memory: MemoryOptions, extra=None):
        if not _accepts(fg, state, fp, ctx, keys, bs, backend):
            return None
        layout = ctx.layout
        s_ada, s_mona, s_lion, s_hb = (state[k] for k in keys)
        from pgs.func.kernels import chain8bit as KC

        dev = next(iter(fg.values())).device
        code, btab = K._maps(True, dev)
        count, clip, gamma = _pass_a(fg, layout, s_ada, ada, bs, dev, KC)
        lr, new_p, new_prev, new_acc, new_mu, proj = _pass_b(
            fg, fp, layout, s_mona, s_lion, s_hb, mona, hb, clip, w1, w2, bs, dev, code, btab, constrained,
            donate, memory, KC)
        _pass_c(fg, fp, layout, s_hb, lr, new_p, proj, hb_eps, bs, KC)
        new_state = dict(state)
        new_state[k_ada] = AdaGCState(count, gamma)
        new_state[k_mona] = MonaState(increment(s_mona.count), new_prev, new_acc)
        new_state[k_lion] = ScaleByLion8bitState(increment(s_lion.count), new_mu)
        new_state[k_hb] = HyperballState(increment(s_hb.count), lr, s_hb.radius)
        return new_p, new_state

    return fused_step
