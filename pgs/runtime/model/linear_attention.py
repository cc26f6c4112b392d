"""Packed documents through linear-attention layers: each document starts from a zero state.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid) interleave attention layers with
Gated DeltaNet layers (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", arXiv 2412.06464).
Such a layer mixes tokens twice: a depthwise causal convolution over the last ``K`` inputs
(``K = linear_conv_kernel_dim``), then the gated delta rule, a recurrence over a matrix state

    S_t = S_{t-1} · α_t (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,        o_t = S_t q_t

(``α_t = exp(g_t)`` the decay, ``β_t`` the write strength).  In a packed row both read across
a document boundary: the convolution window of a document's first ``K − 1`` tokens reaches into
the previous document, and ``S`` carries the previous document's keys and values.  The
restarted ``position_ids`` that isolate attention layers (``pgs.runtime.data.isolation``) do
not reach these layers, and transformers' own PyTorch path takes no boundaries at all.

:func:`isolate` gives every Gated DeltaNet layer of a model a forward that takes the documents'
boundaries (``cu_seq_lens_q``: ``[0, l1, l1+l2, …, B·S]`` over the flattened ``[B, S]`` rows, the
same boundaries the packed-attention kernels take, see ``pgs.runtime.model.attention``) and
restarts both the convolution window and the recurrent state at each:

* **fused** (CUDA, with flash-linear-attention installed): the rows become one ``[1, B·S]``
  sequence and the layer's computation runs once, re-stated here from its parameters
  (:func:`_fused`): the input projections, fla's causal convolution and fla's
  ``chunk_gated_delta_rule``, each given the boundaries as ``cu_seqlens``, then the layer's own
  gated norm and output projection.  fla is pure Python and Triton, so nothing else needs
  building (transformers' own route to fused kernels also wants causal-conv1d, a compiled
  extension); its kernels run on CUDA only.
* **per document** (everywhere else): the layer's transformers forward runs on each document's
  slice alone, and the outputs are concatenated.  Each document then goes through exactly the
  computation it gets as a sequence of its own, so the result is the unpacked result; the cost
  is one call per document and layer.

A forward without boundaries (unpacked rows, generation with a cache, a padding mask) runs the
layer's transformers forward unchanged.  Only the layer classes in :data:`GATED_DELTANET_CLASSES`
are taken: their forward signature and kernel dispatch are the ones this module relies on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: transformers' Gated DeltaNet layer classes whose forward this module wraps (all take
#: ``(hidden_states [B, S, D], cache, attention_mask, **kwargs)`` and return ``[B, S, D]``).
GATED_DELTANET_CLASSES = frozenset({
    "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "OlmoHybridGatedDeltaNet",
})
#: The model types (outer or text config) whose linear-attention layers are of those classes.
ISOLATED_MODEL_TYPES = frozenset({
    "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid",
})
#: The ``layer_types`` entry of those layers.
LINEAR_LAYER_TYPE = "linear_attention"
#: The keyword arguments that carry the boundaries (transformers' flash-attention names).
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Attribute that marks a layer whose forward :func:`isolate` replaced.
_MARK = "_pgs_packed_forward"
#: Attribute that marks a model whose linear-attention layers all have it.
_WANTS = "_pgs_linear_boundaries"


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet layers of ``model`` (any class whose name ends in ``GatedDeltaNet``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def unknown_linear_layers(model: nn.Module) -> list[str]:
    """Names of the Gated DeltaNet classes in ``model`` this module does not know (sorted)."""
    return sorted({type(m).__name__ for m in linear_layers(model)} - GATED_DELTANET_CLASSES)


def isolate(model: nn.Module) -> int:
    """Give each known Gated DeltaNet layer of ``model`` the boundary-aware forward; returns how
    many layers have it.  Idempotent; the parameters and their names are untouched.  When every
    linear-attention layer of the model has it, the model is marked to receive the boundaries
    (:func:`wants_boundaries`): a layer of another class would fail on them, or ignore them."""
    count = 0
    for layer in linear_layers(model):
        if type(layer).__name__ not in GATED_DELTANET_CLASSES:
            continue
        if not getattr(layer, _MARK, False):
            if not _PER_DOCUMENT:  # made here, not at import: torch.compiler.disable imports dynamo and Triton
                _PER_DOCUMENT.append(torch.compiler.disable(_per_document))
            layer.forward = types.MethodType(packed_forward, layer)
            setattr(layer, _MARK, True)
        count += 1
    if count and isolated(model):
        setattr(model, _WANTS, True)
        fused_available()  # the kernels looked for now, not inside a compiled layer
    return count


#: :func:`_per_document` left out of ``torch.compile``'s graphs (a Python loop over a
#: data-dependent number of documents); wrapped by :func:`isolate` when it installs the forward.
_PER_DOCUMENT: list = []


def isolated(model: nn.Module) -> bool:
    """Does every Gated DeltaNet layer of ``model`` restart at document boundaries?"""
    return all(getattr(layer, _MARK, False) for layer in linear_layers(model))


def wants_boundaries(model: nn.Module) -> bool:
    """Should a packed forward of ``model`` carry the document boundaries (set by :func:`isolate`)?"""
    return bool(getattr(model, _WANTS, False))


def fused_available() -> bool:
    """Are flash-linear-attention's ``chunk_gated_delta_rule`` and ``causal_conv1d`` importable?"""
    return bool(_kernels())


