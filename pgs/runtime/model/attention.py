"""Packed-document attention: each document attends only to itself, and no work is spent on
the pairs of tokens that belong to different documents.

transformers isolates the documents of a packed row (``position_ids`` restarting at 0, no
attention mask) by building a ``[B, 1, S, S]`` block-diagonal mask from the positions.  With
SDPA that mask turns the flash kernel off: the masked ("efficient") kernel then computes every
query-key pair of the row, including all the cross-document pairs it throws away.  With
documents of 256-2048 tokens in 4096-token rows that is ~3.5× the attention work a causal
kernel does on the documents alone.

``attn_implementation = "varlen"`` registers :func:`varlen_attention` with transformers under
the name :data:`HF_NAME`.  On CUDA it calls FlashAttention's variable-length kernel through
``torch.nn.attention.varlen.varlen_attn`` (Dao, "FlashAttention-2", arXiv 2307.08691): the
packed tokens are one ``[T, H, D]`` sequence cut at ``cu_seqlens``, each piece causal.
Grouped-query attention needs no copies (the kernel reads each KV head for its query heads).
Elsewhere (CPU, fp32, a torch without ``varlen_attn``) the same numbers come from SDPA with
the block-diagonal causal mask (the reference path the tests compare against).

The document boundaries are derived once per forward from ``position_ids`` by
:func:`packed_kwargs` (``pgs.runtime.documents.cu_seqlens``, whose definition of a boundary every
user of packed rows shares; one host synchronisation per step, for the number of documents) and
reach every layer as the ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k``
keyword arguments transformers forwards to its attention functions.  ``max_length`` is the
row width, a constant, so compiled layers do not recompile when the longest document changes
(the kernel's surplus blocks exit at once).  A call without those arguments derives them from
``position_ids`` itself, or treats the input as one causal sequence per row when there are none.

A decode step (one query token per row against a KV cache) goes to :func:`decode_attention`,
which reads grouped key/value heads in place.  Other calls that are not a packed training
forward (a padding mask, or keys longer than the queries: a prefill with a cache) go to
transformers' own SDPA function, with the mask transformers builds for them (``register`` also
registers a mask function, which builds SDPA's mask for those calls and none for a forward
without a padding mask and without a cache).

Not supported (refused with a message): attention dropout, sliding windows, logit softcapping.

Rows that hold one document each (``cu_seqlens`` are the row boundaries: unpacked rows, or a
forward without boundaries) run as dense causal SDPA instead, whose kernel PyTorch picks: on
compute capability 9.0 that is cuDNN's fused attention, faster than the varlen kernel per layer
with the same error against an fp32 reference (docs/performance.md, "Attention for unpacked
rows").  PyTorch's cuDNN variable-length entry point (``aten._cudnn_attention_forward`` with
``cum_seq``) is not used: on torch 2.11 it rebuilt its graph on every call and its backward
returned non-finite gradients.

On compute capability 9.0 the packed rows go to cuDNN's THD attention through
nvidia-cudnn-frontend's torch op (``cudnn.sdpa_torch``; the ``gpu`` extra installs it) when it is
installed: faster than FlashAttention-2 per packed layer, with the same output error against
fp32 and gradients within bf16 error (docs/performance.md measures both kernels and the whole
packed step).  cuDNN builds and caches one graph per document count (a fraction of a second
each), so the count is padded with zero-length documents
(outputs bit-identical; at least two, see :func:`pad_documents`) to a multiple of
:data:`CUDNN_DOC_BUCKET`: a few graphs per run instead of one per step.
``model.varlen_kernel`` picks the kernel: ``"auto"`` (cuDNN on compute capability 9.0 when the
frontend is installed, FlashAttention-2 otherwise), ``"cudnn"`` or ``"flash"``.  Head dims up
to 256 (multiples of 8) go to cuDNN; others to FlashAttention-2.  The choice is made once per
process and device, eagerly (``set_varlen_kernel``, which ``build_model`` calls), and recorded
for every layer: the frontend modules the op needs are imported then (the backward's own lazy
import, reached inside a compiled layer, can fail at the first backward), its ops are checked, and
a tiny forward + backward probes it (:func:`probe_kernel`).  Where any of that fails, ``"auto"``
falls back to FlashAttention-2 with one ``pgs: warning:`` line and ``"cudnn"`` is a
:class:`SpecError`.
"""

