"""Lion with a block-wise 8-bit momentum (docs/techniques/lion.md, docs/techniques/8bit.md).

Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675;
Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, nonzero, zero_count
from pgs.func.base import DIRECTION, ELEMENTWISE, EmptyState, Transform, chain, check_range, identity
from pgs.func.kernels.fused_transform import FusedTransform, constant_lr, hp_tensor, increment_pair, one_minus, sr_seeds
from pgs.func.layout import group_label
from pgs.func.learning_rate import ScaleByLearningRateState, lr_value, scale_by_learning_rate, takes_learning_rate
from pgs.func.quant8 import (
    Quantized8bit,
    init_moment,
    is_8bit_eligible,
    load_moment,
    moment_leaves,
    store_moment,
)
from pgs.func.weight_decay import add_decayed_weights, mask_fn
from pgs.func.memory_options import MemoryOptions
from pgs.func.step import NO_CONTEXT, StepContext


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
    with ``counted=True`` it is ``prepare(s_dir, s_lr, new_direction_count)``: the step
    increments the direction's and the learning rate's counters together (two kernels for
    both) and hands the direction's in.  ``unit_direction``: every direction entry is −1, 0,
    1 (or NaN), so η·u is exact and ``p − η·u`` is one ``sub`` with ``alpha=η`` (for a
    constant η; the same value whether or not the product is contracted into an FMA).
    ``quantized(ctx, g, p, moments, lr, wd, seed, donate) -> (new_p, new_moments)``: the
    fused kernel on one 8-bit leaf; ``small(ctx, g, moments) -> (u, new_moments)``: the
    reference direction of a small (fp32-state) leaf, out of place (``g`` arrives in its
    compute dtype); ``make_state(direction_count, *moment_trees)``: the direction's new
    state; ``fields``: its moment fields.  ``small_inplace(ctx, gs, moment_lists) -> us |
    None`` (optional, used with ``donate``): the same direction leaf by leaf as multi-tensor
    ops, the moments updated in place (no concatenation of the moments, no copy back), or None
    where it cannot (then ``small``).  ``small_kernel(ctx, gs, ps, moment_lists, lr, wd, seed)
    -> bool`` (optional, used with ``donate`` before both): the small leaves stepped in place by
    a Triton kernel (``kernels/small.py``), False where it cannot.
    """

    fields: tuple
    prepare: Callable
    quantized: Callable
    small: Callable
    make_state: Callable
    counted: bool = False
    unit_direction: bool = False
    small_inplace: Callable | None = None
    small_kernel: Callable | None = None


