"""Applying updates to parameters, with optional stochastic rounding into bf16.

Stochastic rounding keeps small updates to low-precision weights unbiased in expectation
(Gupta et al., "Deep Learning with Limited Numerical Precision", arXiv 1502.02551):

    SR(x) = x₀ with probability 1 − q,  x₁ with probability q = |x − x₀| / |x₁ − x₀|,  E[SR(x)] = x

where x₀, x₁ are x's bf16 neighbours toward and away from zero.  bf16 keeps the top 16 bits
of an fp32 word (sign and magnitude), so adding 16 uniform random bits r to the low 16 bits
d = 2^16·q and cutting them carries into the kept bits (|x| goes to x₁) exactly when
r ≥ 2^16 − d: with probability q.

The random bits are a function of a seed and the element's index, never of torch's global
generator: the noise of the 8-bit kernels' counter-based hash stream (``blockwise8._sr_noise``)
computed with torch ops, so that every optimizer path (the fused kernels, the small-leaf
kernel, these torch ops on any device) draws the same bits for the same (seed, offset):

    key = h(lo ^ h(hi ^ 0x9E3779B9))         (lo, hi: the seed's low and high 32-bit words)
    r   = h'(offset ^ key) >> 16              (h: Wellons' xorshift-multiply mixer; h' without
                                               its last xorshift, which the top bits ignore)

The step's seed of tensor i is ``sr_seed(count, i)`` (``kernels/fused_transform.py``), made from
the chain state's step count (``step_count``), so ``apply_updates`` is a pure function of
(params, updates, state) and a resume repeats its draws.  Cost: ~12 integer elementwise ops per
element (one fused kernel under ``torch.compile``, separate kernels in eager mode) plus ~20
small ops per ``apply_updates`` call for the keys of all its tensors; this is the plain path's
cost only: the fused kernels draw the same numbers in registers.
"""

from __future__ import annotations

import torch

from pgs.errors import InvalidArgument
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions, memory_options
from pgs.func import kernels as K
from pgs.func import tree as T
from pgs.func.kernels.fused_transform import sr_seeds  # the fused steps' seeds, one per tensor

#: Noise offsets of leaf i start at i·2^24 (``kernels/small.py``'s ``LEAF_STRIDE``).
LEAF_STRIDE = 1 << 24


def _i32(v: int) -> int:
    """The uint32 word ``v mod 2^32`` as the int32 with the same bits."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


_M1, _M2, _GOLDEN = _i32(0x7FEB352D), _i32(0x846CA68B), _i32(0x9E3779B9)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``_hash32`` up to its last xorshift, on int32 tensors holding uint32 words (in place):
    ``>>`` is arithmetic on int32, so each logical shift masks the bits it shifted in; int32
    multiplication wraps modulo 2^32 like the kernel's uint32 one (the same low 32 bits)."""
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    x.mul_(_M1)
    x.bitwise_xor_((x >> 15) & 0x1FFFF)
    x.mul_(_M2)
    return x


