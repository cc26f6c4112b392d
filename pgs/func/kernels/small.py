"""Lion on the small fp32-state leaves of a release group, several leaves per launch; the
seeded stochastic rounding of every 8-bit chain's small leaves.

The 8-bit chains keep tensors under ``min_8bit_size`` elements (RMSNorm weights, q/k norms)
with fp32 moments.  In torch ops their update is ~20 tiny kernels per group (gather, lerp,
sign, the fp32 apply, stochastic rounding, the copies back), each paying the host's launch
cost inside backward, where gradient release is host-bound (docs/performance.md has the
measured cost per decoder layer).  Here it is one launch
for up to ``MAX_LEAVES`` leaves, in place, with the arithmetic of the reference path:

    c = lerp(m, g, 1−β1);  u = sign(c);  m ← lerp(m, g, 1−β2)        (Lion, arXiv 2302.06675)
    p ← p − η(u + λp)   (rounded to p's dtype, stochastically for bf16 with ``SR``)

``lerp`` is torch's: ``m + w(g − m)`` for |w| < ½, else ``g − (g − m)(1 − w)``.  Results equal
the torch path up to FMA contraction (an ulp of m or of the fp32 parameter before rounding);
stochastic rounding draws its 16 noise bits from the 8-bit kernels' hash stream
(``blockwise8.sr_noise``).

``stochastic_round_`` is that rounding alone, for the small leaves stepped by torch ops
(AdamW8bit's always, Lion8bit's where this kernel cannot serve): the same seed and offsets,
so the step is a function of (updates, state, params), never of torch's global generator.
``pgs.func.apply.sr_noise`` draws the same words with torch ops (where no Triton runs, and on
the plain optimizer paths).
"""

from __future__ import annotations

import torch

from pgs.func.kernels import _launch, interpreting

#: Leaves one launch takes (pointer arguments of the kernel); more leaves take more launches.
MAX_LEAVES = 4
BLOCK = 1024
#: Noise offsets of leaf i start at i·2^24 (a leaf under 2^24 elements never overlaps the next).
LEAF_STRIDE = 1 << 24

