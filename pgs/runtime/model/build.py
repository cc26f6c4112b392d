"""The model side of a run: build a HF causal LM, freeze what the spec says, feed the loss.

A model comes from a local folder (``model.path``, weights and config) or from an
architecture config (``model.config``, a table with ``model_type`` and sizes) with a
random init seeded by ``model.init_seed``, run on the training device itself (a 4B's init
took ~3 minutes on the CPU).  A hub name in the spec is resolved to its snapshot folder in
huggingface_hub's cache when the spec loads (``pgs.runtime.model.hub``); transformers itself is
only ever given local folders (``local_files_only``).

The loss never sees logits.  :func:`final_hidden` runs the base model (``model.model``) on
a packed batch with restarted ``position_ids``, ``use_cache=False`` and no attention mask
(what keeps packed documents apart, see ``pgs.runtime.data.isolation``), and
:func:`output_head` hands the head's weight to the chunked loss, which builds logits one
chunk of rows at a time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from typing import Any, Sequence

import torch
from torch import Tensor

from pgs.errors import PreflightRefused, SpecError
from pgs.runtime.model import composite, linear_attention
from pgs.runtime.model.attention import (boundary_kwargs, document_masks, hf_implementation, packed_kwargs,
                                        set_varlen_kernel, uses_varlen)
from pgs.runtime.model.loading import config_from_table, first_line
from pgs.runtime.model.moe import check_experts_implementation, experts_implementation as experts_choice

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

#: Layer types that form the attention pathway (``freeze = "non_attention"`` keeps these).
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; names the field when the name is unknown."""
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise SpecError(f"model.dtype: {name!r} is not one of {sorted(set(DTYPES))}") from None


def build_config(config: dict[str, Any]):
    """A ``transformers`` config from a table such as ``{model_type = "qwen3", hidden_size = 64}``."""

    return config_from_table(config)


