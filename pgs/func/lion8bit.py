"""Lion with a block-wise 8-bit momentum (EQUATIONS.md A4 + A5).

Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675;
Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count
from pgs.func.base import ELEMENTWISE, EmptyState, Transform, chain, check_range, identity
from pgs.func.kernels.fused import FusedTransform, apply_fp32, hp_tensor, one_minus, sr_seed
from pgs.func.layout import group_label
from pgs.func.learning_rate import ScaleByLearningRateState, lr_value, scale_by_learning_rate
from pgs.func.quant8 import (
    Quantized8bit,
    init_moment,
    is_8bit_eligible,
    load_moment,
    moment_leaves,
    store_moment,
)
from pgs.func.weight_decay import add_decayed_weights, mask_fn


class ScaleByLion8bitState(NamedTuple):
    count: torch.Tensor  # int32, updates applied so far
    mu: object  # per leaf: Quantized8bit(codes uint8, absmax fp32) or an fp32 tensor (small leaves)


def check_8bit_args(who: str, block_size, min_8bit_size, backend) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidArgument(f"{who}: block_size must be a positive int, got {block_size!r}")
    if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool) or min_8bit_size < 0:
        raise InvalidArgument(f"{who}: min_8bit_size must be an int >= 0, got {min_8bit_size!r}")
    if backend not in K.BACKENDS:
        raise InvalidArgument(f"{who}: backend must be one of {K.BACKENDS}, got {backend!r}")


def check_layout(layout, block_size: int, who: str) -> None:
    if layout is not None and layout.align % block_size:
        raise InvalidArgument(f"{who}: the flat layout's align={layout.align} is not a multiple of "
                              f"block_size={block_size}; build it with pf.compile (which uses the lcm)")


def _weight(w, like: torch.Tensor):
    return w.to(device=like.device, dtype=like.dtype) if isinstance(w, torch.Tensor) else w


def lion_leaf(g: torch.Tensor, m, w1, w2, block_size: int):
    """Reference Lion on one leaf: ``(sign(lerp(m, g, 1−β1)), stored lerp(m, g, 1−β2))``."""
    cd = compute_dtype(g)
    g32 = g.to(cd)
    m32 = load_moment(m, block_size, signed=True).to(cd)
    u = m32.lerp(g32, _weight(w1, g32)).sign()
    return u, store_moment(m32.lerp(g32, _weight(w2, g32)), m, block_size, signed=True)


class Fused8bit(NamedTuple):
    """What differs between the 8-bit chains' fused steps (``fused_8bit_step``).

    ``prepare(s_dir, s_lr) -> (seed_count, direction_count, ctx)``: per-step scalars (and a
    memo: the hyperparameter vector is built once per step and weight decay, not per tensor);
    ``quantized(ctx, g, p, moments, lr, wd, seed, donate) -> (new_p, new_moments)``: the
    fused kernel on one 8-bit leaf; ``small(ctx, g, moments) -> (u, new_moments)``: the
    reference direction of a small (fp32-state) leaf; ``make_state(direction_count,
    *moment_trees)``: the direction's new state; ``fields``: its moment fields.
    """

    fields: tuple
    prepare: Callable
    quantized: Callable
    small: Callable
    make_state: Callable


def _step_small(kind: Fused8bit, ctx, keys: list, fg, fp, old, lr, wd, stochastic_rounding: bool, donate: bool,
                new_p: dict, new: list) -> None:
    """The small (fp32-state) leaves ``keys``, which share dtypes and weight decay, as ONE
    flat leaf: the reference direction and the fp32 apply are elementwise, so concatenating
    changes no value (stochastic rounding draws its noise over the concatenation), and a group
    of small leaves costs one set of tiny kernels instead of one set per leaf."""
    one = len(keys) == 1

    def joined(tree):
        return tree[keys[0]] if one else torch.cat([tree[k].reshape(-1) for k in keys])

    u, out = kind.small(ctx, joined(fg), tuple(joined(o) for o in old))
    x = apply_fp32(joined(fp), u.float(), lr, wd, stochastic_rounding)
    sizes = [fp[k].numel() for k in keys]
    xs = [x] if one else x.split(sizes)
    outs = [[m_new] if one else m_new.split(sizes) for m_new in out]
    for j, k in enumerate(keys):
        if donate:
            fp[k].copy_(xs[j].view_as(fp[k]))
            for o, parts in zip(old, outs):
                o[k].copy_(parts[j].view_as(o[k]))
            new_p[k] = fp[k]
            for d, o in zip(new, old):
                d[k] = o[k]
        else:  # own storage per leaf (views of one buffer would be saved as shared tensors)
            new_p[k] = xs[j].view_as(fp[k]) if one else xs[j].view_as(fp[k]).clone()
            for d, o, parts in zip(new, old, outs):
                d[k] = parts[j].view_as(o[k]) if one else parts[j].view_as(o[k]).clone()


def fused_8bit_step(kind: Fused8bit, *, quantize: bool, backend: str, block_size: int, learning_rate,
                    weight_decay, mask) -> Callable:
    """The ``fused_step`` of ``chain(<8-bit direction>, add_decayed_weights, scale_by_learning_rate)``.

    One kernel per 8-bit leaf (update and apply, in place with ``donate``); small leaves take
    the reference direction and an fp32 apply.  ``layout`` None means ``fg`` is a
    per-parameter tree (gradient release steps one group of whole tensors; each tensor is its
    own run of quantization blocks, as ``init`` made it); ``extra["sr_offset"]`` keeps the
    stochastic-rounding seeds of different release groups apart.  Returns None (use the
    generic path) where a leaf cannot take the kernel.
    """

    def fused_step(fg, state, fp, *, layout, donate, stochastic_rounding, extra):
        if not quantize or any(
            not K.use_triton(backend, g, block_size) for g in fg.values() if g is not None
        ):
            return None
        sr_base = int(extra.get("sr_offset", 0)) if extra else 0
        n_dir, n_dec, n_lr = list(state)
        s_dir, s_lr = state[n_dir], state[n_lr]
        lr = lr_value(learning_rate, s_lr.count)
        # a constant learning rate reaches the kernels as a number: its hyperparameter vector
        # is then a cached device tensor (no per-call copies); the state keeps the tensor
        lr_k = float(learning_rate) if isinstance(learning_rate, (int, float)) else lr
        seed_count, dir_count, ctx = kind.prepare(s_dir, s_lr)
        labels = group_label(layout, fg, mask) if mask is not None else None
        old = [getattr(s_dir, f) for f in kind.fields]
        new_p, new = {}, [{} for _ in kind.fields]
        small: dict[tuple, tuple] = {}  # small leaves by what they must share to be stepped as one
        for i, (k, g) in enumerate(fg.items()):
            p, moments = fp[k], tuple(o[k] for o in old)
            if g is None:
                x, out = p, moments
            else:
                wd = weight_decay if (_nonzero(weight_decay) and (labels is None or labels[k])) else 0.0
                if not isinstance(moments[0], Quantized8bit):  # fp32 state: stepped together below
                    key = (id(wd) if isinstance(wd, torch.Tensor) else wd, g.dtype, p.dtype, g.device,
                           tuple(m.dtype for m in moments))
                    small.setdefault(key, (wd, []))[1].append(k)
                    new_p[k] = None  # keeps the trees' order; filled below
                    for d in new:
                        d[k] = None
                    continue
                sr = stochastic_rounding and p.dtype == torch.bfloat16
                seed = sr_seed(seed_count, sr_base + i) if sr else None
                x, out = kind.quantized(ctx, g, p, moments, lr_k, wd, seed, donate)
            new_p[k] = x
            for d, m in zip(new, out):
                d[k] = m
        for wd, keys in small.values():
            _step_small(kind, ctx, keys, fg, fp, old, lr, wd, stochastic_rounding, donate, new_p, new)
        new_state = {
            n_dir: kind.make_state(dir_count, *new),
            n_dec: state[n_dec] if isinstance(state[n_dec], EmptyState) else EmptyState(),
            n_lr: ScaleByLearningRateState(increment(s_lr.count), lr),
        }
        return new_p, new_state

    return fused_step


def scale_by_lion8bit(
    b1: float = 0.9,
    b2: float = 0.99,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    quantize: bool = True,
    backend: str = "auto",
) -> Transform:
    """Lion's sign direction with its momentum stored block-wise in 8 bits (no learning rate).

    c_t = β1 m_{t−1} + (1−β1) g_t ;  u_t = sign(c_t) ;  m_t = β2 m_{t−1} + (1−β2) g_t
    with m dequantized to fp32 before and requantized after each step (signed dynamic map,
    one fp32 absmax per ``block_size`` elements; A5).  Leaves with fewer than
    ``min_8bit_size`` elements keep an fp32 momentum (bitsandbytes does the same).

    Args:
        b1, b2: Lion's rates in [0, 1].
        block_size: elements per quantization block (bitsandbytes uses 256).
        min_8bit_size: smaller leaves keep fp32 state.
        quantize: False stores every momentum in fp32 (then this equals ``scale_by_lion``
            for fp32 parameters, bit for bit).
        backend: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

    Returns:
        A ``Transform`` with ``ScaleByLion8bitState(count, mu)``.

    Example::

        opt = pf.chain(pf.scale_by_lion8bit(), pf.scale_by_learning_rate(1e-4))

    Papers: arXiv 2302.06675 (Lion), arXiv 2110.02861 (8-bit state).
    """
    who = "scale_by_lion8bit"
    check_range("b1", b1, 0.0, 1.0, who=who)
    check_range("b2", b2, 0.0, 1.0, who=who)
    check_8bit_args(who, block_size, min_8bit_size, backend)
    eligible = is_8bit_eligible(min_8bit_size)

    def init(params, **extra):
        layout = extra.get("layout")
        check_layout(layout, block_size, who)
        labels = group_label(layout, params, eligible)
        return ScaleByLion8bitState(
            zero_count(params),
            T.tree_map_with_path(lambda path, x: init_moment(x, quantize and labels[path], block_size, True), params),
        )

    def update(updates, state, params=None, **extra):
        check_layout(extra.get("layout"), block_size, who)
        m_leaves = moment_leaves(updates, state.mu, who)
        u_leaves, spec = T.flatten(updates)
        w1, w2 = one_minus(b1), one_minus(b2)
        out_u, out_m = [], []
        for g, m in zip(u_leaves, m_leaves):
            if g is None:
                out_u.append(None)
                out_m.append(None)
                continue
            if isinstance(m, Quantized8bit) and K.use_triton(backend, g, block_size):
                u, m_new = K.lion8bit(g.contiguous(), m, hp_tensor(g.device, w1, w2), block_size)
            else:
                u, m_new = lion_leaf(g, m, w1, w2, block_size)
            out_u.append(u.to(g.dtype))
            out_m.append(m_new)
        mu = T.unflatten(out_m, spec)
        return T.unflatten(out_u, spec), ScaleByLion8bitState(increment(state.count), mu)

    # ``fused`` names this block for the execution layer's chain matcher (pgs.func.fused);
    # the 8-bit fused kernels are reached through ``lion8bit``'s FusedTransform.
    return Transform(init, update, name="scale_by_lion8bit", locality=ELEMENTWISE,
                     group_by=(eligible,), align=block_size,
                     fused=("lion8bit", dict(b1=b1, b2=b2, block_size=block_size, min_8bit_size=min_8bit_size)) if quantize else None)


def lion8bit(
    learning_rate=1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask=None,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    quantize: bool = True,
    backend: str = "auto",
) -> Transform:
    """Lion8bit = chain(scale_by_lion8bit, add_decayed_weights, scale_by_learning_rate).

    θ ← θ − η_t (sign(β1 m + (1−β1) g) + λθ), m kept in 8 bits.  Under
    ``pf.compile(...).step`` on CUDA the whole chain plus the apply runs as one fused kernel
    per flat group (``pgs.func.kernels.fused``); elsewhere it is the plain chain.

    Example::

        fast = pf.compile(pf.lion8bit(3e-5, weight_decay=0.1), donate=True)
        state = fast.init(params)
        params, state = fast.step(grads, state, params)
    """
    direction = scale_by_lion8bit(b1, b2, block_size, min_8bit_size, quantize, backend)
    decay = add_decayed_weights(weight_decay, mask) if _nonzero(weight_decay) else identity()
    base = chain(direction, decay, scale_by_learning_rate(learning_rate))
    fn = mask_fn(mask, "lion8bit")

    w1, w2 = one_minus(b1), one_minus(b2)

    def quantized(hps, g, p, moments, lr, wd, seed, donate):
        (m,) = moments
        key = (g.device, id(wd) if isinstance(wd, torch.Tensor) else wd)  # one vector per step, not per tensor
        if key not in hps:
            hps[key] = hp_tensor(g.device, w1, w2, lr, wd)
        new_p, m_new = K.lion8bit(g, m, hps[key], block_size, p=p,
                                  out=p if donate else torch.empty_like(p), m_out=m if donate else None,
                                  seed=seed)
        return new_p, (m_new,)

    def small(ctx, g, moments):
        u, m_new = lion_leaf(g, moments[0], w1, w2, block_size)
        return u, (m_new,)

    kind = Fused8bit(
        fields=("mu",),
        # the seed counts the learning-rate state's steps; the direction's count advances
        prepare=lambda s_dir, s_lr: (s_lr.count, increment(s_dir.count), {}),
        quantized=quantized, small=small, make_state=ScaleByLion8bitState,
    )
    fused_step = fused_8bit_step(kind, quantize=quantize, backend=backend, block_size=block_size,
                                 learning_rate=learning_rate, weight_decay=weight_decay, mask=fn)

    return FusedTransform(base.init, base.update, name=base.name, locality=base.locality,
                          children=base.children, fused_step=fused_step)


def _nonzero(x) -> bool:
    return isinstance(x, torch.Tensor) or x != 0