from __future__ import annotations

import inspect
import sys
from functools import lru_cache

import torch
from torch import Tensor

from pgs.errors import SpecError
from pgs.runtime.documents import cu_seqlens

#: What a spec writes (``model.attn_implementation``).
SPEC_NAME = "varlen"
#: The key under which transformers knows the function.
HF_NAME = "pgs_varlen"


#: ``_varlen_call``'s answer, found once (a list, not ``lru_cache``: the compiled layers call it,
#: and dynamo warns at every ``lru_cache``-wrapped call it traces).  It is first asked eagerly,
#: when the model is built (``varlen_available``), before any compiled layer reads it.
_VARLEN_CALL: list = []


def _varlen_call():
    """``(fn, causal_kwargs)`` for ``torch.nn.attention.varlen.varlen_attn``, or None.

    The causal switch is ``is_causal=True`` in the first releases that have the function and
    ``window_size=(-1, 0)`` in later ones; releases with ``enable_gqa`` get it on (equal heads are
    a group of one).
    """
    if not _VARLEN_CALL:
        _VARLEN_CALL.append(_find_varlen_call())
    return _VARLEN_CALL[0]


def varlen_call():
    """``(fn, causal_kwargs)`` of ``torch.nn.attention.varlen.varlen_attn`` where this torch has it,
    else None (what the chunk attention of ``pgs.runtime.model.seco`` calls too)."""
    return _varlen_call()


def _find_varlen_call():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    if "enable_gqa" in params:  # later releases ask for grouped-query heads explicitly
        causal["enable_gqa"] = True
    return varlen_attn, causal


#: What ``model.varlen_kernel`` may say.
VARLEN_KERNELS = ("auto", "cudnn", "flash")
#: cuDNN's graphs are cached per document count: counts are padded with zero-length documents
#: to a multiple of this, so a run builds a few graphs instead of one per step.  Each padded
#: document costs a little attention time (docs/performance.md); a bucket of 16 let a step
#: need a single padding document, whose size dynamo specialised, recompiling every layer
#: (``pad_documents``'s ``minimum`` avoids that).
CUDNN_DOC_BUCKET = 64
#: The compute capabilities where ``"auto"`` picks cuDNN (those it was measured on: docs/performance.md).
CUDNN_AUTO_CAPABILITIES = ((9, 0),)
_kernel = "auto"
#: (choice, CUDA device index) -> "cudnn" or "flash": filled outside the compiled layers
#: (``set_varlen_kernel``, ``hf_implementation``, ``packed_kwargs``) so that tracing reads a dict.
_resolved: dict[tuple[str, int], str] = {}


#: The nvidia-cudnn-frontend modules behind ``cudnn.sdpa_torch``: the op itself (``sdpa_fwd``,
#: ``sdpa_bwd`` and their autograd), the varlen metadata it prepares, and the packed-LSE repadding
#: that its backward imports lazily (``torch.ops.cudnn._packed_lse_to_padded``).  Left to that
#: lazy import inside a compiled layer's backward, a fresh process can fail at its first backward
#: (``'_OpNamespace' 'cudnn' object has no attribute '_packed_lse_to_padded'``; how often it did
#: is in docs/performance.md): all of them are imported eagerly when the kernel is resolved,
#: outside any compiled region.
CUDNN_MODULES = ("cudnn.sdpa.varlen_metadata", "cudnn.sdpa.packed_lse", "cudnn.sdpa.fwd.torch_op")
#: The ``torch.ops.cudnn`` ops those modules register and the forward + backward call.
CUDNN_OPS = ("sdpa_fwd", "sdpa_bwd", "_packed_lse_to_padded")
#: The loaded op (``cudnn.sdpa_torch``) once resolved: what the compiled layers call (a global,
#: not a cached loader, so that tracing never reaches an import).
_cudnn_fn = None
#: CUDA device index -> why cuDNN's op failed its first forward + backward there (None: it passed).
_probed: dict[int, str | None] = {}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."