def _init_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a concrete device (a CUDA device gets its index); None: the default device
    (the CPU, or the device of an enclosing ``with torch.device(...)``)."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_model(
    *,
    path: str | None = None,
    config: dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = "float32",
    attn_implementation: str | None = "auto",
    varlen_kernel: str = "auto",
    experts_implementation: str = "auto",
    init_seed: int = 0,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    trust_remote_code: bool = False,
):
    """A ``transformers`` causal LM in training mode, on ``device``, in ``dtype``.

    ``path``: a local HF folder (weights + config.json), loaded straight onto ``device``.
    ``config``: an architecture table (random init; ``vocab_size`` fills in the tokenizer's size
    when the table has none), initialised directly on ``device`` under ``init_seed``: the CPU's
    generator and that device's are seeded with it inside ``fork_rng`` (the caller's random
    state is untouched).  The same seed gives the same weights on the same kind of device; a CPU
    and a CUDA init differ (different generators).  Exactly one of the two.  ``device``: None
    is the default device (the CPU, or that of an enclosing ``with torch.device(...)``).
    ``varlen_kernel``: the packed-attention kernel (``pgs.runtime.model.attention.set_varlen_kernel``;
    resolved here for ``device`` when the model uses it).  ``experts_implementation``
    (``model.experts_implementation``): how a mixture-of-experts model runs its experts,
    ``"auto"`` for transformers' own default (``pgs.runtime.model.moe.experts_implementation``;
    refused for a model without experts).  ``trust_remote_code``
    (``model.trust_remote_code``): let transformers run the modelling code a local folder ships
    (its ``auto_map``), for the configuration and the model alike.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    device = _init_device(device)
    set_varlen_kernel(varlen_kernel, prime=False)  # resolved below, where the model uses it
    cuda = device if device.type == "cuda" else None
    if (path is None) == (config is None):
        raise SpecError("model: give exactly one of model.path (a local folder) or model.config (an architecture)")
    if path is not None:
        if not os.path.isdir(path):
            raise SpecError(f"model.path: {path!r} is not a folder (hub names are resolved to folders when the spec "
                            "loads: pgs.runtime.model.hub)")
        from transformers import AutoConfig

        folder_config = (AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
                         if attn_implementation == "auto" or experts_implementation != "auto" else None)
        if cuda is not None:  # asked before the weights load
            refuse_untrainable(folder_config or AutoConfig.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code), device)
        attn_implementation = hf_implementation(
            attn_implementation, folder_config if attn_implementation == "auto" else None, device=cuda)
        experts = experts_choice(experts_implementation, folder_config)
        extra = {} if experts is None else {"experts_implementation": experts}
        # straight onto the device where transformers can (its device_map needs accelerate); else
        # on the CPU (whatever device an enclosing context names) and then moved
        direct = device.type not in ("cpu", "meta") and importlib.util.find_spec("accelerate") is not None
        try:
            with contextlib.nullcontext() if direct else torch.device("cpu"):
                model, info = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch_dtype, attn_implementation=attn_implementation, local_files_only=True,
                    device_map=device if direct else None, trust_remote_code=trust_remote_code,
                    output_loading_info=True, **extra,
                )
        except (OSError, ValueError, RuntimeError, KeyError) as err:  # cut short, corrupt, another shape
            why = ("a tensor's shape differs from what config.json makes it; pgs validate names which"
                   if "ignore_mismatched_sizes" in str(err) else first_line(err))
            raise SpecError(f"model.path: the weights in {path} could not be loaded ({why})") from None
        missing = sorted(info.get("missing_keys") or ())
        if missing:  # transformers would initialise them at random and the run would train them as loaded
            raise SpecError(f"model.path: the weights in {path} lack {len(missing)} of the model's tensors "
                            f"(e.g. {missing[0]!r}); pgs does not train weights that were never loaded")
        model.to(device)
        composite.attach(model, path)  # a vision-language checkpoint's text model exports in its shape
    else:
        table = dict(config)
        if vocab_size is not None:
            table.setdefault("vocab_size", int(vocab_size))
        hf_config = build_config(table)
        refuse_untrainable(hf_config, device)
        attn_implementation = hf_implementation(attn_implementation, hf_config, device=cuda)
        hf_config._attn_implementation = attn_implementation
        experts = experts_choice(experts_implementation, hf_config)
        extra = {} if experts is None else {"experts_implementation": experts}
        with torch.random.fork_rng(devices=[device.index] if cuda else [], device_type="cuda"), torch.device(device):
            torch.random.default_generator.manual_seed(int(init_seed))
            if cuda:
                torch.cuda.default_generators[device.index].manual_seed(int(init_seed))
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=torch_dtype, attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code, **extra,
            )
    check_experts_implementation(model, experts)
    composite.freeze_towers(model)  # a vision-language model trained on text: its tower stays as loaded
    linear_attention.isolate(model)  # Gated DeltaNet layers restart at packed document boundaries
    if linear_attention.linear_layers(model):  # also a Gated DeltaNet class of another model type
        _refuse(linear_attention.backward_refusal(device))
    model.train()
    return model


def refuse_untrainable(hf_config, device: torch.device) -> None:
    """Stop before a hybrid model (its ``model_type``, or its text model's, one of
    ``linear_attention.ISOLATED_MODEL_TYPES``) is built or loaded on ``device`` where its Gated
    DeltaNet layers cannot be trained (``linear_attention.backward_refusal``).  Other models are
    not asked: fla is imported for hybrid models only."""
    text = getattr(hf_config, "text_config", None)
    types = {getattr(hf_config, "model_type", None), getattr(text, "model_type", None)}
    if types & linear_attention.ISOLATED_MODEL_TYPES:
        _refuse(linear_attention.backward_refusal(device))


def _refuse(refusal: str | None) -> None:
    if refusal:
        raise PreflightRefused(f"model: {refusal}")


def _layer_index(name: str) -> int | None:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def freeze(model, policy: str | Sequence[str] | None) -> list[str]:
    """Set ``requires_grad=False`` on the parameters ``policy`` names; returns their names.

    ``"none"`` (or None / empty): train everything.  ``"non_attention"``: freeze every
    decoder layer whose ``config.layer_types`` entry is not attention (the linear-attention
    or recurrent layers of a hybrid model), keeping the attention pathway, embeddings and
    head trainable.  A list of regular expressions: freeze each parameter whose name
    matches one (``re.search``).
    """
    if policy is None or policy == "none" or (not isinstance(policy, str) and len(policy) == 0):
        return []
    names: list[str] = []
    if policy == "non_attention":
        config = getattr(model.config, "text_config", None) or model.config
        layer_types = list(getattr(config, "layer_types", None) or [])
        frozen_layers = {i for i, t in enumerate(layer_types) if t not in ATTENTION_LAYER_TYPES}
        if not frozen_layers:
            raise SpecError(f"model.freeze: \"non_attention\" would freeze nothing: the layer_types of "
                            f"{getattr(config, 'model_type', '')!r} are all attention (no linear-attention or "
                            "recurrent layers); use \"none\" or a list of patterns")
        for name, p in model.named_parameters():
            if _layer_index(name) in frozen_layers:
                p.requires_grad_(False)
                names.append(name)
        return names
    if isinstance(policy, str):
        raise SpecError(
            f"model.freeze: {policy!r} is not \"none\", \"non_attention\" or a list of regular expressions"
        )
    try:
        patterns = [re.compile(p) for p in policy]
    except re.error as err:
        raise SpecError(f"model.freeze: bad regular expression: {err}") from None
    for name, p in model.named_parameters():
        if any(pattern.search(name) for pattern in patterns):
            p.requires_grad_(False)
            names.append(name)
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError("model.freeze: these patterns freeze every parameter; nothing would train")
    return names


def output_head(model) -> tuple[Tensor, Tensor | None, float | None]:
    """The head's weight [V, D], bias [V] or None, and the final logit softcap (or None)."""
    head = model.get_output_embeddings()
    if head is None:
        raise SpecError(f"model: {type(model).__name__} has no output head (not a causal LM)")
    config = getattr(model.config, "text_config", None) or model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    return head.weight, getattr(head, "bias", None), softcap


