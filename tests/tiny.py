"""The tiny random-init models the tests build (no downloads): one shape, one way to build it.

- ``tiny_config(model_type, **fields)``: a transformers config of the family ``model_type`` with
  ``SHAPE`` (2 layers, hidden 32, 4 query heads of 8 over 2 key/value heads, vocabulary 96),
  ``fields`` changed; a field set to None is left out (the family's default).
- ``tiny_model(model_type, seed=..., dtype=..., **fields)``: that config's causal LM, its weights
  drawn under ``torch.manual_seed(seed)``.
- ``from_config(config, ...)``: the same for a config built elsewhere.
- ``shape_table(model_type, **fields)``: ``SHAPE`` as a ``[model.config]`` table, for the tests
  that build through pgs's own ``build_model``.
- ``tiny_table(**changes)``: the ``[model.config]`` table of the tiny Qwen3 that ``pgs run``
  trains in the tests (the quickstart tokenizer's vocabulary; tests/helpers.py writes it into specs).
"""

from __future__ import annotations

import contextlib

import torch

#: The in-process tiny shape (a family's own fields, e.g. experts, come as ``fields``).
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)

#: The tiny Qwen3 of the specs the tests run (random init, the quickstart tokenizer's vocabulary):
#: trains on the CPU in seconds.
TINY_TABLE = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                  tie_word_embeddings=True)


def _without_none(table: dict) -> dict:
    return {k: v for k, v in table.items() if v is not None}


def tiny_table(**changes) -> dict:
    """``TINY_TABLE`` with ``changes``; a change to None leaves that key out."""
    return _without_none({**TINY_TABLE, **changes})


def shape_table(model_type: str = "qwen3", **fields) -> dict:
    """``SHAPE`` with ``fields`` (None: left out) and its ``model_type``: a ``[model.config]`` table."""
    return _without_none({"model_type": model_type, **SHAPE, **fields})


def tiny_config(model_type: str = "qwen3", **fields):
    """A transformers config of ``model_type`` with ``SHAPE`` and ``fields`` (None: left out)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_without_none({**SHAPE, **fields}))


def from_config(config, *, seed: int | None = 0, init_dtype: torch.dtype | None = None,
                dtype: torch.dtype | None = None, mode: str | None = "train", fork_rng: bool = False,
                **kwargs):
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` with its weights drawn under
    ``torch.manual_seed(seed)`` (None: the global generator as it is).

    ``init_dtype``: the dtype the weights are drawn in (``from_config``'s ``dtype``); ``dtype``: a
    cast after the draw; ``mode``: ``"train"``, ``"eval"`` or None (as built); ``fork_rng``: the
    draw leaves the caller's random state as it was."""
    from transformers import AutoModelForCausalLM

    if init_dtype is not None:
        kwargs["dtype"] = init_dtype
    with torch.random.fork_rng() if fork_rng else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if dtype is not None:
        model = model.to(dtype)
    if mode == "train":
        model.train()
    elif mode == "eval":
        model.eval()
    return model


def tiny_model(model_type: str = "qwen3", *, seed: int | None = 0, init_dtype: torch.dtype | None = None,
               dtype: torch.dtype | None = None, mode: str | None = "train", fork_rng: bool = False,
               **fields):
    """The causal LM of ``tiny_config(model_type, **fields)``, built by ``from_config``."""
    return from_config(tiny_config(model_type, **fields), seed=seed, init_dtype=init_dtype, dtype=dtype,
                       mode=mode, fork_rng=fork_rng)


#: Every decoder-only text family pgs verifies end to end (tests/integration/test_families.py,
#: docs/models.md's table): ``model_type`` -> the fields its tiny config sets on top of ``SHAPE``
#: (None: the family's default).  Each keeps the family's distinguishing parts small but present:
#: experts, multi-head latent attention, Gated DeltaNet layers beside attention, sliding windows
#: of 8 tokens (shorter than the test's documents), attention sinks, per-layer input embeddings.
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
HYBRID = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
              first_k_dense_replace=1, n_group=1, topk_group=1)
FAMILIES = {
    "qwen3": {},
    "qwen3_moe": dict(EXPERTS),
    "qwen3_5_text": dict(HYBRID),
    "qwen3_5_moe_text": dict(HYBRID, **EXPERTS, shared_expert_intermediate_size=16, intermediate_size=None),
    "qwen3_next": dict(HYBRID, **EXPERTS, shared_expert_intermediate_size=16),
    "olmo_hybrid": dict(HYBRID, head_dim=None, pad_token_id=0, eos_token_id=2),
    "olmo3": dict(SLIDING, head_dim=None, pad_token_id=0, eos_token_id=2),
    "gemma3_text": dict(SLIDING, query_pre_attn_scalar=8),
    "gemma4_text": dict(SLIDING, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, global_head_dim=8),
    "llama": {},
    "mistral": dict(sliding_window=8),
    "gpt_oss": dict(SLIDING, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "glm4_moe": dict(ROUTED),
    "deepseek_v3": dict(ROUTED, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6,
                        qk_nope_head_dim=4, head_dim=4, num_key_value_heads=4),
}


def family_table(model_type: str, **changes) -> dict:
    """``shape_table`` of the family ``model_type`` with its ``FAMILIES`` fields and ``changes``."""
    return shape_table(model_type, **{**FAMILIES[model_type], **changes})