@lru_cache(maxsize=1)
def _cudnn_load() -> tuple:
    """``(op, installed, why)``: nvidia-cudnn-frontend's THD SDPA op (``cudnn.sdpa_torch``) with
    every module it needs imported (:data:`CUDNN_MODULES`) and its ops registered
    (:data:`CUDNN_OPS`), else None and why (``installed``: whether the package is there at all)."""
    global _cudnn_fn
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("cudnn") is None:
            return None, False, "nvidia-cudnn-frontend is not installed"
    except (ImportError, ValueError) as err:
        return None, False, _first_line(err)
    try:
        import cudnn

        for name in CUDNN_MODULES:
            importlib.import_module(name)
        missing = [op for op in CUDNN_OPS if not hasattr(torch.ops.cudnn, op)]
        if missing:
            return None, True, f"its import registered no torch.ops.cudnn.{', '.join(missing)}"
        fn = cudnn.sdpa_torch
    except Exception as err:  # noqa: BLE001 - a broken or partial install: not used
        return None, True, f"its SDPA op did not load ({_first_line(err)})"
    _cudnn_fn = fn
    return fn, True, None


def _cudnn_thd():
    """nvidia-cudnn-frontend's THD SDPA op (``cudnn.sdpa_torch``), or None when it is not
    installed or does not load (:func:`_cudnn_load` says why)."""
    return _cudnn_load()[0]


def set_varlen_kernel(name: str, device: torch.device | str | None = None, *, prime: bool = True) -> None:
    """Choose the packed-attention kernel (``model.varlen_kernel``) for this process and, with
    ``prime``, resolve it now for ``device`` (a CUDA device; by default the current one): the
    imports and the first-use probe run here, outside any compiled layer.  (``build_model``
    leaves that to :func:`hf_implementation`, which resolves it only for a model that uses it.)

    ``"cudnn"`` where CUDA is present but the frontend is not installed, does not load, or fails
    its first forward + backward (:func:`_cudnn_probe`) is a :class:`SpecError`; ``"auto"`` then
    falls back to FlashAttention-2 (with one warning line when the frontend is installed).  On a
    machine without CUDA every choice runs the reference path.
    """
    global _kernel
    if name not in VARLEN_KERNELS:
        raise SpecError(f"model.varlen_kernel: expected one of {', '.join(VARLEN_KERNELS)}, got {name!r}")
    if name == "cudnn" and torch.cuda.is_available() and _cudnn_thd() is None:
        _, installed, why = _cudnn_load()
        if not installed or why is None:
            raise SpecError("model.varlen_kernel: \"cudnn\" needs nvidia-cudnn-frontend (pip install "
                            "\"nvidia-cudnn-frontend>=1.32\", or pgs's gpu extra); use \"auto\" or \"flash\"")
        raise SpecError(f"model.varlen_kernel: \"cudnn\": nvidia-cudnn-frontend is installed but {why}; "
                        "use \"auto\" or \"flash\"")
    _kernel = name
    if prime:
        _prime(device)


def _cudnn_probe(index: int) -> str | None:
    """Why cuDNN's THD op fails its first forward + backward on CUDA device ``index``
    (:func:`probe_kernel` on :func:`_cudnn_varlen`), or None; asked once per device.

    Run at resolution time, outside any compiled layer: a first-use failure (an op the backward
    cannot find, a graph cuDNN will not build) then costs a fallback instead of the run.  Its
    graphs are not ones a run reuses: a one-off cost per process (docs/performance.md).
    """
    if index not in _probed:
        try:
            with torch.cuda.device(index):
                _probed[index] = probe_kernel(_cudnn_varlen, torch.device("cuda", index))
        except Exception as err:  # noqa: BLE001 - a device that cannot even be selected
            _probed[index] = _first_line(err)
    return _probed[index]