#: The method :func:`pgs.runtime.dist.fsdp.shard_model` registers on a sharded model as an FSDP
#: forward (it all-gathers the root, then runs :func:`base_hidden`).
HIDDEN_METHOD = "pgs_final_hidden"


def final_hidden(model, input_ids: Tensor, position_ids: Tensor, *, embed_noise=None) -> Tensor:
    """Final hidden states [B, S, D]; under FSDP2 through the root's registered forward.

    Use it (not ``model.base_model(...)`` directly) when the model may be sharded: a call
    that bypasses the root's forward never all-gathers the embeddings and the head.
    """
    method = getattr(model, HIDDEN_METHOD, None)
    if method is not None:
        return method(input_ids, position_ids, embed_noise=embed_noise)
    return base_hidden(model, input_ids, position_ids, embed_noise=embed_noise)


def base_hidden(model, input_ids: Tensor, position_ids: Tensor, *, embed_noise=None) -> Tensor:
    """Final hidden states [B, S, D] of the base model for a packed batch (no logits).

    ``position_ids`` restart at each document; no attention mask and no cache, so that
    transformers isolates the documents (with ``attn_implementation = "varlen"`` the boundaries
    go to the packed-attention kernel instead, see ``pgs.runtime.model.attention``; a model with
    linear-attention layers gets them too, see ``pgs.runtime.model.linear_attention``).
    ``embed_noise(embeds) -> embeds`` (NEFTune) is applied to the input embeddings when given.
    """

    base = model.base_model
    kwargs = dict(position_ids=position_ids, use_cache=False)
    if uses_varlen(model):  # the document boundaries, once for every layer
        kwargs.update(packed_kwargs(position_ids))
    elif linear_attention.wants_boundaries(model):  # for the linear-attention layers
        kwargs.update(boundary_kwargs(position_ids))
    masks = document_masks(model, position_ids, model.get_input_embeddings().weight.dtype)
    if masks is not None:  # a family whose own forward builds its masks without the positions
        kwargs.update(masks)
    if embed_noise is None:
        out = base(input_ids=input_ids, **kwargs)
    else:
        embeds = model.get_input_embeddings()(input_ids)
        out = base(inputs_embeds=embed_noise(embeds), **kwargs)
    return out.last_hidden_state


