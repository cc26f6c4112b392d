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

RNG state: ``torch.utils.checkpoint`` saves the CPU and CUDA generators' states before each
checkpointed forward and restores them around the recompute, so that dropout draws the same
masks twice.  That is a dozen small host calls per layer and pass, for nothing when the model
draws no random numbers: ``apply_activation_checkpointing`` turns it off when no dropout in
the model (modules, or any ``*dropout*`` rate of its config or of a module) is above 0
(``model_draws_random``), unless ``preserve_rng=True`` asks for it.

``every=k`` checkpoints layers 0, k, 2k, … only (layer-selective checkpointing); the others
keep everything.  A ``"full"`` or ``"sublayer"`` layer runs through ``_Recompute`` where that is
exact (its forward without autograd, its recompute under a nested backward: gradient release's
hooks fire inside it as in one backward); the rest uses ``torch.utils.checkpoint`` with
``use_reentrant=False``, which is what gradient release needs (its hooks fire inside the one
backward) and what ``torch.compile`` traces.
"""

from __future__ import annotations

import weakref

from typing import Any, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pgs.errors import InvalidArgument, MissingExtra
from pgs.runtime.pinned import HostPool

POLICIES = ("none", "full", "selective", "sublayer")
#: decoder layers whose forward is ``x + mixer(norm1(x))`` then ``h + mlp(norm2(h))`` (the
#: ``"sublayer"`` policy re-states that forward in two checkpointed parts).  The mixer is the
#: layer's ``self_attn``, or in a hybrid model's linear-attention layers its ``linear_attn``
#: (Gated DeltaNet), called as transformers' decoder layer calls it.
SUBLAYER_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer",
                   "Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer", "Qwen3NextDecoderLayer",
                   "OlmoHybridLinearAttentionDecoderLayer")
#: What a decoder layer's keyword arguments hold that transformers' hybrid layers do not hand to
#: their linear-attention mixer (it takes the cache, the mask and the packing boundaries).
_ATTENTION_ONLY = ("position_ids", "position_embeddings", "use_cache", "output_attentions")
_ORIGINAL = "_pgs_forward_before_checkpointing"
#: Marks a decoder layer that :func:`skip_frozen_prefix` runs without autograd.
_NO_BACKWARD = "_pgs_no_backward"
#: Parameters outside the decoder layers that sit above them (the final norm; the head is
#: found as the output embeddings): trainable, they need no backward through the layers.
_ABOVE_LAYERS = (".norm.", ".final_layernorm.", ".ln_f.", ".final_norm.", ".norm_f.")


def decoder_layers(model) -> Sequence[torch.nn.Module]:
    """The decoder layers of a HF causal LM: the first non-empty ``ModuleList`` of
    ``model.layers``, ``model.language_model.layers``, ``model.decoder.layers``, ``layers``,
    ``transformer.h``, ``base_model.layers``; else the modules whose class is in
    ``model._no_split_modules`` (a list)."""
    for path in ("model.layers", "model.language_model.layers", "model.decoder.layers", "layers",
                 "transformer.h", "base_model.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    raise InvalidArgument(f"{type(model).__name__}: no decoder layers found (looked for model.layers, "
                          "model.language_model.layers, transformer.h, base_model.layers and the classes "
                          "of _no_split_modules); checkpointing, compile_layers and sharding need a "
                          "transformers decoder (shard_model: or pass layers= explicitly)")


def _positive_rate(obj) -> bool:
    for name, value in vars(obj).items():
        if "dropout" in name.lower() and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False


def model_draws_random(model) -> bool:
    """Whether a training forward of ``model`` may draw random numbers: a dropout module with
    p > 0, or a ``*dropout*`` rate above 0 in its config (text config included) or on any
    module (HF attention modules keep ``attention_dropout`` as a float)."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None and _positive_rate(c):
            return True
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if _positive_rate(m):
            return True
    return False


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