def probe_kernel(fn, device: torch.device) -> str | None:
    """Why the packed kernel ``fn(q, k, v, cu_seqlens, longest, scale)`` fails a tiny eager causal
    forward + backward on ``device`` (three documents in 256 tokens, 4 query and 2 key/value heads
    of 128, bf16), against :func:`_reference` in fp32; None when it passes (outputs and gradients
    finite and within bf16 tolerance: 2e-2 for the output, 5e-2 for the gradients)."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(256, h, 128, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
                       for h in (4, 2, 2))
            cu = torch.tensor([0, 100, 160, 256], dtype=torch.int32, device=device)
            out = fn(q, k, v, cu, 256, None)
            go = torch.randn(out.shape, generator=g, device=device, dtype=out.dtype)
            got = torch.autograd.grad(out, (q, k, v), go)
            ref = _reference(q.float(), k.float(), v.float(), cu, 1, 256, None)
            want = torch.autograd.grad(ref, (q, k, v), go.float())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - whatever the first use raises is the verdict
        return _first_line(err)
    checks = (("output", out, ref, 2e-2),) + tuple(zip(("dq", "dk", "dv"), got, want, (5e-2,) * 3))
    for name, a, b, tol in checks:
        a, b = a.detach().float(), b.detach().float()
        if a.shape != b.shape:
            return f"its {name} has shape {tuple(a.shape)}, not {tuple(b.shape)}"
        if not bool(torch.isfinite(a).all()):
            return f"its {name} is not finite"
        excess = float(((a - b).abs() - tol * b.abs()).max())  # assert_close's atol = rtol = tol
        if excess > tol:
            return f"its {name} is off the reference by {excess:.3g} beyond bf16 tolerance"
    return None


def _warn(message: str) -> None:
    print(f"pgs: warning: {message}", file=sys.stderr, flush=True)


def _choose(kernel: str, index: int) -> str:
    """``"cudnn"`` or ``"flash"`` for packed rows on CUDA device ``index`` under ``kernel``."""
    if kernel == "flash":
        return "flash"
    if kernel == "auto" and torch.cuda.get_device_capability(index) not in CUDNN_AUTO_CAPABILITIES:
        return "flash"
    if _cudnn_thd() is None:
        _, installed, why = _cudnn_load()
        if kernel == "cudnn":
            raise SpecError(f"model.varlen_kernel: \"cudnn\" cannot run on cuda:{index} "
                            f"({why or 'nvidia-cudnn-frontend is not installed'}); "
                            "use \"auto\" or \"flash\"")
        if installed and why is not None:  # installed but broken: say so; absent: FA-2 is the plan
            _warn(f"cuDNN packed attention did not load ({why}); packed rows use FlashAttention-2")
        return "flash"
    if torch.compiler.is_compiling():  # no kernels can run while tracing (resolved eagerly before)
        return "cudnn"
    why = _cudnn_probe(index)
    if why is None:
        return "cudnn"
    if kernel == "cudnn":
        raise SpecError(f"model.varlen_kernel: \"cudnn\" failed its first forward + backward on cuda:{index} "
                        f"({why}); use \"auto\" or \"flash\"")
    _warn(f"cuDNN packed attention failed its first forward + backward on cuda:{index} ({why}); packed rows "
          "use FlashAttention-2 (model.varlen_kernel = \"flash\" chooses it without this warning)")
    return "flash"


def _resolve(index: int) -> str:
    """The kernel packed rows on CUDA device ``index`` go to under the current choice (decided
    once per choice and device, and recorded: every layer then reads the same answer)."""
    choice = _resolved.get((_kernel, index))
    if choice is None:
        choice = _resolved[(_kernel, index)] = _choose(_kernel, index)
    return choice


def _prime(device: torch.device | str | None = None) -> None:
    """Resolve the kernel of CUDA ``device`` (default: the current one) now, outside any compiled
    layer; nothing for a device that is not CUDA."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return
    if torch.cuda.is_available():
        try:
            index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
            torch.cuda.get_device_capability(index)
        except (RuntimeError, AssertionError):  # no usable device after all: resolved at first use
            return
        _resolve(index)


