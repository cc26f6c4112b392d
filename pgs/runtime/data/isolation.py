"""Whether a model can keep packed documents from seeing each other.

pgs isolates the documents of a packed sequence by giving a HF model ``position_ids`` that
restart at 0 for each document, with ``use_cache=False`` and *no* ``attention_mask``: from
the restarts, transformers builds a block-diagonal causal mask (sdpa, eager) or passes
sequence boundaries to varlen kernels (flash attention).  Two things break that silently:

* an explicit attention mask or a cache, which switch the detection off (so the batch
  carries neither: see ``PackedBatch.forward_kwargs``);
* layers that are not attention: linear attention, state-space or convolution layers carry a
  recurrent state from one document into the next unless the sequence boundaries reach them.
  pgs hands the boundaries to the Gated DeltaNet layers of the families in
  ``pgs.runtime.model.linear_attention.ISOLATED_MODEL_TYPES`` (Qwen3.5, Qwen3.5-MoE,
  Qwen3-Next, OLMo-Hybrid), which restart their state at each document; other such layers
  (Mamba, Jamba, Falcon-H1, LFM2, RWKV, Zamba, or linear attention of another family) have no
  such path.

:func:`packing_isolation` says which case a model is in; :func:`require_packing_isolation`
refuses packing for a model that would leak, unless leakage is explicitly allowed.
"""

from __future__ import annotations

import attrs
from torch import nn

from pgs.errors import SpecError
from pgs.runtime.model import linear_attention as LA

#: Model families whose layers include linear attention or recurrent state (those in
#: ``LA.ISOLATED_MODEL_TYPES`` are isolated through the document boundaries).
LEAKING_MODEL_TYPES = ("qwen3_next", "qwen3_5", "mamba", "jamba", "falcon_h1", "lfm2", "rwkv", "zamba")
#: Layer types that isolate packed documents through the position-derived mask.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
#: Attention implementations that derive document boundaries from ``position_ids``.
ISOLATING_ATTENTION = {"sdpa", "eager", "flash_attention_2", "flash_attention_3", "pgs_varlen", "pgs_ring", None}


@attrs.frozen
class IsolationVerdict:
    """``isolates``: packed documents cannot see each other; ``reason`` says why not."""

    isolates: bool
    reason: str = ""


def _configs(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    yield config
    for name in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            yield sub


def packing_isolation(model_or_config) -> IsolationVerdict:
    """Can this HF model (or config) isolate packed documents?

    A config is judged by its model type and ``layer_types``; a model (an ``nn.Module``) also by
    its layers: every Gated DeltaNet layer must be one pgs hands the boundaries to
    (``pgs.runtime.model.linear_attention.isolate``, which ``build_model`` calls).
    """
    for config in _configs(model_or_config):
        model_type = str(getattr(config, "model_type", "") or "")
        known = model_type in LA.ISOLATED_MODEL_TYPES
        if not known and any(model_type.startswith(t) for t in LEAKING_MODEL_TYPES):
            return IsolationVerdict(
                False, f"model_type {model_type!r} has linear-attention/recurrent layers whose state "
                "crosses packed documents, and pgs has no path that restarts it at document boundaries"
            )
        layer_types = getattr(config, "layer_types", None) or []
        allowed = ATTENTION_LAYER_TYPES | ({LA.LINEAR_LAYER_TYPE} if known else set())
        other = sorted({str(t) for t in layer_types} - allowed)
        if other:
            return IsolationVerdict(
                False, f"layer_types include {', '.join(other)}: such layers carry state across packed documents "
                f"(pgs restarts it only for the Gated DeltaNet layers of {', '.join(sorted(LA.ISOLATED_MODEL_TYPES))})"
            )
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in ISOLATING_ATTENTION:
            return IsolationVerdict(
                False, f"attention implementation {implementation!r} is not known to isolate packed "
                "documents from position_ids (use varlen, sdpa, eager or flash_attention_2)"
            )
    if isinstance(model_or_config, nn.Module):
        unknown = LA.unknown_linear_layers(model_or_config)
        if unknown:
            return IsolationVerdict(
                False, f"its layers {', '.join(unknown)} are linear attention that pgs passes no document "
                "boundaries to (their state crosses packed documents)"
            )
        if not LA.isolated(model_or_config):
            return IsolationVerdict(
                False, "its linear-attention layers were not given document boundaries "
                "(build it with pgs.runtime.model.build.build_model, "
                "or call pgs.runtime.model.linear_attention.isolate)"
            )
    return IsolationVerdict(True)


def require_packing_isolation(model_or_config, allow_leakage: bool = False) -> IsolationVerdict:
    """Raise ``SpecError`` when packing would let documents leak into each other.

    ``allow_leakage=True`` (``data.allow_packing_leakage``) accepts it; the verdict is
    returned so that the caller can log the warning.
    """
    verdict = packing_isolation(model_or_config)
    if not verdict.isolates and not allow_leakage:
        raise SpecError(
            f"data.packing: refused, {verdict.reason}; set data.packing = false, or "
            "data.allow_packing_leakage = true to accept cross-document leakage"
        )
    return verdict
