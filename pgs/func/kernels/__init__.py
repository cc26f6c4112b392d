"""Fused Triton kernels for the 8-bit optimizers, and when to use them.

The composition layer (``pgs.func.lion8bit``, ``pgs.func.adam8bit``) never needs this
package: every kernel here replaces a torch reference function with the same results, and
the transforms pick it by ``backend``:

- ``"auto"``: Triton on CUDA tensors, the torch reference elsewhere;
- ``"torch"``: always the reference;
- ``"triton"``: always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set before this
  package first compiles a kernel; the tests do that at tiny sizes).

Launchers take and return plain tensors; hyperparameters go in as one fp32 device tensor.
"""

from __future__ import annotations

import functools
import os

import torch

from pgs.func.quant8 import Quantized8bit, bucket_table, dynamic_map, midpoints

#: Quantization blocks per program, and warps per program: one warp per 256-element block,
#: so each block's absmax is a warp-shuffle reduction (no shared memory, no barrier), and
#: each thread owns 8 contiguous elements (16-byte bf16 loads, 8-byte code loads/stores).
#: 4 blocks per program: small enough for many resident programs (latency hiding for a
#: memory-bound kernel), large enough to amortise the per-program scalar loads.
ROWS = int(os.environ.get("PGS_8BIT_ROWS", "4"))
NUM_WARPS = int(os.environ.get("PGS_8BIT_WARPS", "4"))
#: Lion8bit's own blocks per program: 8 on the H200 (8.39 ms against 8.6-9.3 ms for 4 in the
#: same run, bench/results/optim_8bit_issue4_variants.json); AdamW8bit keeps ``ROWS`` = 4
#: (16.4 ms with 8 against 15.9).  ``PGS_8BIT_LION_ROWS``.
LION_ROWS = int(os.environ.get("PGS_8BIT_LION_ROWS", "8"))
#: Dequantize by one gather per element from the 256-entry map instead of the exact
#: arithmetic decode (``blockwise8._decode``); both give identical values.  An A/B knob for
#: device benchmarks (the arithmetic decode costs ~40 ALU instructions, the gather an L1
#: wavefront per distinct 128-byte line a warp touches).
DEQ_TABLE = os.environ.get("PGS_DEQ_TABLE", "1") == "1"
#: Requantization: 1 = one 16-bit gather per element from a bucket table plus ~20 integer
#: instructions and a rare predicated second load (``blockwise8._encode_bucket``); 2 = one
#: 32-bit gather (twice the table) and no second load; 3 = one 32-bit gather from a table
#: over the whole fp32 word (sign and NaN folded in, ~10 instructions; a signed moment
#: touches twice the cache lines); 0 = the gather-free arithmetic
#: encoder (~55 instructions).  Same codes.  ``PGS_8BIT_ENC``.
ENC = int(os.environ.get("PGS_8BIT_ENC", "2"))
#: The same choice for AdamW's second moment (unsigned map).  Its normalised values spread
#: over many binades, so a table gather touches ~16-22 cache lines per warp instruction
#: (``bench/experiments/gather_lines.py``) against ~6 for m: the arithmetic encoder may win
#: there; measured on the H200 the 32-bit table still wins (13.2 ms against 15.9 ms for the
#: arithmetic encoder, 15.3 ms for ENC=ENC_V=1).  ``PGS_8BIT_ENC_V``.
ENC_V = int(os.environ.get("PGS_8BIT_ENC_V", "2"))
#: Stochastic-rounding noise: 1 = an integer hash of (seed, offset), ~8 instructions per
#: element; 0 = Philox4x32-10 per element (``tl.randint``).  ``PGS_8BIT_RNG``.
RNG = int(os.environ.get("PGS_8BIT_RNG", "1"))
#: AdamW8bit: per-step reciprocals and an approximate sqrt/division instead of three
#: ``div_rn`` and a ``sqrt_rn`` per element.  ``PGS_8BIT_FAST_DIV``.
FAST_DIV = os.environ.get("PGS_8BIT_FAST_DIV", "1") == "1"
#: Where the per-element table lookups read their table (issue #4: a warp's 32 random
#: gathers into the 1 KiB map cost up to 8 L1 wavefronts).  "global" (default): one global
#: load per element (inline-PTX ``ld.global.nc``).  "gather": each program loads the decode
#: map (256 fp32) and the m/v encoders' bucket tables (ENC/ENC_V 1 or 2: the 2048 / 4096
#: entries between the smallest midpoint and 1.0, ``blockwise8._gather_window``) once into a
#: register tensor and indexes it with ``tl.gather`` (on the GPU lowered through shared
#: memory).  "gather_dec": only the decode map.  Bit-identical results in every mode (tests);
#: the speed is for the GPU to decide.  ``PGS_8BIT_TABLE``.
TABLE = os.environ.get("PGS_8BIT_TABLE", "global")
TABLE_MODES = {"global": 0, "gather": 1, "gather_dec": 2}
#: Full programs run an unmasked copy of the kernel body, only the last one the masked copy.
SPLIT = os.environ.get("PGS_8BIT_SPLIT", "1") == "1"
#: Let the compiler contract a multiply and an add into one FMA (Triton's default).  It picks
#: the pair per element *position* and per kernel body (sm_90 PTX of the AdamW body, Triton
#: 3.9 offline: for one of a thread's elements it fuses ``v·β2`` into the FMA in the unmasked
#: copy and ``(1−β2)g²`` in the masked one; likewise ``q·absmax`` or ``(1−β1)(g − m)`` for
#: m), so the unmasked and masked bodies, and a launch specialised for
#: n % 16 == 0 (a MAX_LAUNCH piece), round some values differently by an ulp: a code moves by
#: 1 where a value sits at a midpoint (rare; the tests allow 1%) and a block's absmax by an
#: ulp where its largest element moved (5 of 27 blocks in the H200 run of the bodies test).
#: False: no contraction (explicit ``tl.math.fma`` stays), every body and launch agrees bit
#: for bit on a GPU as in the interpreter, at +3-5 static SASS instructions per element
#: (Lion 62.6 → 66.9, AdamW 100.2 → 105.2; sm_90, Triton 3.9; not timed).  ``PGS_8BIT_FP_FUSION``.
FP_FUSION = os.environ.get("PGS_8BIT_FP_FUSION", "1") == "1"
#: Load the parameter together with the gradient and the codes, before the requantization,
#: instead of after it.  The step kernels store the new codes and absmax before they touch
#: the parameter, and the compiler does not move a load above a store that may alias it (with
#: ``donate`` the outputs *are* the inputs), so each program waited for DRAM twice: once for
#: (g, codes, absmax), once for p.  Early, one wait covers all of a program's loads, at the
#: cost of the parameter's registers held through the quantization.  H200, one run
#: (bench/results/s4_call1_optim_8bit.json, Qwen3-1.7B shapes, steps issued back to back):
#: Lion8bit 4.24 → 3.95 ms (0.76 → 0.82 of copy bandwidth), AdamW8bit 6.71 → 6.55 ms; with 4
#: or 2 blocks per program, or a 64-register cap, it was slower.  ``PGS_8BIT_EARLY_P``.
EARLY_P = os.environ.get("PGS_8BIT_EARLY_P", "1") == "1"
#: Registers per thread the step kernels may use (ptxas ``.maxnreg``; None: the compiler's
#: choice, 69 for Lion8bit on sm_90 = 7 programs of 128 threads per SM, 42% occupancy).
#: ``PGS_8BIT_MAXNREG``; ignored by the CPU interpreter.
MAXNREG = int(os.environ["PGS_8BIT_MAXNREG"]) if os.environ.get("PGS_8BIT_MAXNREG") else None
#: Gradient release's small fp32-state leaves (norm weights) through ``kernels/small.py``: one
#: Triton launch per ≤ 4 leaves instead of ~10 multi-tensor torch ops (Lion8bit, in place).
#: ``PGS_SMALL_KERNEL``.
SMALL_KERNEL = os.environ.get("PGS_SMALL_KERNEL", "1") == "1"
#: Largest element count one launch covers: offsets are int32 in the kernels, so a larger
#: buffer runs as several launches over views (each with its own noise stream).
MAX_LAUNCH = 1 << 30
#: Under ``torch.compile`` the launchers run as opaque custom ops (``pgs::lion8bit_direction``,
#: ``pgs::adam8bit_direction``; the in-place ``p`` variants as a graph break): Dynamo then
#: never traces the launcher (its cached tables, views, the kernel's own lowering by
#: Inductor), and the kernel sees exactly the tensors an eager call would.  ``PGS_8BIT_OPAQUE=0``
#: lets Dynamo trace the launcher (A/B for diagnostics only).
OPAQUE = os.environ.get("PGS_8BIT_OPAQUE", "1") == "1"
BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if not triton_importable():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def use_triton(backend: str, x: torch.Tensor, block_size: int) -> bool:
    """Whether the fused kernel serves tensor ``x`` under ``backend``."""
    if backend == "torch" or block_size & (block_size - 1) or block_size > 4096:
        return False  # tl.arange needs a power of two
    if backend == "auto":
        return x.is_cuda and triton_importable()
    return True  # "triton": the caller asked for it (CPU needs the interpreter)