def _word(v: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 ``v`` as an int32 tensor (sign-extended first: exact cast)."""
    return (((v & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


def stream_key(seed: torch.Tensor) -> torch.Tensor:
    """The per-seed key of the hash stream (int32 words, the seed's shape): ``_sr_noise``'s
    ``key = h(lo ^ h(hi ^ 0x9E3779B9))`` for each int64 seed."""
    seed = seed.to(torch.int64)
    lo, hi = _word(seed), _word(seed >> 32)
    inner = _mix(hi ^ _GOLDEN)
    inner.bitwise_xor_((inner >> 16) & 0xFFFF)  # the last xorshift of h
    outer = _mix(lo ^ inner)
    return outer.bitwise_xor_((outer >> 16) & 0xFFFF)


def _noise(key: torch.Tensor, n: int, base: int, device) -> torch.Tensor:
    """16 random bits (int32 in [0, 2^16)) at offsets base, …, base + n − 1 (mod 2^32: int32
    addition wraps like the kernel's int32 offsets)."""
    x = torch.arange(n, dtype=torch.int32, device=device)
    x.add_(_i32(base)).bitwise_xor_(key.reshape(1))
    return _mix(x).bitwise_right_shift_(16).bitwise_and_(0xFFFF)


def sr_noise(seed: torch.Tensor, n: int, *, leaf: int = 0, start: int = 0) -> torch.Tensor:
    """The stochastic-rounding noise of elements start, …, start + n − 1 of a tensor rounded with
    ``seed`` (an int64 tensor of one element) as leaf ``leaf``: int32 values in [0, 2^16), bit for
    bit what the Triton kernels draw for it (``kernels/small.py``'s ``stochastic_round_([x], seed,
    first=leaf)``; with leaf 0, a parameter tensor of the fused 8-bit kernels), computed with torch
    ops on ``seed``'s device.

    Element g draws ``_sr_noise`` at offset leaf·2^24 + (g mod L) (mod 2^32) of the stream of
    ``kernels._chunk_seed(seed, k)`` = seed + k·0x3C6EF372, k = ⌊g / L⌋: the kernels' launches
    of at most L = ``kernels.MAX_LAUNCH`` = 2^30 elements (their offsets are int32).
    For a fixed offset the key is a bijection of the seed, so over seeds every 16-bit value is
    equally likely and the rounding is unbiased; for a fixed seed distinct offsets give
    distinct words.
    """
    return _keyed_noise(seed.reshape(-1)[:1], None, n, leaf, start)


def _keyed_noise(seed: torch.Tensor, key: torch.Tensor | None, n: int, leaf: int, start: int) -> torch.Tensor:
    """``sr_noise``, with ``key`` = ``stream_key(seed)`` already made (None: made here), so that
    a call rounding many tensors derives all their keys in one pass."""
    length = K.MAX_LAUNCH
    parts, g, end = [], int(start), int(start) + int(n)
    while g < end:
        k, within = divmod(g, length)
        m = min(end - g, length - within)
        kk = key if (k == 0 and key is not None) else stream_key(K._chunk_seed(seed, k))
        parts.append(_noise(kk, m, leaf * LEAF_STRIDE + within, seed.device))
        g += m
    if not parts:
        return torch.zeros(0, dtype=torch.int32, device=seed.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stochastic_round_fp32(x: torch.Tensor, generator: torch.Generator | None = None, *,
                          seed: torch.Tensor | None = None, leaf: int = 0, start: int = 0,
                          inplace: bool = False) -> torch.Tensor:
    """``stochastic_round_to_bf16(x)`` before its final cast: fp32 values that bf16 holds
    exactly (non-finite ones unchanged, for the cast to round to nearest), so that a copy into
    a bf16 tensor (``copy_``, ``torch._foreach_copy_``) is the cast, with no kernel of its own.

    The noise: ``sr_noise(seed, x.numel(), leaf=leaf, start=start)`` (element e of ``x``, in
    row-major order, is element start + e of the seeded stream: a slab of a larger tensor
    rounds as the whole tensor would), or ``torch.randint`` from ``generator`` when that is
    given instead.  One of the two is required: nothing here reads torch's global generator.
    ``inplace``: write the result into ``x`` (an fp32 tensor) and return it."""
    if (seed is None) == (generator is None):
        raise InvalidArgument("stochastic rounding: pass seed= (an int64 tensor, e.g. sr_seed(step_count(state), i)) "
                              "or generator= (a torch.Generator), exactly one")
    x = x.float()
    if seed is not None:
        noise = sr_noise(seed, x.numel(), leaf=leaf, start=start)
    else:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return _round(x, noise, inplace)


def _round(x: torch.Tensor, noise: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """fp32 ``x`` + ``noise`` (int32 in [0, 2^16), x's element count) below the bf16 bits, cut."""
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + noise.view(x.shape)) & -65536).view(torch.float32)
    # round to nearest where x is not finite: ±inf come through the noise unchanged (their low
    # 16 bits are zero, and the carry-free truncation gives the same word back), so only NaN
    # (whose payload the noise could carry into an inf or wrap to −0) must be kept: x == x,
    # one kernel (isfinite takes four)
    if inplace:
        return torch.where(x == x, rounded, x, out=x)
    return torch.where(x == x, rounded, x)


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None, *,
                             seed: torch.Tensor | None = None, leaf: int = 0, start: int = 0) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 up or down at random, unbiased: E[round(x)] = x (arXiv 1502.02551;
    the module docstring has the equation).  The noise comes from ``seed`` (the kernels' hash
    stream, ``sr_noise``) or from an explicit ``generator``: exactly one.  Non-finite values are
    rounded to nearest."""
    return stochastic_round_fp32(x, generator, seed=seed, leaf=leaf, start=start).to(torch.bfloat16)


def step_count(state) -> torch.Tensor:
    """The step counter of a chain state: its first ``count`` leaf in tree order (the int32
    counters of ``scale_by_adam``, ``scale_by_learning_rate``, ...; an ``accumulate``'s
    ``mini_step`` is not one).  What the stochastic-rounding seeds are made of."""
    for path, leaf in T.leaves_with_paths(state):
        if path.rsplit(".", 1)[-1] == "count" and isinstance(leaf, torch.Tensor) and leaf.numel() == 1 \
                and not leaf.is_floating_point():
            return leaf
    raise InvalidArgument("stochastic rounding draws its noise from the chain state's step count, but this "
                          "state has no 'count' (add pf.scale_by_learning_rate to the chain, or round with "
                          "an explicit generator=)")


def apply_updates(params, updates, *, memory: MemoryOptions = NO_MEMORY_OPTIONS, state=None, first: int = 0,
                  start: int = 0, generator: torch.Generator | None = None):
    """θ ← θ + u, computed in fp32 and cast back to each parameter's dtype.

    With ``memory.stochastic_rounding`` (``memory``: a ``pf.MemoryOptions``), bf16 parameters are
    rounded stochastically (unbiased in expectation; arXiv 1502.02551), which lets bf16 weights
    accumulate updates smaller than their ulp without an fp32 master copy.  The noise of leaf i
    (in tree order) is the hash stream of seed ``sr_seed(step_count(state), first + i)``, from
    its element ``start`` on (``sr_noise``; ``start``: where these leaves sit in the tensors they
    are slabs of): pass the chain's new ``state`` so that the result is a function of (params, updates, state), or an
    explicit ``generator`` instead.  Returns a new tree; ``params`` is untouched.

    Example::

        updates, state = opt.update(grads, state, params)
        params = pf.apply_updates(params, updates, memory=pf.MemoryOptions(stochastic_rounding=True), state=state)
    """
    T.check_same_structure(params, updates, "params", "updates")
    stochastic_rounding = memory_options(memory, "apply_updates").stochastic_rounding
    streams: list[tuple[torch.Tensor, torch.Tensor]] = []  # (seeds, keys): made at the first bf16 leaf
    index = iter(range(1 << 62))  # leaf i in tree order (tree_map visits the tensor leaves in order)

    def noise_of(i: int, n: int) -> torch.Tensor:
        if not streams:
            if state is None:
                raise InvalidArgument("apply_updates: stochastic rounding draws its noise from the chain "
                                      "state's step count: pass state= (the state the update returned) "
                                      "or an explicit generator=")
            seeds = sr_seeds(step_count(state), first, len(T.leaves(params)))
            streams.append((seeds, stream_key(seeds)))  # every leaf's key in one pass
        seeds, keys = streams[0]
        return _keyed_noise(seeds[i:i + 1], keys[i:i + 1], n, 0, start)

    def one(p, u):
        i = next(index)
        cd = torch.promote_types(p.dtype, torch.float32)
        new = p.to(cd) + u.to(cd)
        if stochastic_rounding and p.dtype == torch.bfloat16:
            if generator is not None:
                return stochastic_round_to_bf16(new, generator)
            return _round(new.float(), noise_of(i, new.numel())).to(torch.bfloat16)
        return new.to(p.dtype)

    return T.tree_map(one, params, updates)