def pad_documents(cu: Tensor, multiple: int, minimum: int = 0) -> Tensor:
    """``cu_seqlens`` with at least ``minimum`` zero-length documents appended (the last boundary
    repeated), and then more until the count of documents is a multiple of ``multiple``.

    Under torch.compile the number appended is symbolic, and dynamo specialises a size of 0 or
    1 (a guard that recompiles the layer when a step's count needs 0 or 1 more documents after
    others needed more: a recompile of every compiled layer, seconds each); ``minimum=2``
    keeps it out of that range.
    """
    return torch.cat([cu, cu[-1:].expand((-(cu.shape[0] - 1 + minimum)) % multiple + minimum)])


def _cudnn_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None) -> Tensor:
    """Causal attention within each document of ``cu`` through cuDNN's THD kernel."""
    cu = pad_documents(cu, CUDNN_DOC_BUCKET, minimum=2)
    fn = _cudnn_fn or _cudnn_thd()  # the global once loaded: compiled layers never reach the loader
    return fn(q, k, v, scale=scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
              max_seqlen_q=longest, max_seqlen_kv=longest, return_lse=True)[0]


def varlen_available(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> bool:
    """True when the fused kernel path runs for tensors on ``device`` in ``dtype``."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return False
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.is_available() and _varlen_call() is not None


def packed_kwargs(position_ids: Tensor) -> dict:
    """The keyword arguments that carry the document boundaries to :func:`varlen_attention`."""
    if position_ids.is_cuda:  # the kernel choice for this device, before any compiled layer reads it
        _resolve(position_ids.device.index)
    return boundary_kwargs(position_ids)


def boundary_kwargs(position_ids: Tensor) -> dict:
    """The document boundaries of packed rows as transformers' varlen keyword arguments
    (``cu_seq_lens_q``/``_k`` over the flattened rows, ``max_length_q``/``_k`` the row width),
    which reach every layer: the packed-attention kernel and linear-attention layers
    (``pgs.runtime.model.linear_attention``) read them."""
    cu = cu_seqlens(position_ids)
    width = int(position_ids.shape[-1])
    try:  # one compiled graph whatever the number of documents
        torch._dynamo.maybe_mark_dynamic(cu, 0)
    except Exception:  # noqa: BLE001 - only an optimisation
        pass
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": width, "max_length_k": width}


def _reference(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, batch: int, width: int, scale: float | None) -> Tensor:
    """SDPA with the block-diagonal causal mask; q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` → ``[T, Hq, D]``."""
    total, hq, d = q.shape
    hkv = k.shape[1]
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    doc = doc.view(batch, width)
    idx = torch.arange(width, device=q.device)
    mask = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    qb = q.view(batch, width, hq, d).transpose(1, 2)
    kb = k.view(batch, width, hkv, d).transpose(1, 2)
    vb = v.view(batch, width, hkv, d).transpose(1, 2)
    if hkv != hq:
        kb = kb.repeat_interleave(hq // hkv, dim=1)
        vb = vb.repeat_interleave(hq // hkv, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(total, hq, d)


def varlen_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: ``query`` ``[B, Hq, S, D]``, ``key``/``value``
    ``[B, Hkv, S, D]`` → (``[B, S, Hq, D]``, None).  Causal within each packed document."""
    if dropout:
        raise SpecError("model.attn_implementation \"varlen\": attention dropout is not supported "
                        "(set the model's attention_dropout to 0)")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise SpecError("model.attn_implementation \"varlen\": sliding-window and softcapped attention are "
                        "not supported; use \"sdpa\"")
    batch, hq, width, d = query.shape
    hkv = key.shape[1]
    dv = value.shape[-1]
    if dv != d:
        # multi-head latent attention (DeepSeek-V3: keys of 192, values of 128): the kernels take
        # one head dim, so the narrower side is padded with zeros (values: zero output columns,
        # cut off again; queries and keys: the same dot products, the scale fixed first), as
        # transformers' flash path does; exact
        scaling = d ** -0.5 if scaling is None else scaling
        pad = torch.nn.functional.pad
        if dv < d:
            out, _ = varlen_attention(module, query, key, pad(value, (0, d - dv)), attention_mask, scaling, dropout,
                                      **kwargs)
            return out[..., :dv], None
        return varlen_attention(module, pad(query, (0, dv - d)), pad(key, (0, dv - d)), value, attention_mask,
                                scaling, dropout, **kwargs)
    if width == 1 and _decode_suits(key, attention_mask, kwargs):  # one new token per row against a cache
        return decode_attention(query, key, value, attention_mask, scaling), None
    if attention_mask is not None or key.shape[2] != width:  # padding or a cache: not a packed forward
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        rest = {k: v for k, v in kwargs.items() if k not in _PACKED_KEYS}
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **rest)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            cu = cu_seqlens(position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids)
        else:
            cu = torch.arange(0, (batch + 1) * width, width, device=query.device, dtype=torch.int32)
    q = query.transpose(1, 2).reshape(batch * width, hq, d)
    k = key.transpose(1, 2).reshape(batch * width, hkv, d)
    v = value.transpose(1, 2).reshape(batch * width, hkv, d)
    call = _varlen_call() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
    if call is not None and cu.shape[0] == batch + 1:
        # one document per row (every row starts one, so no more boundaries than rows): dense causal
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=hkv != hq)
        return out.transpose(1, 2), None
    if call is not None:
        longest = int(kwargs.get("max_length_q") or width)
        if _resolve(query.device.index) == "cudnn" and d % 8 == 0 and d <= 256:
            out = _cudnn_varlen(q, k, v, cu, longest, scaling)
        else:
            fn, causal = call
            out = fn(q, k, v, cu, cu, longest, longest, scale=scaling, **causal)
    else:
        out = _reference(q, k, v, cu.to(query.device), batch, width, scaling)
    return out.view(batch, width, hq, d), None


_PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _decode_suits(key: Tensor, mask: Tensor | None, kwargs: dict) -> bool:
    """A decode step :func:`decode_attention` computes as transformers' SDPA path would: a
    key-padding mask of one query row (``[B, 1, 1, W]``) or none, and no attention sinks."""
    if "s_aux" in kwargs or "sinks" in kwargs:
        return False
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
                            and mask.shape[3] == key.shape[2])


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                     scaling: float | None) -> Tensor:
    """One query token per row against the KV cache, grouped-query heads read in place:
    ``query`` ``[B, Hq, 1, D]``, ``key``/``value`` ``[B, Hkv, W, D]``, ``mask`` ``[B, 1, 1, W]``
    (True or 0 where a row may attend) or None → ``[B, 1, Hq, D]``.

    The ``G = Hq / Hkv`` query heads that share a key/value head (heads ``j·G … j·G+G−1`` read
    head ``j``, transformers' ``repeat_kv`` order) become ``G`` query rows of that head, so one
    SDPA call reads each cached key and value once (Ainslie et al., arXiv 2305.13245, for the
    grouping).  transformers' SDPA path instead copies the whole cache ``G`` times per layer and
    step (``repeat_kv``): with a mask, SDPA's kernels do not take grouped heads.  The rows of
    a group are the same position, so the row's key mask applies to each unchanged."""
    batch, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(batch, hkv, hq // hkv, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, hq, d)


def _mask(*args, **kwargs):
    """transformers' mask function for ``HF_NAME``: none for a forward without a padding mask
    and without a cache (the kernel isolates the documents itself), SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    full = (kwargs.get("attention_mask") is None and not kwargs.get("kv_offset") and not kwargs.get("q_offset")
            and q_length is not None and q_length == kwargs.get("kv_length"))
    return None if full else sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make ``attn_implementation=HF_NAME`` known to transformers (the attention function and
    its mask function); returns that name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_NAME, varlen_attention)
    AttentionMaskInterface.register(HF_NAME, _mask)
    return HF_NAME


AUTO = "auto"


def varlen_suits(config) -> str | None:
    """Why ``config``'s attention cannot take the varlen path (a sentence), or None."""
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        layer_types = getattr(c, "layer_types", None)
        if any(t != "full_attention" for t in (layer_types or [])):
            return "its layer_types are not all full attention"
        # a family without layer_types (Mistral) slides whenever it names a window, unless a
        # use_sliding_window switch (Qwen2) is off
        sliding = (not layer_types and getattr(c, "sliding_window", None) is not None
                   and getattr(c, "use_sliding_window", True) is not False)
        if sliding or getattr(c, "use_sliding_window", False) or getattr(c, "attn_logit_softcapping", None):
            return "it uses sliding-window or softcapped attention"
        if float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0:
            return "its attention_dropout is not 0"
    return None


def hf_implementation(name: str | None, config=None, device: torch.device | str | None = None) -> str | None:
    """The name to hand transformers for a spec's ``attn_implementation`` (registers ours).

    ``"auto"`` (the spec's default): ``"varlen"`` where its kernel runs (CUDA, a torch with
    ``varlen_attn``) and ``config`` (when given) has plain full attention without dropout;
    ``"sdpa"`` otherwise.  For ``"varlen"`` the packed kernel is resolved now for ``device``
    (a CUDA device; by default the current one), see :func:`set_varlen_kernel`.
    """
    if name == AUTO:
        name = SPEC_NAME if varlen_available() and (config is None or varlen_suits(config) is None) else "sdpa"
        if name == "sdpa" and not supports_sdpa(config):
            name = "eager"  # the family's own attention (GPT-OSS: sinks) has no SDPA path in transformers
    elif name == "sdpa" and not supports_sdpa(config):
        raise SpecError(f"model.attn_implementation: \"sdpa\": {causal_lm_class(config).__name__} has no SDPA "
                        "attention in transformers (its attention has parts SDPA cannot run, e.g. sinks); "
                        "use \"auto\" or \"eager\"")
    if name == SPEC_NAME:
        _prime(device)
        return register()
    return name


def causal_lm_class(config):
    """The class ``AutoModelForCausalLM`` builds for ``config`` (None: not known, e.g. remote code)."""
    if config is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def supports_sdpa(config) -> bool:
    """Whether transformers runs ``config``'s causal LM through SDPA (True where the class is
    not known: transformers itself then says)."""
    cls = causal_lm_class(config)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


#: Families whose transformers forward (5.25) builds its attention masks without
#: ``position_ids``: from a packed row it builds one causal mask over every document, so they
#: would see each other.  ``document_masks`` builds their masks from the positions instead.
MASKS_WITHOUT_POSITIONS = ("gpt_oss",)


def document_masks(model, position_ids: Tensor, dtype: torch.dtype) -> dict | None:
    """``{"attention_mask": {layer type: mask}}``, the masks of each layer type built by
    transformers' own mask functions from the restarted ``position_ids`` (block-diagonal,
    sliding windows included), for a model of ``MASKS_WITHOUT_POSITIONS``; None for the others
    (their forward builds them so itself).  Such a forward takes a prepared dict of masks as
    ``attention_mask`` (what ``generate`` hands it)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MASKS_WITHOUT_POSITIONS:
        return None
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    shape = torch.empty(*position_ids.shape, 0, dtype=dtype, device=position_ids.device)
    args = dict(config=config, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**args)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
    return {"attention_mask": masks}


def uses_varlen(model) -> bool:
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is not None and getattr(c, "_attn_implementation", None) == HF_NAME:
            return True
    return False
