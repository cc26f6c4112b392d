"""Adam with block-wise 8-bit moments (docs/techniques/adamw.md, docs/techniques/8bit.md).

Kingma & Ba, arXiv 1412.6980; Loshchilov & Hutter, arXiv 1711.05101;
Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, nonzero, zero_count
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, chain, check_range, hp_in, identity
from pgs.func.kernels.fused_transform import FusedTransform, _hp_cached, hp_tensor, one_minus
from pgs.func.layout import group_label
from pgs.func.learning_rate import scale_by_learning_rate, takes_learning_rate
from pgs.func.lion8bit_direction import Fused8bit, check_8bit_args, check_layout, fused_8bit_step, step_hp
from pgs.func.quant8 import Quantized8bit, init_moment, is_8bit_eligible, load_moment, moment_leaves, store_moment
from pgs.func.weight_decay import add_decayed_weights, mask_fn
from pgs.func.step import NO_CONTEXT, StepContext


class ScaleByAdam8bitState(NamedTuple):
    count: torch.Tensor  # int32, updates applied so far
    mu: object  # per leaf: Quantized8bit (signed map) or fp32 tensor
    nu: object  # per leaf: Quantized8bit (unsigned map) or fp32 tensor


def _bias_corrections(count: torch.Tensor, b1, b2):
    t = count.to(torch.float64)
    return 1.0 - b1**t, 1.0 - b2**t


def adam_leaf(g, m, v, b1, b2, eps, eps_root, bc1, bc2, block_size: int):
    """Reference Adam on one leaf, the same operations as ``scale_by_adam``."""
    cd = compute_dtype(g)
    g32 = g.to(cd)
    m32 = load_moment(m, block_size, signed=True).to(cd)
    v32 = load_moment(v, block_size, signed=False).to(cd)
    # the same operations as scale_by_adam, so quantize=False equals it bit for bit
    # injected (tensor) hyperparameters: derive 1 − β in fp64, then cast, exactly as scale_by_adam
    w1, w2, d2, er, ep = (hp_in(x, cd, g.device) for x in (1.0 - b1, 1.0 - b2, b2, eps_root, eps))
    m_new = m32.lerp(g32, w1)
    v_new = v32.mul(d2)
    v_new = v_new.addcmul(g32 * w2, g32) if isinstance(w2, torch.Tensor) else v_new.addcmul(g32, g32, value=w2)
    v_hat = v_new / bc2.to(cd)
    if isinstance(er, torch.Tensor) or er != 0:  # + 0.0 changes no value that reaches u (±0 → +0 only,
        v_hat = v_hat + er  # and sqrt(±0) + ε is the same number): one kernel fewer
    u = (m_new / bc1.to(cd)) / (v_hat.sqrt() + ep)
    return u, store_moment(m_new, m, block_size, True), store_moment(v_new, v, block_size, False)


@functools.lru_cache(maxsize=64)
def _betas(device: torch.device, b1: float, b2: float) -> torch.Tensor:
    """[β1, β2] in fp64 on ``device``, made there by fills (no host-to-device copy)."""
    out = torch.full((2,), b1, dtype=torch.float64, device=device)
    out[1:].fill_(b2)
    return out


@functools.lru_cache(maxsize=64)
def _ones64(device: torch.device) -> torch.Tensor:
    return torch.ones(2, dtype=torch.float64, device=device)


def _hp_piece(device: torch.device, v) -> torch.Tensor:
    """One hyperparameter as a 1-element fp32 tensor, as ``hp_tensor`` makes its entry."""
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=torch.float64).reshape(1).to(torch.float32)
    return _hp_cached(device, (float(v),))


def _adam_hp(device, b1, b2, eps, eps_root, bc1, bc2, *tail):
    return hp_tensor(device, one_minus(b1), b2, one_minus(b2), eps, eps_root, bc1, bc2, *tail)


def scale_by_adam8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    quantize: bool = True,
    backend: str = "auto",
) -> Transform:
    """Adam's bias-corrected direction with both moments stored block-wise in 8 bits.

    m_t = β1 m_{t−1} + (1−β1) g_t ;  v_t = β2 v_{t−1} + (1−β2) g_t²
    u_t = (m_t / (1−β1^t)) / (sqrt(v_t / (1−β2^t) + ε_root) + ε)
    m uses the signed dynamic map, v the unsigned one, one fp32 absmax per block (docs/techniques/8bit.md).
    Leaves with fewer than ``min_8bit_size`` elements keep fp32 moments.

    Args:
        b1, b2: decay rates in [0, 1).
        eps, eps_root: stabilisers (≥ 0).
        block_size, min_8bit_size, quantize, backend: as in ``scale_by_lion8bit``.

    Example::

        opt = pf.chain(pf.scale_by_adam8bit(b2=0.95), pf.scale_by_learning_rate(1e-3))

    Papers: arXiv 1412.6980 (Adam), arXiv 2110.02861 (8-bit state).
    """
    who = "scale_by_adam8bit"
    check_range("b1", b1, 0.0, 1.0, hi_open=True, who=who)
    check_range("b2", b2, 0.0, 1.0, hi_open=True, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    check_range("eps_root", eps_root, 0.0, None, who=who)
    check_8bit_args(who, block_size, min_8bit_size, backend)
    eligible = is_8bit_eligible(min_8bit_size)

    def init(params, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        check_layout(layout, block_size, who)
        labels = group_label(layout, params, eligible)

        def moments(signed):
            return T.tree_map_with_path(lambda path, x: init_moment(x, quantize and labels[path], block_size, signed),
                                        params)

        return ScaleByAdam8bitState(zero_count(params), moments(True), moments(False))

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        check_layout(ctx.layout, block_size, who)
        m_leaves = moment_leaves(updates, state.mu, who)
        v_leaves = moment_leaves(updates, state.nu, who)
        u_leaves, spec = T.flatten(updates)
        count = increment(state.count)
        bc1, bc2 = _bias_corrections(count, b1, b2)
        out_u, out_m, out_v = [], [], []
        for g, m, v in zip(u_leaves, m_leaves, v_leaves):
            if g is None:
                out_u.append(None), out_m.append(None), out_v.append(None)
                continue
            if isinstance(m, Quantized8bit) and K.use_triton(backend, g, block_size):
                hp = _adam_hp(g.device, b1, b2, eps, eps_root, bc1, bc2)
                u, m_new, v_new = K.adam8bit(g.contiguous(), m, v, hp, block_size)
            else:
                u, m_new, v_new = adam_leaf(g, m, v, b1, b2, eps, eps_root, bc1, bc2, block_size)
            out_u.append(u.to(g.dtype)), out_m.append(m_new), out_v.append(v_new)
        return T.unflatten(out_u, spec), ScaleByAdam8bitState(count, T.unflatten(out_m, spec), T.unflatten(out_v, spec))

    # ``fused`` names this block for the execution layer's chain matcher (pgs.func.fused_adamw_lion);
    # the 8-bit fused kernels are reached through ``adamw8bit``'s FusedTransform.
    return Transform(init, update, name="scale_by_adam8bit", locality=ELEMENTWISE, stage=DIRECTION,
                     group_by=(eligible,), align=block_size,
                     fused=("adam8bit", dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, block_size=block_size,
                                             min_8bit_size=min_8bit_size)) if quantize else None)


@takes_learning_rate
def adamw8bit(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    quantize: bool = True,
    backend: str = "auto",
) -> Transform:
    """AdamW8bit = chain(scale_by_adam8bit, add_decayed_weights, scale_by_learning_rate).

    θ ← θ − η_t (m̂/(sqrt(v̂)+ε) + λθ), m and v kept in 8 bits.  Fused under
    ``pf.compile(...).step`` on CUDA, as ``lion8bit`` is.  With stochastic rounding into bf16
    (arXiv 1502.02551) every leaf's noise comes from a seed made of the state's step count and
    the leaf's index (``sr_seeds``): the 8-bit leaves in their kernel, the small fp32-state
    leaves (norm weights) in ``kernels/small.py``'s ``stochastic_round_``, as Lion8bit's.  The
    fused step is a function of (updates, state, params): torch's global generator is never read.

    Example::

        fast = pf.compile(pf.adamw8bit(1e-4, weight_decay=0.1), donate=True)
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="adamw8bit")
    direction = scale_by_adam8bit(b1, b2, eps, 0.0, block_size, min_8bit_size, quantize, backend)
    decay = add_decayed_weights(weight_decay, mask) if nonzero(weight_decay) else identity()
    base = chain(direction, decay, scale_by_learning_rate(learning_rate))
    fn = mask_fn(mask, "adamw8bit")

    numbers = not isinstance(b1, torch.Tensor) and not isinstance(b2, torch.Tensor)
    head = (float(one_minus(b1)), float(b2), float(one_minus(b2)), float(eps), 0.0) if numbers else None

    def prepare(s_dir, s_lr, count):  # count: the new count (the seed and the bias corrections use it)
        if not numbers:
            return count, count, (count, _bias_corrections(count, b1, b2), None, {})
        # both bias corrections 1 − β^t in one pow and one subtraction, computed in fp64 (the
        # operations of _bias_corrections, elementwise) and stored in fp32 by the subtraction
        # itself: what the kernels' vector and fp32 small leaves read.  2 kernels, against 5,
        # 2 conversions per hyperparameter vector and 2 per group of small leaves
        dev = count.device
        bc32 = torch.empty(2, dtype=torch.float32, device=dev)
        torch.sub(_ones64(dev), torch.pow(_betas(dev, float(b1), float(b2)), count), out=bc32)
        return count, count, (count, None, bc32, {})

    def quantized(ctx, g, p, moments, lr, wd, seed, donate):
        (_, bcs, bc32, hps), (m, v) = ctx, moments
        dev = g.device

        def build():
            if bc32 is None:
                return _adam_hp(dev, b1, b2, eps, 0.0, *bcs, lr, wd)
            # [1−β1, β2, 1−β2, ε, 0, bc1, bc2, η, λ]: one cat of cached numbers, bc32 and the
            # fp32 value of a tensor η or λ (fp64 → fp32, as hp_tensor converts)
            tail = ([_hp_cached(dev, (float(lr), float(wd)))]
                    if not isinstance(lr, torch.Tensor) and not isinstance(wd, torch.Tensor)
                    else [_hp_piece(dev, lr), _hp_piece(dev, wd)])
            return torch.cat([_hp_cached(dev, head), bc32.to(dev), *tail])

        new_p, m_new, v_new = K.adam8bit(
            g, m, v, step_hp(hps, dev, wd, build), block_size, p=p,
            out=p if donate else torch.empty_like(p), m_out=m if donate else None,
            v_out=v if donate else None, seed=seed)
        return new_p, (m_new, v_new)

    def small(ctx, g, moments):
        count, bcs, bc32, _ = ctx
        if bc32 is not None and g.dtype == torch.float32:  # the fp32 corrections already made
            bc1, bc2 = bc32.unbind(0)
        else:  # fp64 arithmetic (fp64 leaves), or tensor betas: the fp64 corrections
            bc1, bc2 = bcs if bcs is not None else _bias_corrections(count, b1, b2)
        u, m_new, v_new = adam_leaf(g, *moments, b1, b2, eps, 0.0, bc1, bc2, block_size)
        return u, (m_new, v_new)

    kind = Fused8bit(fields=("mu", "nu"), prepare=prepare, quantized=quantized, small=small,
                     make_state=ScaleByAdam8bitState, counted=True)
    fused_step = fused_8bit_step(kind, quantize=quantize, backend=backend, block_size=block_size,
                                 learning_rate=learning_rate, weight_decay=weight_decay, mask=fn)

    return FusedTransform(base.init, base.update, name=base.name, locality=base.locality, stage=base.stage,
                          children=base.children, fused_step=fused_step)