#: fla's two kernels, ``(causal_conv1d, chunk_gated_delta_rule)``, or ``()`` without fla (found once).
_KERNELS: list = []


def _kernels() -> tuple:
    if not _KERNELS:
        try:
            rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
            conv = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
            # outside torch.compile's graphs (compiled layers compile what is around them):
            # Triton kernels behind fla's own autotuner and autograd functions
            found = (torch.compiler.disable(conv), torch.compiler.disable(rule)) if callable(rule) and callable(
                conv) else ()
        except Exception:  # noqa: BLE001 - missing or broken: the per-document path runs
            found = ()
        _KERNELS.append(found)
    return _KERNELS[0]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def backward_refusal(device: torch.device) -> str | None:
    """Why flash-linear-attention, where installed, cannot train a Gated DeltaNet layer on
    ``device``, or None.

    fla refuses the backward of its gated chunk kernels (``chunk_bwd_dqkwg``) on Hopper GPUs
    with Triton 3.4 up to 3.7.0, whose compiler produces wrong gradients there (fla's issue
    640), unless its TileLang backend (the ``tilelang`` package and a usable ``nvcc``) takes the
    kernel.  transformers dispatches its Gated DeltaNet layers to the same fla kernels whenever
    fla is installed, so a hybrid model's first backward would end in that error after the
    model was built; asked before, the run stops with one line instead.
    """
    if device.type != "cuda" or not fused_available():
        return None
    try:
        from fla.backends import TileLangBackend
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla release: it decides for itself
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1) or TileLangBackend.is_available():
        return None
    return (f"flash-linear-attention refuses the Gated DeltaNet backward on this Hopper GPU with Triton "
            f"{_version('triton')} (that Triton compiles its gated kernel to wrong gradients): install tilelang "
            "(pip install tilelang; it needs nvcc) or Triton >= 3.7.1, or uninstall flash-linear-attention to "
            "train with transformers' PyTorch recurrence, one packed document at a time (slower)")


def path(device: torch.device) -> str:
    """The path packed rows on ``device`` take: ``"fused"`` or ``"per_document"``."""
    return "fused" if device.type == "cuda" and fused_available() else "per_document"


def packed_forward(self, hidden_states: Tensor, **kwargs):
    """A Gated DeltaNet layer's forward that restarts at each document of ``kwargs["cu_seq_lens_q"]``.

    Without boundaries, with a cache (``cache``, or ``cache_params`` in older transformers) or
    with a padding mask: the transformers forward, called as it was.
    """
    cu = kwargs.get("cu_seq_lens_q")
    original = type(self).forward
    if cu is None or any(kwargs.get(k) is not None for k in ("cache", "cache_params", "attention_mask")):
        return original(self, hidden_states, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KEYS and k not in _EMPTY}
    if path(hidden_states.device) == "fused" and fusable(self):
        return _fused(self, hidden_states, cu, _kernels())
    return _PER_DOCUMENT[0](self, original, hidden_states, cu, rest)