def step_hp(hps: dict, device: torch.device, wd, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The step's hyperparameter vector for ``device`` and weight decay ``wd`` (a tensor λ by
    identity) from the per-step memo ``hps``, built by ``build()`` once per step, not per tensor."""
    key = (device, id(wd) if isinstance(wd, torch.Tensor) else wd)
    hp = hps.get(key)
    if hp is None:
        hp = hps[key] = build()
    return hp


def _gather(tensors: list, dtype: torch.dtype, sizes: list) -> tuple[torch.Tensor, list]:
    """``(buffer, its views shaped like tensors)``: a NEW buffer in ``dtype`` holding ``tensors``
    one after another (shaped like the tensor when there is one), filled by one (multi-tensor)
    copy that also casts, instead of a cat and a cast."""
    if len(tensors) == 1:
        buf = torch.empty_like(tensors[0], dtype=dtype).copy_(tensors[0])
        return buf, [buf]
    buf = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    views = _parts(buf, tensors, sizes)
    torch._foreach_copy_(views, tensors)
    return buf, views


def _load(gs: list, ps: list, cd: torch.dtype, sizes: list) -> tuple:
    """``(g, g_views, x, x_views)``: the gradients in the compute dtype ``cd`` and the parameters
    in fp32, each in a NEW buffer (shaped like the leaf when there is one) with views shaped
    like the leaves.  Gradients and parameters of one dtype going to fp32 share one buffer and
    one multi-tensor copy; otherwise a copy each."""
    if cd == torch.float32 and gs[0].dtype == ps[0].dtype:
        n = sum(sizes)
        buf = torch.empty(2 * n, dtype=torch.float32, device=gs[0].device)
        g_views, x_views = _parts(buf[:n], gs, sizes), _parts(buf[n:], ps, sizes)
        torch._foreach_copy_(g_views + x_views, gs + ps)
        if len(gs) == 1:
            return g_views[0], g_views, x_views[0], x_views
        return buf[:n], g_views, buf[n:], x_views
    g, g_views = _gather(gs, cd, sizes)
    x, x_views = _gather(ps, torch.float32, sizes)
    return g, g_views, x, x_views


def _flat1(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)  # a 1-D tensor as it is: no view op


def _parts(buf: torch.Tensor, like: list, sizes: list) -> list:
    """``buf`` (from ``_gather``) as views shaped like the tensors of ``like``."""
    if len(like) == 1:
        return [buf.view_as(like[0])]
    return [x if x.shape == t.shape else x.view(t.shape) for x, t in zip(buf.split(sizes), like)]


def _kept_in_place(keys, fp, old, new_p: dict, new: list) -> None:
    """Leaves ``keys`` were updated in place: their parameters and moments are the new ones."""
    for k in keys:
        new_p[k] = fp[k]
        for d, o in zip(new, old):
            d[k] = o[k]


def _descend(kind: Fused8bit, xs: list, us: list, lr, wd) -> None:
    """``x ← x − η(u + λx)`` in place on the fp32 tensors ``xs`` (multi-tensor ops): λx, + u,
    × η, then the subtraction, each rounded to fp32 (·, + and × commute exactly); without
    decay ``x − η·u``, one ``sub`` with ``alpha=η`` when η·u is exact (``unit_direction``)."""
    lr32 = lr.to(torch.float32) if isinstance(lr, torch.Tensor) else lr
    if isinstance(wd, torch.Tensor) or wd != 0:
        t = torch._foreach_mul(xs, wd)
        torch._foreach_add_(t, us)
        torch._foreach_mul_(t, lr32)
        torch._foreach_sub_(xs, t)
    elif kind.unit_direction and not isinstance(lr32, torch.Tensor):
        torch._foreach_sub_(xs, us, alpha=lr32)
    else:
        torch._foreach_sub_(xs, torch._foreach_mul(us, lr32))


def _round_small(xs: list, seed) -> None:
    """The small leaves' new fp32 values ``xs`` stochastically rounded in place to values bf16
    holds (the cast back is then exact), with the noise of ``seed``: the step's seed from the
    optimizer state's count (``sr_seeds``), drawn per leaf as Lion8bit's small-leaf kernel draws
    it (``kernels/small.py``).  ``seed`` None: no stochastic rounding (the cast rounds to nearest)."""
    if seed is not None:
        from pgs.func.kernels import small as KS

        KS.stochastic_round_(xs, seed)


def _apply_lists(kind: Fused8bit, keys, fp, ps, x, xs, us, lr, wd, seed, new_p, new, old) -> None:
    """``_step_small``'s apply with the direction as a list (``small_inplace``): the same
    operations per leaf as multi-tensor ops on the views ``xs`` of the one fp32 buffer ``x``,
    then the same seeded rounding (``_round_small``)."""
    _descend(kind, xs, [u if u.dtype == torch.float32 else u.float() for u in us], lr, wd)
    _round_small(xs, seed)
    torch._foreach_copy_(ps, xs)
    _kept_in_place(keys, fp, old, new_p, new)


def _step_small(kind: Fused8bit, ctx, keys: list, fg, fp, old, lr, wd, seed, donate: bool,
                new_p: dict, new: list) -> None:
    """The small (fp32-state) leaves ``keys``, which share dtypes and weight decay, as ONE
    flat leaf: the reference direction and the fp32 apply are elementwise, so concatenating
    changes no value, and a group of small leaves costs one set of tiny kernels instead of one
    set per leaf.  ``seed``: the step's stochastic-rounding seed for these leaves (bf16
    parameters with stochastic rounding; None otherwise), drawn leaf by leaf (``_round_small``:
    the noise is a function of the optimizer state, not of torch's global generator).

    The kernels (each a multi-tensor ``torch._foreach_*`` op where it touches every leaf): the
    gradients copied into one compute-dtype buffer and the parameters into one fp32 buffer
    (one copy for both, casting on the way: ``_load``); the moments concatenated (a cat per
    field; Lion with ``donate``: stepped in place leaf by leaf, ``small_inplace``); the
    direction (``kind.small``); ``p − η(u + λp)`` in place in the fp32 buffer (λp, + u, × η,
    then the subtraction, each rounded to fp32); stochastic rounding (one Triton launch per
    ≤ 4 leaves); then, with ``donate``,
    one copy back into the parameters (the cast to their dtype, exact after stochastic
    rounding) and one into the moments.  ``lr`` is a number (a constant learning rate: no
    conversion kernel; a Python number is rounded to fp32 exactly as ``lr.to(float32)``) or
    the step's 0-d tensor."""
    ps = [fp[k] for k in keys]
    sizes = [p.numel() for p in ps]
    gs = [fg[k] for k in keys]
    cd = compute_dtype(gs[0])
    g, g_views, x, xs = _load(gs, ps, cd, sizes)  # x: a new buffer, updated in place below
    if donate and kind.small_inplace is not None and not isinstance(wd, torch.Tensor):
        us = kind.small_inplace(ctx, g_views, [[o[k] for k in keys] for o in old])
        if us is not None:
            _apply_lists(kind, keys, fp, ps, x, xs, us, lr, wd, seed, new_p, new, old)
            return
    moments = tuple(o[keys[0]] if len(keys) == 1 else torch.cat([_flat1(o[k]) for k in keys]) for o in old)
    u, out = kind.small(ctx, g, moments)
    _descend(kind, [x], [u.float()], lr, wd)
    _round_small(xs, seed)  # bf16 values in fp32: the cast below is exact
    if donate:
        torch._foreach_copy_(ps, xs)
        dst = [o[k] for o in old for k in keys]
        src = [part for o, m_new in zip(old, out) for part in _parts(m_new, [o[k] for k in keys], sizes)]
        torch._foreach_copy_(dst, src)
        _kept_in_place(keys, fp, old, new_p, new)
        return
    # own storage per leaf (views of one buffer would be saved as shared tensors)
    one = len(keys) == 1
    xs = _parts(x.to(ps[0].dtype, copy=one), ps, sizes)  # one leaf: not a view into _load's buffer
    for j, k in enumerate(keys):
        new_p[k] = xs[j] if one else xs[j].clone()
    for d, o, m_new in zip(new, old, out):
        parts = _parts(m_new.to(torch.float32), [o[k] for k in keys], sizes)
        for j, k in enumerate(keys):
            d[k] = parts[j] if one else parts[j].clone()


def fused_8bit_step(kind: Fused8bit, *, quantize: bool, backend: str, block_size: int, learning_rate,
                    weight_decay, mask) -> Callable:
    """The fused step of ``chain(<8-bit direction>, add_decayed_weights, scale_by_learning_rate)``.

    One kernel per 8-bit leaf (update and apply, in place with ``donate``); small leaves take
    the reference direction and an fp32 apply.  ``layout`` None means ``fg`` is a
    per-parameter tree (gradient release steps one group of whole tensors; each tensor is its
    own run of quantization blocks, as ``init`` made it); ``ctx.sr_offset`` keeps the
    stochastic-rounding seeds of different release groups apart.  Returns None (use the
    generic path) where a leaf cannot take the kernel.
    """

    def fused_step(fg, state, fp, *, ctx: StepContext, donate, memory: MemoryOptions, extra=None):
        if not quantize or any(
            not K.use_triton(backend, g, block_size) for g in fg.values() if g is not None
        ):
            return None
        layout = ctx.layout
        sr_base = ctx.sr_offset
        n_dir, n_dec, n_lr = list(state)
        s_dir, s_lr = state[n_dir], state[n_lr]
        # a constant learning rate reaches the kernels as a number: its hyperparameter vector
        # is then a cached device tensor (no per-call copies); the state keeps a tensor, one
        # cached 0-d tensor for every call (the state's lr is never written in place)
        const_lr = isinstance(learning_rate, (int, float))
        lr = constant_lr(s_lr.count.device, learning_rate) if const_lr else lr_value(learning_rate, s_lr.count)
        lr_k = float(learning_rate) if const_lr else lr
        lr_count = None
        if kind.counted:
            dir_count, lr_count = increment_pair(s_dir.count, s_lr.count)
            seed_count, dir_count, ctx = kind.prepare(s_dir, s_lr, dir_count)
        else:
            seed_count, dir_count, ctx = kind.prepare(s_dir, s_lr)
        seeds = []  # every leaf's seed, made by the first leaf that rounds stochastically

        def seed_of(i: int):  # one kernel for all, not three per leaf (sr_seeds)
            if not seeds:
                seeds.extend(sr_seeds(seed_count, sr_base, len(fg)).unbind(0))
            return seeds[i]

        labels = group_label(layout, fg, mask) if mask is not None else None
        old = [getattr(s_dir, f) for f in kind.fields]
        new_p, new = {}, [{} for _ in kind.fields]
        small: dict[tuple, tuple] = {}  # small leaves by what they must share to be stepped as one
        for i, (k, g) in enumerate(fg.items()):
            p, moments = fp[k], tuple(o[k] for o in old)
            if g is None:
                x, out = p, moments
            else:
                wd = weight_decay if (nonzero(weight_decay) and (labels is None or labels[k])) else 0.0
                if not isinstance(moments[0], Quantized8bit):  # fp32 state: stepped together below
                    key = (id(wd) if isinstance(wd, torch.Tensor) else wd, g.dtype, p.dtype, g.device,
                           tuple(m.dtype for m in moments))
                    small.setdefault(key, (wd, []))[1].append(k)
                    new_p[k] = None  # keeps the trees' order; filled below
                    for d in new:
                        d[k] = None
                    continue
                sr = memory.stochastic_rounding and p.dtype == torch.bfloat16
                x, out = kind.quantized(ctx, g, p, moments, lr_k, wd, seed_of(i) if sr else None, donate)
            new_p[k] = x
            for d, m in zip(new, out):
                d[k] = m
        index = {k: i for i, k in enumerate(fg)} if small else None
        for wd, keys in small.values():
            # the group's seed: its first leaf's, whichever route steps it (the same noise)
            sr = memory.stochastic_rounding and fp[keys[0]].dtype == torch.bfloat16
            seed = seed_of(index[keys[0]]) if sr else None
            if donate and kind.small_kernel is not None:  # one Triton launch per ≤ 4 leaves, in place
                if kind.small_kernel(ctx, [fg[k] for k in keys], [fp[k] for k in keys],
                                     [[o[k] for k in keys] for o in old], lr_k, wd, seed):
                    _kept_in_place(keys, fp, old, new_p, new)
                    continue
            _step_small(kind, ctx, keys, fg, fp, old, lr_k, wd, seed, donate, new_p, new)
        new_state = {
            n_dir: kind.make_state(dir_count, *new),
            n_dec: state[n_dec] if isinstance(state[n_dec], EmptyState) else EmptyState(),
            n_lr: ScaleByLearningRateState(increment(s_lr.count) if lr_count is None else lr_count, lr),
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
    one fp32 absmax per ``block_size`` elements; docs/techniques/8bit.md).  Leaves with fewer than
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

    def init(params, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        check_layout(layout, block_size, who)
        labels = group_label(layout, params, eligible)
        return ScaleByLion8bitState(
            zero_count(params),
            T.tree_map_with_path(lambda path, x: init_moment(x, quantize and labels[path], block_size, True), params),
        )

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        check_layout(ctx.layout, block_size, who)
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

    # ``fused`` names this block for the execution layer's chain matcher (pgs.func.fused_adamw_lion);
    # the 8-bit fused kernels are reached through ``lion8bit``'s FusedTransform.
    return Transform(init, update, name="scale_by_lion8bit", locality=ELEMENTWISE, stage=DIRECTION,
                     group_by=(eligible,), align=block_size,
                     fused=("lion8bit", dict(b1=b1, b2=b2, block_size=block_size, min_8bit_size=min_8bit_size,
                                             backend=backend)) if quantize else None)


@takes_learning_rate
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
    per flat group (``pgs.func.kernels.fused_transform``); elsewhere it is the plain chain.

    Example::

        fast = pf.compile(pf.lion8bit(3e-5, weight_decay=0.1), donate=True)
        state = fast.init(params)
        params, state = fast.step(grads, state, params)
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="lion8bit")
    direction = scale_by_lion8bit(b1, b2, block_size, min_8bit_size, quantize, backend)
    decay = add_decayed_weights(weight_decay, mask) if nonzero(weight_decay) else identity()
    base = chain(direction, decay, scale_by_learning_rate(learning_rate))
    fn = mask_fn(mask, "lion8bit")

    w1, w2 = one_minus(b1), one_minus(b2)

    def hp(hps, device, lr, wd):  # [1−β1, 1−β2, η, λ]
        return step_hp(hps, device, wd, lambda: hp_tensor(device, w1, w2, lr, wd))

    def quantized(hps, g, p, moments, lr, wd, seed, donate):
        (m,) = moments
        new_p, m_new = K.lion8bit(g, m, hp(hps, g.device, lr, wd), block_size, p=p,
                                  out=p if donate else torch.empty_like(p), m_out=m if donate else None,
                                  seed=seed)
        return new_p, (m_new,)

    def small(ctx, g, moments):
        u, m_new = lion_leaf(g, moments[0], w1, w2, block_size)
        return u, (m_new,)

    def small_kernel(hps, gs, ps, moments, lr, wd, seed):
        """The small leaves in one Triton launch per ≤ 4 (``kernels/small.py``), in place:
        False where it cannot (tensor hyperparameters, dtypes, no GPU or interpreter)."""
        (ms,) = moments
        if not K.CONFIG.small_kernel or any(isinstance(x, torch.Tensor) for x in (w1, w2, wd)):
            return False
        from pgs.func.kernels import small as KS

        if not KS.usable(gs, ps, ms):
            return False
        KS.lion_small_(gs, ps, ms, hp(hps, gs[0].device, lr, wd), seed)
        return True

    def small_inplace(ctx, gs, moments):
        (ms,) = moments  # lion_leaf's operations leaf by leaf: the same lerp (ATen's Lerp.h) per element
        if isinstance(w1, torch.Tensor) or isinstance(w2, torch.Tensor) or gs[0].dtype != torch.float32 \
                or any(m.dtype != torch.float32 for m in ms):
            return None
        us = torch._foreach_lerp(ms, gs, w1)
        torch._foreach_sign_(us)
        torch._foreach_lerp_(ms, gs, w2)
        return us

    kind = Fused8bit(
        fields=("mu",),
        # the seed counts the learning-rate state's steps; the direction's count advances
        prepare=lambda s_dir, s_lr, dir_count: (s_lr.count, dir_count, {}),
        quantized=quantized, small=small, make_state=ScaleByLion8bitState, counted=True,
        unit_direction=True,  # sign(·)
        small_inplace=small_inplace,
        small_kernel=small_kernel,
    )
    fused_step = fused_8bit_step(kind, quantize=quantize, backend=backend, block_size=block_size,
                                 learning_rate=learning_rate, weight_decay=weight_decay, mask=fn)

    return FusedTransform(base.init, base.update, name=base.name, locality=base.locality, stage=base.stage,
                          children=base.children, fused_step=fused_step)
