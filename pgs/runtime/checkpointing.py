"""Activation checkpointing, per-layer ``torch.compile`` and optional Liger kernels for HF decoders.

All three act on the decoder layers of a ``transformers`` causal LM (``model.model.layers``)
in place and keep every parameter's name, so state dicts and checkpoints are unchanged.

Activation checkpointing (Chen et al., "Training Deep Nets with Sublinear Memory Cost",
arXiv 1604.06174) trades compute for memory: a checkpointed layer keeps only its input for
backward and recomputes the rest when backward reaches it.  Policies:

- ``"none"``: every activation is kept.
- ``"full"``: each checkpointed layer keeps only its input (≈ 2·h bytes per token in bf16)
  and recomputes its whole forward in backward (≈ +1 forward, ~33% more compute).
- ``"selective"``: per-op policy (Korthikanti et al., "Reducing Activation Recomputation in
  Large Transformer Models", arXiv 2205.05198): the outputs of matmuls and of attention are
  saved, the cheap elementwise ops (norms, rotary, SiLU, products) are recomputed.  Costs
  far less recompute than ``full`` and keeps a good part of its saving.

``every=k`` checkpoints layers 0, k, 2k, … only (layer-selective checkpointing); the others
keep everything.  Both use ``torch.utils.checkpoint`` with ``use_reentrant=False``, which is
what gradient release needs (its hooks fire inside the one backward) and what
``torch.compile`` traces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pgs.errors import InvalidArgument, MissingExtra

POLICIES = ("none", "full", "selective")
_ORIGINAL = "_pgs_forward_before_checkpointing"


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a HF causal LM (``model.model.layers`` and the usual variants)."""
    for path in ("model.layers", "model.language_model.layers", "model.decoder.layers", "layers",
                 "transformer.h", "base_model.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    raise InvalidArgument(f"{type(model).__name__}: no decoder layers found (looked for model.layers, "
                          "model.language_model.layers, transformer.h); checkpointing and compile_layers "
                          "need a transformers decoder")


def _selective_ops() -> list:
    """The ops whose outputs the selective policy saves: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward"]
    out = []
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None and hasattr(packet, "default"):
            out.append(packet.default)
    return out


def selective_context():
    """A ``context_fn`` for ``torch.utils.checkpoint``: save matmul/attention outputs, recompute the rest."""
    ops = set(_selective_ops())

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(layer: torch.nn.Module, forward, context_fn):
    def run(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # the recompute would write a KV cache a second time (and a selective policy would then
        # find different ops in forward and recompute): a checkpointed layer runs without one
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    run._pgs_inner = forward
    run._pgs_context = context_fn
    run._pgs_inner_compiled = False
    return run


def remove_activation_checkpointing(model) -> None:
    """Undo ``apply_activation_checkpointing`` (restores each layer's own forward)."""
    for layer in decoder_layers(model):
        if _ORIGINAL in layer.__dict__:
            original = layer.__dict__.pop(_ORIGINAL)
            wrapper = layer.__dict__.get("forward")
            if getattr(wrapper, "_pgs_inner_compiled", False):
                layer.forward = wrapper._pgs_inner  # keep what compile_layers did
            elif original is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = original


def apply_activation_checkpointing(model, policy: str = "full", every: int = 1) -> list[int]:
    """Checkpoint the decoder layers of ``model`` in place; returns the checkpointed indices.

    Args:
        model: a HF causal LM (its ``model.layers``).
        policy: ``"none"``, ``"full"`` (recompute the whole layer) or ``"selective"`` (save
            matmul and attention outputs, recompute elementwise ops).
        every: checkpoint layers ``i`` with ``i % every == 0`` (1: all of them).

    Example::

        apply_activation_checkpointing(model, "full")          # every layer
        apply_activation_checkpointing(model, "full", every=2) # half of them

    Calling it again replaces the previous policy.  Use ``use_reentrant=False`` semantics
    throughout; loss and gradients equal the unchecked model's (tests/test_checkpointing.py).
    """
    if policy not in POLICIES:
        raise InvalidArgument(f"apply_activation_checkpointing: policy={policy!r} is not one of {POLICIES}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgument(f"apply_activation_checkpointing: every={every!r} must be an int >= 1")
    remove_activation_checkpointing(model)
    if policy == "none":
        return []
    context_fn = selective_context if policy == "selective" else None
    done = []
    for i, layer in enumerate(decoder_layers(model)):
        if i % every:
            continue
        layer.__dict__[_ORIGINAL] = layer.__dict__.get("forward")  # None: the class's forward
        layer.forward = _checkpointed(layer, layer.forward, context_fn)
        done.append(i)
    return done


def compile_layers(model, **compile_kwargs) -> int:
    """``torch.compile`` each decoder layer's forward in place; returns how many.

    Compiling layer by layer (not the whole model) keeps the graphs small and identical
    across layers, so one compiled graph serves every layer (one dynamo frame, checked in
    tests), and the host can run ahead of the GPU while the optimizer works inside backward
    (ANCHORS.md, "4B feasibility").  The checkpoint stays *outside* the compiled function in
    either order of the two calls: ``checkpoint(compiled_forward)``.  (Compiling around the
    checkpoint let the partitioner keep far more: 27.5 GiB against 16.2 GiB eager at the
    Qwen3-4B shape, H200.)
    ``compile_kwargs`` go to ``torch.compile`` (e.g. ``backend="eager"`` in tests).
    """
    layers = decoder_layers(model)
    for layer in layers:
        wrapper = layer.__dict__.get("forward")
        inner = getattr(wrapper, "_pgs_inner", None)
        if inner is not None:  # checkpointed: compile inside, keep the checkpoint outside
            compiled = _checkpointed(layer, torch.compile(inner, **compile_kwargs), wrapper._pgs_context)
            compiled._pgs_inner_compiled = True
            layer.forward = compiled
        else:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
    return len(layers)


def apply_liger(model, **kwargs) -> None:
    """Patch ``model`` with Liger's kernels (RMSNorm, RoPE, SwiGLU, fused linear CE), in place.

    Needs the ``liger-kernel`` package (``pip install 'pgs[gpu]'``); ``kwargs`` go to Liger's
    patch function (e.g. ``fused_linear_cross_entropy=False``).
    """
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        raise MissingExtra("apply_liger: the liger-kernel package is not installed "
                           "(pip install liger-kernel, or the gpu extra: pip install 'pgs[gpu]')") from None
    by_instance = getattr(liger, "_apply_liger_kernel_to_instance", None)
    if by_instance is not None:
        by_instance(model=model, **kwargs)
        return
    model_type = getattr(model.config, "model_type", "")
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is None:
        raise InvalidArgument(f"apply_liger: liger-kernel has no kernels for model_type {model_type!r}")
    patch(model=model, **kwargs)