#: Keyword arguments a packed call hands on only when they are given (all None there).
_EMPTY = ("cache", "cache_params", "attention_mask")


def fusable(layer: nn.Module) -> bool:
    """Does :func:`_fused` know ``layer``'s computation (its class's projections, and an
    activation fla's convolution applies)?"""
    return type(layer).__name__ in _INPUTS and getattr(layer, "activation", None) in ("silu", "swish")


def _qwen3_5_inputs(layer, x: Tensor):
    """Qwen3.5 (dense and MoE): one projection for q, k, v, one each for the gate z, b and a."""
    z = layer.in_proj_z(x)
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x).sigmoid(), layer.in_proj_a(x)


def _qwen3_next_inputs(layer, x: Tensor):
    """Qwen3-Next: q, k, v, z interleaved per key head in one projection, b and a in another."""
    query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)], dim=-1)
    return mixed, z, b.sigmoid(), a


def _olmo_hybrid_inputs(layer, x: Tensor):
    """OLMo-Hybrid: separate q, k, v, a, b and gate projections; β ∈ [0, 2) with negative eigenvalues."""
    mixed = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    beta = layer.b_proj(x).sigmoid()
    if layer.allow_neg_eigval:
        beta = beta * 2.0
    return mixed, layer.g_proj(x), beta, layer.a_proj(x)


#: Per class: ``inputs(layer, x [1, T, D]) -> (qkv before the convolution [1, T, 2·key_dim +
#: value_dim], output gate [1, T, value_dim or HV×d_v], β [1, T, HV], a [1, T, HV])``, and the
#: names of the gated norm and the output projection: what each class's transformers forward
#: computes around its two token mixers.
_INPUTS = {
    "Qwen3_5GatedDeltaNet": (_qwen3_5_inputs, "norm", "out_proj"),
    "Qwen3_5MoeGatedDeltaNet": (_qwen3_5_inputs, "norm", "out_proj"),
    "Qwen3NextGatedDeltaNet": (_qwen3_next_inputs, "norm", "out_proj"),
    "OlmoHybridGatedDeltaNet": (_olmo_hybrid_inputs, "o_norm", "o_proj"),
}


def _fused(layer, hidden_states: Tensor, cu: Tensor, kernels: tuple) -> Tensor:
    """The layer's forward over the rows as one sequence, both token mixers told the boundaries.

    With ``mixed = conv(W_qkv x)`` split into q, k, v and ``g = −exp(A_log)·softplus(a + dt_bias)``
    (the log decay), ``o = out(norm(GDR(q, k, v, g, β), gate))``: the transformers forward of the
    four classes, whose convolution and delta rule here each restart at every ``cu`` boundary.
    ``kernels``: ``(causal_conv1d, chunk_gated_delta_rule)`` with fla's signatures."""
    conv, rule = kernels
    inputs, norm, out = _INPUTS[type(layer).__name__]
    batch, width, dim = hidden_states.shape
    total = batch * width
    cu = cu.to(device=hidden_states.device, dtype=torch.long)
    mixed, gate, beta, a = inputs(layer, hidden_states.reshape(1, total, dim))
    weight = layer.conv1d.weight.squeeze(1)  # [channels, kernel]
    mixed, _ = conv(mixed, weight, layer.conv1d.bias, activation=layer.activation, cu_seqlens=cu)
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(1, total, -1, layer.head_k_dim)
    key = key.reshape(1, total, -1, layer.head_k_dim)
    value = value.reshape(1, total, -1, layer.head_v_dim)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    core, _ = rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    core = getattr(layer, norm)(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return getattr(layer, out)(core.reshape(batch, width, -1))


def _per_document(layer, original, hidden_states: Tensor, cu: Tensor, rest: dict) -> Tensor:
    """The layer's own forward on each document alone, the outputs laid back in place."""
    batch, width, dim = hidden_states.shape
    flat = hidden_states.reshape(batch * width, dim)
    bounds = cu.tolist()
    parts = [original(layer, flat[start:stop].unsqueeze(0), **rest)[0]
             for start, stop in zip(bounds, bounds[1:]) if stop > start]
    return torch.cat(parts).view(batch, width, -1)