try:
    import triton
    import triton.language as tl

    from pgs.func.kernels.blockwise8 import bf16_bits, rne_add, sr_noise

    @triton.jit
    def _lerp(a, b, w):
        # torch's lerp (ATen Lerp.h): two formulas, picked by the weight's size
        if tl.abs(w) < 0.5:
            r = a + w * (b - a)
        else:
            r = b - (b - a) * (1.0 - w)
        return r

    @triton.jit
    def _leaf_round(x, seed_ptr, leaf, offs, STRIDE: tl.constexpr):
        """fp32 ``x`` (elements ``offs`` of leaf ``leaf``) stochastically rounded to values bf16
        holds: the small leaves' one noise stream, element e of leaf i at offset i·STRIDE + e
        of the 8-bit kernels' hash stream for the step's seed."""
        return bf16_bits(x, sr_noise(seed_ptr, leaf * STRIDE + offs))

    @triton.jit
    def _leaf_step(g_ptr, p_ptr, m_ptr, n, blk, leaf, hp_ptr, seed_ptr,
                   BLOCK: tl.constexpr, SR: tl.constexpr, STRIDE: tl.constexpr,
                   BF16: tl.constexpr):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w1 = tl.load(hp_ptr + 0)
        w2 = tl.load(hp_ptr + 1)
        lr = tl.load(hp_ptr + 2)
        wd = tl.load(hp_ptr + 3)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        c = _lerp(m, g, w1)
        u = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
        # (NaN: both tests fail, u = 0, as torch.sign gives)
        tl.store(m_ptr + offs, _lerp(m, g, w2), mask=mask)
        x = p - lr * (u + wd * p)
        if BF16:  # rounded here, stochastically or to nearest: the cast below is exact
            if SR:
                x = _leaf_round(x, seed_ptr, leaf, offs, STRIDE)
            else:
                x = bf16_bits(x, rne_add(x))
        tl.store(p_ptr + offs, x.to(p_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def lion_small_kernel(g0, p0, m0, n0, g1, p1, m1, n1, g2, p2, m2, n2, g3, p3, m3, n3,
                          hp_ptr, seed_ptr, leaf0,
                          BLOCK: tl.constexpr, SR: tl.constexpr, STRIDE: tl.constexpr,
                          BF16: tl.constexpr):
        """Program (i, b): block b of leaf i (i < the number of leaves passed; unused slots
        repeat leaf 0 with n = 0).  hp = [1−β1, 1−β2, η, λ]; ``leaf0``: the first leaf's index
        in the group (its noise stream)."""
        i = tl.program_id(0)
        b = tl.program_id(1)
        if i == 0:
            _leaf_step(g0, p0, m0, n0, b, leaf0, hp_ptr, seed_ptr, BLOCK, SR, STRIDE, BF16)
        elif i == 1:
            _leaf_step(g1, p1, m1, n1, b, leaf0 + 1, hp_ptr, seed_ptr, BLOCK, SR, STRIDE, BF16)
        elif i == 2:
            _leaf_step(g2, p2, m2, n2, b, leaf0 + 2, hp_ptr, seed_ptr, BLOCK, SR, STRIDE, BF16)
        else:
            _leaf_step(g3, p3, m3, n3, b, leaf0 + 3, hp_ptr, seed_ptr, BLOCK, SR, STRIDE, BF16)

    @triton.jit
    def _round_leaf(x_ptr, n, blk, leaf, seed_ptr, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(x_ptr + offs, _leaf_round(x, seed_ptr, leaf, offs, STRIDE), mask=mask)

    @triton.jit
    def sr_round_kernel(x0, n0, x1, n1, x2, n2, x3, n3, seed_ptr, leaf0,
                        BLOCK: tl.constexpr, STRIDE: tl.constexpr):
        """Program (b, i): block b of the fp32 buffer i rounded in place with leaf
        ``leaf0 + i``'s noise (unused slots repeat buffer 0 with n = 0).  Blocks on the grid's
        first axis, which a large buffer (a fallback embedding) needs: the others stop at 65535."""
        b = tl.program_id(0)
        i = tl.program_id(1)
        if i == 0:
            _round_leaf(x0, n0, b, leaf0, seed_ptr, BLOCK, STRIDE)
        elif i == 1:
            _round_leaf(x1, n1, b, leaf0 + 1, seed_ptr, BLOCK, STRIDE)
        elif i == 2:
            _round_leaf(x2, n2, b, leaf0 + 2, seed_ptr, BLOCK, STRIDE)
        else:
            _round_leaf(x3, n3, b, leaf0 + 3, seed_ptr, BLOCK, STRIDE)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency; kept for partial installs
    HAVE_TRITON = False


def usable(gs: list, ps: list, ms: list) -> bool:
    """Whether ``lion_small_`` can step these leaves: contiguous, fp32 moments, one device, a
    GPU (or Triton's interpreter), parameters in bf16/fp16/fp32, gradients likewise."""
    if not HAVE_TRITON or not gs:
        return False
    dev = ps[0].device
    if dev.type != "cuda" and not interpreting():
        return False
    floats = (torch.bfloat16, torch.float16, torch.float32)
    for g, p, m in zip(gs, ps, ms):
        if not (isinstance(m, torch.Tensor) and m.dtype == torch.float32 and p.dtype in floats
                and g.dtype in floats and g.shape == p.shape == m.shape and g.device == p.device == m.device == dev
                and g.is_contiguous() and p.is_contiguous() and m.is_contiguous()):
            return False
    return len({p.dtype for p in ps}) == 1 and len({g.dtype for g in gs}) == 1


def lion_small_(gs: list, ps: list, ms: list, hp: torch.Tensor, seed: torch.Tensor | None, first: int = 0) -> None:
    """Lion on leaves ``(gs[i], ps[i], ms[i])`` in place (see the module docstring); ``hp`` =
    ``[1−β1, 1−β2, η, λ]`` (fp32, on the device); ``seed`` (int64 device tensor) turns on
    stochastic rounding of bf16 parameters; ``first``: the first leaf's index for the noise."""
    sr = seed is not None and ps[0].dtype == torch.bfloat16
    seed_arg = seed if seed is not None else hp  # never read without SR
    for at in range(0, len(ps), MAX_LEAVES):
        chunk = list(zip(gs[at:at + MAX_LEAVES], ps[at:at + MAX_LEAVES], ms[at:at + MAX_LEAVES]))
        args = []
        for j in range(MAX_LEAVES):
            g, p, m = chunk[j] if j < len(chunk) else chunk[0]
            args += [g, p, m, p.numel() if j < len(chunk) else 0]
        blocks = -(-max(p.numel() for _, p, _ in chunk) // BLOCK)
        _launch(lion_small_kernel, (len(chunk), max(blocks, 1)),
                (*args, hp, seed_arg, first + at),
                dict(BLOCK=BLOCK, SR=sr, STRIDE=LEAF_STRIDE, BF16=ps[0].dtype == torch.bfloat16,
                     num_warps=4))


def stochastic_round_(xs: list, seed: torch.Tensor, first: int = 0) -> None:
    """Round the fp32 tensors ``xs`` (the small leaves' new parameters, before their cast to
    bf16) stochastically to values bf16 holds, in place, with the noise ``lion_small_`` draws
    for the same leaves and seed: element e of ``xs[i]`` takes offset (first + i)·2^24 + e of
    the hash stream of ``seed`` (an int64 device tensor made from the optimizer state's step
    count).  So the rounding is a function of the state and the values only (never of torch's
    global generator), and Lion8bit's small leaves round alike whichever path stepped them.
    ±inf and NaN stay (the cast then rounds them as it would).  Needs a GPU or Triton's CPU
    interpreter (``usable_for``).  A tensor over ``MAX_LAUNCH`` elements (offsets are int32) is
    rounded in pieces, piece k > 0 with the seed ``kernels._chunk_seed`` gives it, as the 8-bit
    kernels split their launches.  Stochastic rounding: Gupta et al., arXiv 1502.02551."""
    from pgs.errors import InvalidArgument
    from pgs.func import kernels as K

    if not xs:
        return
    if not usable_for(xs[0]):
        raise InvalidArgument("stochastic rounding of small or fallback leaves runs in a Triton kernel: "
                              "it needs a GPU, or TRITON_INTERPRET=1 on the CPU (backend='triton')")
    if any(x.dtype != torch.float32 for x in xs):
        raise ValueError("stochastic_round_: fp32 buffers only")
    bufs = [x if x.is_contiguous() else x.contiguous() for x in xs]  # the kernel walks memory linearly
    launches = []  # (buffers, seed, first leaf index)
    for i, x in enumerate(bufs):
        if x.numel() > K.MAX_LAUNCH:
            flat = x.view(-1)
            for k, s in enumerate(range(0, flat.numel(), K.MAX_LAUNCH)):
                launches.append(([flat[s:s + K.MAX_LAUNCH]], K._chunk_seed(seed, k), first + i))
    small = [i for i, x in enumerate(bufs) if x.numel() <= K.MAX_LAUNCH]
    for at in range(0, len(small), MAX_LEAVES):
        run = small[at:at + MAX_LEAVES]
        if run == list(range(run[0], run[0] + len(run))):  # consecutive leaves: one launch
            launches.append(([bufs[i] for i in run], seed, first + run[0]))
        else:
            launches.extend(([bufs[i]], seed, first + i) for i in run)
    for chunk, sd, leaf0 in launches:
        args = []
        for j in range(MAX_LEAVES):
            x = chunk[j] if j < len(chunk) else chunk[0]
            args += [x, x.numel() if j < len(chunk) else 0]
        blocks = -(-max(x.numel() for x in chunk) // BLOCK)
        _launch(sr_round_kernel, (max(blocks, 1), len(chunk)), (*args, sd, leaf0),
                dict(BLOCK=BLOCK, STRIDE=LEAF_STRIDE, num_warps=4))
    for x, buf in zip(xs, bufs):
        if buf is not x:
            x.copy_(buf)


def usable_for(x: torch.Tensor) -> bool:
    """Whether ``stochastic_round_`` can round ``x``'s device: a GPU, or Triton's CPU interpreter."""
    return HAVE_TRITON and (x.device.type == "cuda" or interpreting())
