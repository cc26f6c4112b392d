"""Fused Triton kernels for the 8-bit optimizers, and when to use them.

The composition layer (``pgs.func.lion8bit_direction``, ``pgs.func.adam8bit``) never needs this
package: every kernel here replaces a torch reference function with the same results, and
the transforms pick it by ``backend``:

- ``"auto"``: Triton on CUDA tensors, the torch reference elsewhere;
- ``"torch"``: always the reference;
- ``"triton"``: always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set before this
  package first compiles a kernel; the tests do that at tiny sizes).

Launchers take and return plain tensors; hyperparameters go in as one fp32 device tensor.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from pgs.func.kernels.kernel_config import KernelConfig, interpret_requested
from pgs.func.quant8 import Quantized8bit, bucket_table, dynamic_map

#: The configuration every launcher and route reads at call time (see ``KernelConfig``).
CONFIG = KernelConfig()


def configure(**changes) -> KernelConfig:
    """Replace fields of the process-wide ``CONFIG``; returns the new configuration."""
    global CONFIG
    CONFIG = CONFIG.evolve(**changes)
    return CONFIG


@contextlib.contextmanager
def using(config: KernelConfig):
    """Run the block under ``config``, then restore the previous ``CONFIG``."""
    global CONFIG
    if not isinstance(config, KernelConfig):
        raise TypeError(f"using: expected a KernelConfig, got {type(config).__name__}")
    old, CONFIG = CONFIG, config
    try:
        yield config
    finally:
        CONFIG = old


def triton_on_cpu() -> bool:
    """Whether CPU tensors may run the Triton kernels: ``CONFIG.triton_on_cpu`` and Triton's
    own ``TRITON_INTERPRET=1`` (the interpreter)."""
    return CONFIG.triton_on_cpu and interpret_requested()


#: Quantization blocks per program, and warps per program: one warp per 256-element block,
#: so each block's absmax is a warp-shuffle reduction (no shared memory, no barrier), and
#: each thread owns 8 contiguous elements (16-byte bf16 loads, 8-byte code loads/stores).
#: 4 blocks per program: small enough for many resident programs (latency hiding for a
#: memory-bound kernel), large enough to amortise the per-program scalar loads.
ROWS = 4
NUM_WARPS = 4
#: Lion8bit's own blocks per program (its body holds fewer live values than AdamW8bit's;
#: docs/performance.md, "Kernel defaults").
LION_ROWS = 8
#: Largest element count one launch covers: offsets are int32 in the kernels, so a larger
#: buffer runs as several launches over views (each with its own noise stream).
MAX_LAUNCH = 1 << 30
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
def _maps(signed: bool, device: torch.device):
    """(the 256-entry map, the encoder's bucket table) on ``device``."""
    return dynamic_map(signed, device), bucket_table(signed).to(device)


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
    """One Lion step on a block-quantized momentum (see ``_lion8bit``).

    Under ``torch.compile`` the launcher runs as an opaque custom op
    (``pgs::lion8bit_direction``; the in-place variants as a graph break): Dynamo never
    traces the launcher (its cached tables, views, the kernel's lowering by Inductor), and
    the kernel sees exactly the tensors an eager call would."""
    if _compiling():
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
    code, btab = _maps(True, dev)
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
            code, btab, hp, sd if sd is not None else _no_seed(dev), n),
            dict(BLOCK=block_size, ROWS=LION_ROWS, APPLY=apply, SR=seed is not None, **_split(),
                 num_warps=NUM_WARPS, **_fusion()))
    return out, m_out


def adam8bit(g, m: Quantized8bit, v: Quantized8bit, hp: torch.Tensor, block_size: int, *, p=None, out=None,
             m_out=None, v_out=None, seed: torch.Tensor | None = None):
    """One Adam step on block-quantized moments (see ``_adam8bit``); under ``torch.compile``
    an opaque op (``pgs::adam8bit_direction``, as ``lion8bit``)."""
    if _compiling():
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
    code_m, btab_m = _maps(True, dev)
    code_v, btab_v = _maps(False, dev)
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
            code_m, btab_m, code_v, btab_v, hp,
            sd if sd is not None else _no_seed(dev), n),
            dict(BLOCK=block_size, ROWS=ROWS, APPLY=apply, SR=seed is not None, **_split(),
                 num_warps=NUM_WARPS, **_fusion()))
    return out, m_out, v_out


def _fusion() -> dict:
    """``enable_fp_fusion`` as ``CONFIG.fp_fusion`` says, passed explicitly (Triton 3.9 warns
    that its default changes in 3.10, which would silently change the kernels' rounding)."""
    return {"enable_fp_fusion": CONFIG.fp_fusion}


def _split() -> dict:
    """The step kernels' ``SPLIT`` constexpr, passed only when not the default (True)."""
    return {} if CONFIG.split else {"SPLIT": False}


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
    """``kernel[grid](*args, **kw)``; with ``CONFIG.fast_launch`` (on a GPU), later launches with the
    same constexprs, options and specialisation call the compiled kernel's launcher directly,
    with the arguments Triton's own ``run`` would pass (every parameter, in order)."""
    if not CONFIG.fast_launch or interpreting():
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


def _lion8bit_eager(*args, **kw):
    """The in-place variant under ``torch.compile``: a graph break (Dynamo traces the
    ``disable`` call and runs the launcher eagerly).  Applied here, when compiling, rather
    than as a decorator: ``torch.compiler.disable`` imports ``torch._dynamo``, which imports
    Triton, and importing ``pgs`` must not (a CPU run would end with Triton's nanobind
    leak report)."""
    return torch.compiler.disable(_lion8bit)(*args, **kw)


def _adam8bit_eager(*args, **kw):
    """As :func:`_lion8bit_eager`."""
    return torch.compiler.disable(_adam8bit)(*args, **kw)


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


def quantize(x: torch.Tensor, signed: bool, block_size: int) -> Quantized8bit:
    """``quantize_blockwise(x, dynamic_map(signed), block_size)`` in one Triton kernel."""
    k = _module()
    btab = _maps(bool(signed), x.device)[1]
    x = x.contiguous()
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(max(1, -(-n // block_size)), dtype=torch.float32, device=x.device)
    k.quantize_kernel[_grid(n, block_size)](
        _flat(x), _flat(codes), absmax, btab, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed), num_warps=NUM_WARPS, **_fusion(),
    )
    return Quantized8bit(codes, absmax)


def dequantize(q: Quantized8bit, signed: bool, block_size: int) -> torch.Tensor:
    """``dequantize_blockwise(q, dynamic_map(signed), block_size)`` in one Triton kernel (fp32)."""
    k = _module()
    codes = q.codes.contiguous()
    code = _maps(bool(signed), codes.device)[0]
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    k.dequantize_kernel[_grid(n, block_size)](
        _flat(codes), q.absmax, _flat(out), code, n,
        BLOCK=block_size, ROWS=ROWS, SIGNED=bool(signed), num_warps=NUM_WARPS, **_fusion(),
    )
    return out