def parameter_bytes(model) -> int:
    """Bytes of all parameters (for the preflight's disk estimate)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class TokenRowGrads:
    """What a row-gradient embedding (``row_grad_embedding``) hands its weight instead of a
    dense [V, D] gradient: the looked-up ids and the gradient of each looked-up row.

    ``parts`` holds ``(ids [N], grads [N, D])`` per backward through the embedding;
    ``on_backward`` (if set) is called by each backward before it returns (gradient release
    uses it to learn that a backward is under way).  ``take()`` returns and clears the parts.
    """

    def __init__(self):
        self.parts: list[tuple[Tensor, Tensor]] = []
        self.on_backward = None
        self.accumulate_node = None  # the weight's AccumulateGrad: is this backward accumulating into it?

    def take(self) -> list[tuple[Tensor, Tensor]]:
        parts, self.parts = self.parts, []
        return parts

    def clear(self) -> None:
        self.parts = []


class _RowGradEmbedding(torch.autograd.Function):
    """``W[ids]`` whose backward keeps (ids, grad rows) in a ``TokenRowGrads`` and gives W
    no gradient (so autograd never builds the V×D buffer of ``embedding_dense_backward``)."""

    @staticmethod
    def forward(ctx, ids, weight, sink, padding_idx):
        ctx.sink, ctx.padding_idx = sink, padding_idx
        ctx.weight_shape = weight.shape
        ctx.save_for_backward(ids)
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        flat_ids = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0)
        if not _accumulates(ctx.sink.accumulate_node):
            # torch.autograd.grad(..., inputs=[weight]): not a training backward; the dense gradient
            dense = torch.zeros(ctx.weight_shape, dtype=rows.dtype, device=rows.device)
            return None, dense.index_add_(0, flat_ids, rows), None, None
        ctx.sink.parts.append((flat_ids.detach(), rows.detach()))
        if ctx.sink.on_backward is not None:
            ctx.sink.on_backward()
        return None, None, None, None


def _accumulates(node) -> bool:
    """Whether the running backward accumulates into the weight of AccumulateGrad ``node``
    (``loss.backward()``: yes; ``torch.autograd.grad(..., inputs=[weight])``: no)."""
    if node is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch refuses to answer for a leaf under autograd.grad: not accumulating
        return False


def row_grad_embedding(model, sink: TokenRowGrads):
    """Make the input embedding of ``model`` hand ``sink`` its looked-up rows' gradients
    instead of giving its weight a dense gradient; returns a function that undoes it.

    Forward is unchanged (``F.embedding``).  Refused (``ValueError``) for an embedding with
    ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` (their gradients are not the rows').
    """
    embed = model.get_input_embeddings()
    if not isinstance(embed, torch.nn.Embedding):
        raise ValueError(f"row_grad_embedding: the input embedding is a {type(embed).__name__}, not nn.Embedding")
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        raise ValueError("row_grad_embedding: an embedding with max_norm, scale_grad_by_freq or sparse=True "
                         "has other gradients than its rows'")
    padding_idx = embed.padding_idx
    if hasattr(torch._C, "_will_engine_execute_node"):
        sink.accumulate_node = embed.weight.view_as(embed.weight).grad_fn.next_functions[0][0]

    def forward(input_ids):
        if not (torch.is_grad_enabled() and embed.weight.requires_grad):
            return torch.nn.functional.embedding(input_ids, embed.weight, padding_idx)
        return _RowGradEmbedding.apply(input_ids, embed.weight, sink, padding_idx)

    embed.forward = forward

    def undo():
        if embed.__dict__.get("forward") is forward:
            del embed.forward

    return undo