def _module():
    from pgs.func.kernels import blockwise8

    return blockwise8


@functools.lru_cache(maxsize=32)
def _maps(signed: bool, device: torch.device, enc: int = 1):
    """(map, midpoints, bucket table for encoder ``enc``, positive midpoints + inf) on ``device``."""
    code = dynamic_map(signed, device)
    mids = midpoints(code).contiguous()
    table, midp = bucket_table(signed, wide=enc == 2, word=enc == 3)
    return code, mids, table.to(device), midp.to(device)


def _chunks(n: int, block_size: int):
    """(start, length) of the launches covering n elements: each < 2^31, block-aligned."""
    step = max(block_size, MAX_LAUNCH // block_size * block_size)
    return [(s, min(step, n - s)) for s in range(0, max(n, 1), step)]


def _cut(x: torch.Tensor, s: int, n: int, whole: bool) -> torch.Tensor:
    return x if whole else x[s:s + n]  # no view per launch in the common single-launch case


def _chunk_seed(seed, i: int):
    if seed is None or i == 0:
        return seed
    return seed + i * 0x3C6EF372  # a different noise stream per launch of one buffer


def _table(mode=None) -> int:
    """The kernels' ``TABLE`` constexpr for a ``TABLE`` mode name (default: the module's)."""
    mode = TABLE if mode is None else mode
    if mode not in TABLE_MODES:
        raise ValueError(f"pgs.func.kernels.TABLE (PGS_8BIT_TABLE) must be one of {sorted(TABLE_MODES)}, "
                         f"got {mode!r}")
    return TABLE_MODES[mode]


def _grid(n: int, block_size: int, rows: int | None = None):
    nb = max(1, -(-n // block_size))
    return (-(-nb // (ROWS if rows is None else rows)),)


def _flat(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("fused 8-bit kernels need contiguous tensors")
    return x.view(-1)


def _no_seed(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def lion8bit(g, m: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None, m_out=None,
             seed: torch.Tensor | None = None):
    """One Lion step on a block-quantized momentum (see ``_lion8bit``); under
    ``torch.compile`` an opaque op (``OPAQUE``)."""
    if OPAQUE and _compiling():
        if p is None and out is None and m_out is None and seed is None:
            d, c, a = torch.ops.pgs.lion8bit_direction(g, m.codes, m.absmax, hp, block_size)
            return d, Quantized8bit(c, a)
        return _lion8bit_eager(g, m, hp, block_size, p=p, out=out, m_out=m_out, seed=seed)
    return _lion8bit(g, m, hp, block_size, p=p, out=out, m_out=m_out, seed=seed)


def _lion8bit(g, m: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None, m_out=None,
              seed: torch.Tensor | None = None):
    """One Lion step on a block-quantized momentum.

    Without ``p``: returns ``(sign direction shaped like g, new Quantized8bit)``; ``hp`` =
    ``[1−β1, 1−β2]``.  With ``p``: writes ``p − η(sign + λp)`` into ``out`` (which may be
    ``p`` itself) and the new momentum into ``m_out`` (which may be ``m``); ``hp`` =
    ``[1−β1, 1−β2, η, λ]``; ``seed`` (an int64 device tensor) turns on stochastic rounding
    of a bf16 ``out``.
    """
    k = _module()
    dev = g.device
    table = _table()
    code, mids, btab, midp = _maps(True, dev, ENC)
    apply = p is not None
    if out is None:
        out = torch.empty_like(p if apply else g)
    if m_out is None:
        m_out = Quantized8bit(torch.empty_like(m.codes), torch.empty_like(m.absmax))
    fg, fp, fo = _flat(g), _flat(p) if apply else _flat(g), _flat(out)
    fc, fco = _flat(m.codes), _flat(m_out.codes)
    chunks = _chunks(g.numel(), block_size)
    w = len(chunks) == 1
    for i, (s, n) in enumerate(chunks):
        b, nb = s // block_size, -(-n // block_size)
        sd = _chunk_seed(seed, i)
        _launch(k.lion8bit_kernel, _grid(n, block_size, LION_ROWS), (
            _cut(fg, s, n, w), _cut(fp, s, n, w), _cut(fo, s, n, w),
            _cut(fc, s, n, w), _cut(m.absmax, b, nb, w), _cut(fco, s, n, w), _cut(m_out.absmax, b, nb, w),
            code, mids, btab, midp, hp, sd if sd is not None else _no_seed(dev), n),
            dict(BLOCK=block_size, ROWS=LION_ROWS, APPLY=apply, SR=seed is not None, DEQ_TABLE=DEQ_TABLE,
                 ENC=ENC, RNG=RNG, SPLIT=SPLIT, TABLE=table, num_warps=NUM_WARPS, **_step_opts()))
    return out, m_out


def adam8bit(g, m: Quantized8bit, v: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None,
             m_out=None, v_out=None, seed: torch.Tensor | None = None):
    """One Adam step on block-quantized moments (see ``_adam8bit``); under ``torch.compile``
    an opaque op (``OPAQUE``)."""
    if OPAQUE and _compiling():
        if p is None and out is None and m_out is None and v_out is None and seed is None:
            d, mc, ma, vc, va = torch.ops.pgs.adam8bit_direction(g, m.codes, m.absmax, v.codes, v.absmax, hp,
                                                                 block_size)
            return d, Quantized8bit(mc, ma), Quantized8bit(vc, va)
        return _adam8bit_eager(g, m, v, hp, block_size, p=p, out=out, m_out=m_out, v_out=v_out, seed=seed)
    return _adam8bit(g, m, v, hp, block_size, p=p, out=out, m_out=m_out, v_out=v_out, seed=seed)


def _adam8bit(g, m: Quantized8bit, v: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None,
              m_out=None, v_out=None, seed: torch.Tensor | None = None):
    """One Adam step on block-quantized moments (signed map for m, unsigned for v).

    ``hp`` = ``[1−β1, β2, 1−β2, ε, ε_root, 1−β1^t, 1−β2^t]`` (+ ``[η, λ]`` with ``p``).
    Returns ``(direction or new parameter, new m, new v)``; see ``lion8bit`` for ``out``.
    """
    k = _module()
    dev = g.device
    table = _table()
    code_m, mids_m, btab_m, midp_m = _maps(True, dev, ENC)
    code_v, mids_v, btab_v, midp_v = _maps(False, dev, ENC_V)
    apply = p is not None
    if out is None:
        out = torch.empty_like(p if apply else g)
    if m_out is None:
        m_out = Quantized8bit(torch.empty_like(m.codes), torch.empty_like(m.absmax))
    if v_out is None:
        v_out = Quantized8bit(torch.empty_like(v.codes), torch.empty_like(v.absmax))
    fg, fp, fo = _flat(g), _flat(p) if apply else _flat(g), _flat(out)
    fm, fmo, fv, fvo = _flat(m.codes), _flat(m_out.codes), _flat(v.codes), _flat(v_out.codes)
    chunks = _chunks(g.numel(), block_size)
    w = len(chunks) == 1
    for i, (s, n) in enumerate(chunks):
        b, nb = s // block_size, -(-n // block_size)
        sd = _chunk_seed(seed, i)
        _launch(k.adam8bit_kernel, _grid(n, block_size), (
            _cut(fg, s, n, w), _cut(fp, s, n, w), _cut(fo, s, n, w),
            _cut(fm, s, n, w), _cut(m.absmax, b, nb, w), _cut(fmo, s, n, w), _cut(m_out.absmax, b, nb, w),
            _cut(fv, s, n, w), _cut(v.absmax, b, nb, w), _cut(fvo, s, n, w), _cut(v_out.absmax, b, nb, w),
            code_m, mids_m, btab_m, midp_m, code_v, mids_v, btab_v, midp_v, hp,
            sd if sd is not None else _no_seed(dev), n),
            dict(BLOCK=block_size, ROWS=ROWS, APPLY=apply, SR=seed is not None, DEQ_TABLE=DEQ_TABLE,
                 ENC=ENC, ENC_V=ENC_V, RNG=RNG, FAST_DIV=FAST_DIV, SPLIT=SPLIT, TABLE=table, num_warps=NUM_WARPS,
                 **_step_opts()))
    return out, m_out, v_out


def _fusion() -> dict:
    """``enable_fp_fusion`` as ``FP_FUSION`` says, passed explicitly: Triton 3.9 warns that its
    default (on) becomes off in 3.10, which would silently change these kernels' code and
    rounding.  Under Dynamo's trace (the traced path, ``OPAQUE=0``) only the non-default is
    passed, so that launch sees no option it did not see before."""
    if FP_FUSION and _compiling():
        return {}
    return {"enable_fp_fusion": FP_FUSION}


def _step_opts() -> dict:
    """Launch options of the step kernels (Lion8bit, AdamW8bit): ``_fusion`` plus ``EARLY_P``
    and ``MAXNREG``, each passed only when not the default."""
    opts = _fusion()
    if EARLY_P:
        opts["EARLY_P"] = True
    if MAXNREG and not interpreting():
        opts["maxnreg"] = MAXNREG
    return opts


#: Launch the step kernels through a cache of their compiled kernels (``_launch``) instead of
#: ``kernel[grid](...)``: Triton's launcher binds and specialises every argument and builds a
#: cache key per call (~56 us of host time per Lion8bit launch on the H200 machine,
#: bench/results/s4_call2_host_costs.json), and gradient release launches one per tensor inside
#: backward, where the host is the bottleneck.  ``PGS_8BIT_FAST_LAUNCH``.
FAST_LAUNCH = os.environ.get("PGS_8BIT_FAST_LAUNCH", "1") == "1"
_COMPILED: dict = {}


def _spec(args: tuple) -> tuple:
    """What Triton specialises a launch on, for our argument kinds: each tensor's dtype and
    16-byte alignment, each int's value being 1, its divisibility by 16 and its width."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        else:  # an int's signature type (i32 or i64) follows its range
            out.append((type(a), a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)))
    return tuple(out)


def _launch(kernel, grid: tuple, args: tuple, kw: dict) -> None:
    """``kernel[grid](*args, **kw)``; with ``FAST_LAUNCH`` (on a GPU), later launches with the
    same constexprs, options and specialisation call the compiled kernel's launcher directly,
    with the arguments Triton's own ``run`` would pass (every parameter, in order)."""
    if not FAST_LAUNCH or interpreting():
        kernel[grid](*args, **kw)
        return
    key = (kernel, tuple(kw.items()), _spec(args))
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **kw)
        try:
            template = []
            for i, p in enumerate(kernel.params):
                template.append(None if i < len(args) else kw.get(p.name, p.default))
            _COMPILED[key] = (compiled, template, len(args))
        except Exception:  # noqa: BLE001 - an unknown Triton layout: stay on the normal path
            pass
        return
    compiled, template, n = hit
    full = list(args) + template[n:]
    from triton import knobs
    from triton.runtime import driver

    stream = driver.active.get_current_stream(driver.active.get_current_device())
    g3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    compiled.run(g3[0], g3[1], g3[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(g3, stream, *full),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - old torch
        return False


@torch.compiler.disable
def _lion8bit_eager(*args, **kw):  # the in-place variant under torch.compile: a graph break
    return _lion8bit(*args, **kw)


@torch.compiler.disable
def _adam8bit_eager(*args, **kw):
    return _adam8bit(*args, **kw)


@torch.library.custom_op("pgs::lion8bit_direction", mutates_args=())
def _lion8bit_direction(g: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, hp: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, q = _lion8bit(g.contiguous(), Quantized8bit(codes.contiguous(), absmax.contiguous()), hp.contiguous(),
                     block_size)
    return d, q.codes, q.absmax


@_lion8bit_direction.register_fake
def _(g, codes, absmax, hp, block_size):
    return torch.empty_like(g), torch.empty_like(codes), torch.empty_like(absmax)


@torch.library.custom_op("pgs::adam8bit_direction", mutates_args=())
def _adam8bit_direction(g: torch.Tensor, mcodes: torch.Tensor, mabsmax: torch.Tensor, vcodes: torch.Tensor,
                        vabsmax: torch.Tensor, hp: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d, mq, vq = _adam8bit(g.contiguous(), Quantized8bit(mcodes.contiguous(), mabsmax.contiguous()),
                          Quantized8bit(vcodes.contiguous(), vabsmax.contiguous()), hp.contiguous(), block_size)
    return d, mq.codes, mq.absmax, vq.codes, vq.absmax


@_adam8bit_direction.register_fake
def _(g, mcodes, mabsmax, vcodes, vabsmax, hp, block_size):
    return (torch.empty_like(g), torch.empty_like(mcodes), torch.empty_like(mabsmax), torch.empty_like(vcodes),
            torch.empty_like(vabsmax))


def quantize(x: torch.Tensor, signed: bool, block_size: int, *, enc: int | None = None,
             table: str | None = None) -> Quantized8bit:
    """``quantize_blockwise(x, dynamic_map(signed), block_size)`` in one Triton kernel
    (``enc`` picks the encoder, default ``ENC``; ``table`` a ``TABLE`` mode, default ``TABLE``)."""
    k = _module()
    enc = ENC if enc is None else int(enc)
    tmode = _table(table)
    code, mids, btab, midp = _maps(bool(signed), x.device, enc)
    x = x.contiguous()
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(max(1, -(-n // block_size)), dtype=torch.float32, device=x.device)
    k.quantize_kernel[_grid(n, block_size)](
        _flat(x), _flat(codes), absmax, mids, btab, midp, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed), ENC=enc, TABLE=tmode,
        num_warps=NUM_WARPS, **_fusion(),
    )
    return Quantized8bit(codes, absmax)


def dequantize(q: Quantized8bit, signed: bool, block_size: int, *, table: bool | None = None,
               mode: str | None = None) -> torch.Tensor:
    """``dequantize_blockwise(q, dynamic_map(signed), block_size)`` in one Triton kernel (fp32);
    ``table`` = DEQ_TABLE, ``mode`` a ``TABLE`` mode (default ``TABLE``)."""
    k = _module()
    tmode = _table(mode)
    codes = q.codes.contiguous()
    code = _maps(bool(signed), codes.device)[0]
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    k.dequantize_kernel[_grid(n, block_size)](
        _flat(codes), q.absmax, _flat(out), code, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed),
        DEQ_TABLE=DEQ_TABLE if table is None else bool(table), TABLE=tmode, num_warps=NUM_WARPS, **_fusion(),
    )
    return out