_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    """One side stream per CUDA device for the offload copies."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=device)
    return _STREAMS[key]


#: The checkpointed layer inputs' page-locked host buffers (``pgs.runtime.pinned.HostPool``).
HOST_POOL = HostPool()


class OffloadedInput:
    """A checkpointed layer's input, kept in host memory between its forward and its recompute.

    Made in forward: on CUDA a non-blocking copy into pinned host memory on a side stream
    (ordered after the producer of ``x``; ``x``'s block is not reused before the copy ends),
    on the CPU a plain copy (what the tests exercise).  ``get()`` returns ``x`` itself during
    the first forward and, once ``release()`` has dropped it, a copy back on ``x``'s device,
    requiring grad as ``x`` did (the gradient flows through the original graph; the recompute
    only refills saved tensors).

    Prefetch: the handles of one forward are linked in order (``previous``, a weak reference).
    Backward recomputes the layers last to first, so when layer i's ``get()`` runs, the copies
    back of layers i-1, …, i-``depth`` are started (``prefetch()``, each once) on the side
    stream, after their own device→host copies: they then overlap the recompute and backward
    of the layers in between, and the compute stream only waits on their events.  ``depth``
    layer inputs more are on the device at a time; more than one gives a copy back more time
    where the host→device copy engine is shared (offloaded optimizer state streams through it
    in the same backward).
    """

    _last: dict = {}  # device -> weak reference to the newest handle of the running forward

    def __init__(self, x: torch.Tensor, depth: int = 1):
        self.depth = max(1, int(depth))
        self.device = x.device
        self.requires_grad = x.requires_grad
        self.live: torch.Tensor | None = x
        self.event = None
        self.ready: tuple | None = None  # (device tensor, event or None): a started copy back
        self.used = False
        self.previous = OffloadedInput._last.get(self.device)
        OffloadedInput._last[self.device] = weakref.ref(self)
        if x.is_cuda:
            # page-locked at its own size (the pinned caching allocator would round a 20 MiB
            # input up to 32), back in the pool when this handle dies; the copies out of and
            # back into a reused buffer are ordered by their one side stream
            self.host = HOST_POOL.take(x.shape, x.dtype)
            weakref.finalize(self, HOST_POOL.give, self.host)
            stream = _copy_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                self.host.copy_(x.detach(), non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            x.record_stream(stream)
        else:
            self.host = x.detach().clone()

    def prefetch(self) -> None:
        """Start the copy back (no-op while ``x`` is live, or once started or used)."""
        if self.live is not None or self.ready is not None or self.used:
            return
        if self.event is None:
            self.ready = (self.host.clone(), None)
            return
        stream = _copy_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            x = self.host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.ready = (x, done)

    def get(self) -> torch.Tensor:
        if self.live is not None:
            return self.live
        if self.ready is None:  # not prefetched (the first layer of backward), or asked again
            self.used = False
            self.prefetch()
        x, done = self.ready
        self.ready, self.used = None, True
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            x.record_stream(current)  # made on the side stream, used and freed on this one
        before = self
        for _ in range(self.depth):  # the next ``depth`` layers of backward (started ones: no-ops)
            before = before.previous() if before.previous is not None else None
            if before is None:
                break
            before.prefetch()
        # as the original input (a compiled layer guards on it, and must save the same tensors)
        return x.requires_grad_(self.requires_grad)

    def release(self) -> None:
        self.live = None


def _without_cache(kwargs: dict) -> dict:
    # the recompute would write a KV cache a second time (and a selective policy would then
    # find different ops in forward and recompute): a checkpointed layer runs without one
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return kwargs


class _Recompute(torch.autograd.Function):
    """A checkpointed call ``fn(x)`` whose forward runs without autograd and whose backward
    recomputes ``fn`` on the kept (or offloaded) input and backpropagates through it.

    Against ``torch.utils.checkpoint(use_reentrant=False)`` the forward builds no graph and
    saves no tensors (a compiled layer runs its inference graph; no pack hooks), which is what
    a host-bound step needs.  The recompute's backward is a nested backward on the autograd
    thread: the layer's parameters accumulate their gradients there, so gradient release's
    hooks fire exactly as in one backward.  Used only when exact (``_fast_ok``): ``x`` needs a
    gradient (else its parameters would get none through this node), no other tensor argument
    does, and the RNG state does not matter (``model_draws_random``)."""

    @staticmethod
    def forward(ctx, run, offload, x):
        ctx.run = run
        ctx.held = OffloadedInput(x, int(offload)) if offload else None
        if not offload:
            ctx.save_for_backward(x)
        out = run(x)
        if offload:
            ctx.held.release()
        return out

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("a checkpointed layer's recompute (pgs.runtime.model.layers._Recompute) runs a nested "
                               "backward, which torch.autograd.grad and backward(inputs=...) cannot see; use "
                               "loss.backward(), or apply_activation_checkpointing(..., fast_recompute=False)")
        x = ctx.held.get() if ctx.held is not None else ctx.saved_tensors[0]
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            outs = ctx.run(x)
        ctx.run = ctx.held = None
        # through the outputs' gradient edges, not the tensors: the recomputed outputs are freed
        # before the nested backward runs (unless the graph itself saved them); a variable left
        # holding the last output would keep it alive at the peak.
        edges, given = _gradient_edges(outs, grads)
        del outs
        if edges:
            torch.autograd.backward(edges, given)
        return None, None, x.grad


def _gradient_edges(outs, grads) -> tuple[list, list]:
    """The gradient edges of the outputs that take a gradient, with their gradients (no
    reference to an output survives the call)."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(torch.autograd.graph.get_gradient_edge(o), g) for o, g in zip(outs, grads)
             if isinstance(o, torch.Tensor) and o.grad_fn is not None and g is not None]
    return [e for e, _ in pairs], [g for _, g in pairs]


def _fast_ok(x, rest: tuple, extra: dict, kwargs: dict) -> bool:
    if not (isinstance(x, torch.Tensor) and x.requires_grad) or extra.get("preserve_rng_state", True):
        return False
    if "context_fn" in extra:
        return False
    more = [a for a in (*rest, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return not any(a.requires_grad for a in more)


def _wants_early_stop(layer) -> bool:
    """A tiled MLP (``pgs.runtime.model.tiled_mlp``) saves only its input, and the recompute of
    ``torch.utils.checkpoint`` stops once that is saved again (its early stop): the MLP's forward
    is not run a second time.  ``_Recompute`` runs the whole forward, so those layers keep
    ``torch.utils.checkpoint``."""
    mlp = getattr(layer, "mlp", None)
    return mlp is not None and "_pgs_forward_before_mlp_tiles" in vars(mlp)


def _checkpoint_call(fn, x, rest: tuple, offload: bool | int, extra: dict, kwargs: dict, fast: bool = False):
    """``checkpoint(fn, x, *rest, **kwargs)``; with ``offload`` the input ``x`` reaches ``fn``
    through an ``OffloadedInput`` handle, not as a checkpoint argument, so nothing keeps it on
    the device after this call (the recompute reads the host copy; gradients flow through the
    original graph, so the copy needs none).  Where exact, ``_Recompute`` instead of
    ``torch.utils.checkpoint`` (``fast``)."""
    if fast and _fast_ok(x, rest, extra, kwargs):
        def run(inp):
            return fn(inp, *rest, **kwargs)

        return _Recompute.apply(run, offload, x)
    if offload and isinstance(x, torch.Tensor):
        held = OffloadedInput(x, int(offload))

        def from_handle(handle, *more, **kw):
            return fn(handle.get(), *more, **kw)

        out = checkpoint(from_handle, held, *rest, use_reentrant=False, **extra, **kwargs)
        held.release()
        return out
    return checkpoint(fn, x, *rest, use_reentrant=False, **extra, **kwargs)


def _checkpointed(layer: torch.nn.Module, forward, context_fn, offload: bool | int = False, rng: bool = True,
                  fast: bool = False):
    def run(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        kwargs = _without_cache(kwargs)
        extra = {"preserve_rng_state": rng}
        if context_fn is not None:
            extra["context_fn"] = context_fn
        if not args:
            return checkpoint(forward, use_reentrant=False, **extra, **kwargs)
        return _checkpoint_call(forward, args[0], args[1:], offload, extra, kwargs,
                                fast and not _wants_early_stop(layer))

    return _tagged(run, forward, context_fn, offload, rng, fast)


def _tagged(run, inner, context_fn, offload: bool | int, rng: bool, fast: bool):
    """``run`` with what ``compile_layers`` and ``remove_activation_checkpointing`` read back to
    rebuild or undo a checkpointed layer: its own forward and the checkpoint's settings."""
    run._pgs_inner = inner
    run._pgs_context = context_fn
    run._pgs_offload = offload
    run._pgs_rng = rng
    run._pgs_fast = fast
    run._pgs_inner_compiled = False
    return run


def sublayer_parts(layer: torch.nn.Module):
    """``(attention, mlp)``: the two residual halves of a decoder layer's forward,
    ``attention(x, **kw) = x + mixer(input_layernorm(x), **kw)`` and
    ``mlp(h) = h + mlp(post_attention_layernorm(h))``; the mixer is ``self_attn``, or
    ``linear_attn`` in a hybrid model's linear-attention layers (given the keyword arguments
    transformers gives it: not the positions), and a mixture-of-experts MLP's router logits
    are dropped as the layer drops them."""
    linear = getattr(layer, "linear_attn", None)

    def attention(x, **kwargs):
        if linear is not None:
            out = linear(hidden_states=layer.input_layernorm(x),
                         **{k: v for k, v in kwargs.items() if k not in _ATTENTION_ONLY})
        else:
            out = layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)
        return x + (out[0] if isinstance(out, tuple) else out)

    def mlp(h):
        out = layer.mlp(layer.post_attention_layernorm(h))
        return h + (out[0] if isinstance(out, tuple) else out)

    return attention, mlp


def _checkpointed_sublayers(layer: torch.nn.Module, original, offload: bool | int, parts=None, rng: bool = True,
                            fast: bool = False):
    """The ``"sublayer"`` policy: the attention half and the MLP half are checkpointed apart, so
    backward holds one half's recomputed activations at a time (the layer's output is the
    MLP half's; its input, the attention half's output, is kept, or offloaded, like the layer's)."""
    attention, mlp = parts or sublayer_parts(layer)

    def run(hidden_states=None, *args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return original(hidden_states, *args, **kwargs) if hidden_states is not None else original(*args, **kwargs)
        if args or hidden_states is None:
            raise InvalidArgument(f"{type(layer).__name__}: the \"sublayer\" checkpoint policy needs the layer called "
                                  "as layer(hidden_states, **kwargs), as transformers calls it")
        kwargs = _without_cache(kwargs)
        extra = {"preserve_rng_state": rng}
        quick = fast and not _wants_early_stop(layer)
        h = _checkpoint_call(attention, hidden_states, (), offload, extra, kwargs, quick)
        return _checkpoint_call(mlp, h, (), offload, extra, {}, quick)

    run._pgs_sublayer_parts = (attention, mlp)
    return _tagged(run, original, None, offload, rng, fast)


def frozen_prefix(model) -> int:
    """How many decoder layers, from the first, no gradient needs to pass through: frozen, with
    no trainable parameter below them (the input embeddings, or anything else outside the
    layers but the output head and the final norm, trainable means 0)."""
    layers = decoder_layers(model)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    above = {id(p) for p in head.parameters()} if head is not None else set()
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in inside:
            continue
        if id(p) in tied or not (id(p) in above or any(t in "." + name for t in _ABOVE_LAYERS)):
            return 0  # trainable below the layers: backward goes through every one of them
    count = 0
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        count += 1
    return count


def skip_frozen_prefix(model) -> list[int]:
    """Selective differentiation: the decoder layers of :func:`frozen_prefix` run under
    ``torch.no_grad()``, so they save nothing for backward (not even a checkpointed layer's
    input: ``apply_activation_checkpointing`` leaves them alone) and backward ends at the first
    trainable layer.  Exact: no gradient would reach them.  Returns their indices; call it after
    ``freeze`` (a later change of ``requires_grad`` is not seen)."""
    done = []
    for i, layer in enumerate(decoder_layers(model)[:frozen_prefix(model)]):
        if not getattr(layer, _NO_BACKWARD, False):
            forward = layer.forward

            def run(*args, _forward=forward, **kwargs):
                with torch.no_grad():
                    return _forward(*args, **kwargs)

            layer.forward = run
            setattr(layer, _NO_BACKWARD, True)
        done.append(i)
    return done


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


def apply_activation_checkpointing(model, policy: str = "full", every: int = 1, offload: bool | int = False,
                                   fast_recompute: bool = True, preserve_rng: bool = False) -> list[int]:
    """Checkpoint the decoder layers of ``model`` in place; returns the checkpointed indices.

    Args:
        model: a HF causal LM (its ``model.layers``).
        policy: ``"none"``, ``"full"`` (recompute the whole layer), ``"selective"`` (save
            matmul and attention outputs, recompute elementwise ops) or ``"sublayer"`` (the
            attention half and the MLP half of the layer checkpointed apart: two kept inputs
            per layer, and backward holds one half's activations at a time; Llama, Qwen2/3,
            Mistral layers, and the hybrid Qwen3.5, Qwen3.5-MoE, Qwen3-Next layers, whose
            linear-attention mixer is the first half as attention is).
        every: checkpoint layers ``i`` with ``i % every == 0`` (1: all of them).
        offload: keep each checkpointed layer's input in (pinned) host memory between forward
            and backward instead of on the device (``OffloadedInput``): −b·h bytes per token
            and checkpointed layer on the device, one device→host copy per layer in forward
            (on a side stream) and one host→device copy per layer in backward (on the side
            stream, started one layer ahead; an int ``d`` ≥ 1 instead of True: ``d`` layers
            ahead, ``d`` inputs on the device).  ``"full"`` and ``"sublayer"`` policies.

    The generators' state is saved and restored around each recompute only when the model
    draws random numbers (``model_draws_random``) or ``preserve_rng`` is set.
    ``fast_recompute`` (on by default): ``"full"`` and ``"sublayer"`` layers run through
    ``_Recompute`` where it is exact (the layer input is the only tensor input that needs a
    gradient and no RNG state needs keeping), else through ``torch.utils.checkpoint``.

    Example::

        apply_activation_checkpointing(model, "full")          # every layer
        apply_activation_checkpointing(model, "full", every=2) # half of them

    Calling it again replaces the previous policy.  Use ``use_reentrant=False`` semantics
    throughout; loss and gradients equal the unchecked model's (tests/unit/test_checkpointing.py).
    """
    if policy not in POLICIES:
        raise InvalidArgument(f"apply_activation_checkpointing: policy={policy!r} is not one of {POLICIES}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise InvalidArgument(f"apply_activation_checkpointing: every={every!r} must be an int >= 1")
    if isinstance(offload, int) and not isinstance(offload, bool) and offload < 0:
        raise InvalidArgument(f"apply_activation_checkpointing: offload={offload!r}: True, False, or the layers "
                              "to fetch ahead (an int >= 1; 0 is off)")
    if offload and policy not in ("full", "sublayer"):
        raise InvalidArgument("apply_activation_checkpointing: offload=True needs policy \"full\" or \"sublayer\", "
                              f"got {policy!r} "
                              "(a selective policy replays the recompute's ops against the forward's, and the "
                              "copy back from the host is one more op)")
    remove_activation_checkpointing(model)
    if policy == "none":
        return []
    context_fn = selective_context if policy == "selective" else None
    layers = decoder_layers(model)
    if policy == "sublayer":
        other = sorted({type(layer).__name__ for layer in layers} - set(SUBLAYER_LAYERS))
        if other:
            raise InvalidArgument(f"apply_activation_checkpointing: policy \"sublayer\" knows the forward of "
                                  f"{', '.join(SUBLAYER_LAYERS)}, not {', '.join(other)}; use \"full\"")
    rng = bool(preserve_rng) or model_draws_random(model)
    fast = bool(fast_recompute)
    done = []
    for i, layer in enumerate(layers):
        if i % every or getattr(layer, _NO_BACKWARD, False):  # no backward: nothing to keep
            continue
        layer.__dict__[_ORIGINAL] = layer.__dict__.get("forward")  # None: the class's forward
        if policy == "sublayer":
            layer.forward = _checkpointed_sublayers(layer, layer.forward, offload, rng=rng, fast=fast)
        else:
            layer.forward = _checkpointed(layer, layer.forward, context_fn, offload, rng=rng, fast=fast)
        done.append(i)
    return done


def compile_layers(model, **compile_kwargs) -> int:
    """``torch.compile`` each decoder layer's forward in place; returns how many.

    Compiling layer by layer (not the whole model) keeps the graphs small and identical
    across layers, so one compiled graph serves every layer (one dynamo frame, checked in
    tests), and the host can run ahead of the GPU while the optimizer works inside backward
    (docs/performance.md, "Peers and ceilings").  The checkpoint stays *outside* the compiled function in
    either order of the two calls: ``checkpoint(compiled_forward)``.  (Compiling around the
    checkpoint lets the partitioner keep far more activations than eager: docs/memory.md.)
    ``compile_kwargs`` go to ``torch.compile`` (e.g. ``backend="eager"`` in tests).
    """
    layers = decoder_layers(model)
    for layer in layers:
        wrapper = layer.__dict__.get("forward")
        inner = getattr(wrapper, "_pgs_inner", None)
        parts = getattr(wrapper, "_pgs_sublayer_parts", None)
        if parts is not None:  # "sublayer": each half compiled, both checkpoints outside
            compiled = _checkpointed_sublayers(layer, inner, wrapper._pgs_offload,
                                               tuple(torch.compile(f, **compile_kwargs) for f in parts),
                                               rng=wrapper._pgs_rng, fast=wrapper._pgs_fast)
            layer.forward = compiled  # (removing the checkpoints later restores the uncompiled layer)
        elif inner is not None:  # checkpointed: compile inside, keep the checkpoint outside
            compiled = _checkpointed(layer, torch.compile(inner, **compile_kwargs), wrapper._pgs_context,
                                     getattr(wrapper, "_pgs_offload", False), rng=wrapper._pgs_rng,
                                     fast=wrapper._pgs_fast)
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

