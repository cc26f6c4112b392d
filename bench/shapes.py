"""Tensor shapes of real models, for benchmarks (no weights, just shapes)."""

from __future__ import annotations


def qwen3_shapes(hidden=2048, intermediate=6144, layers=28, q_heads=16, kv_heads=8, head_dim=128, vocab=151_936,
                 tied=True) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a Qwen3 decoder's parameters (1.7B by default: 1.72 B params, 310 tensors)."""
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s[p + "self_attn.q_proj.weight"] = (q_heads * head_dim, hidden)
        s[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        s[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        s[p + "self_attn.o_proj.weight"] = (hidden, q_heads * head_dim)
        s[p + "self_attn.q_norm.weight"] = (head_dim,)
        s[p + "self_attn.k_norm.weight"] = (head_dim,)
        s[p + "mlp.gate_proj.weight"] = (intermediate, hidden)
        s[p + "mlp.up_proj.weight"] = (intermediate, hidden)
        s[p + "mlp.down_proj.weight"] = (hidden, intermediate)
        s[p + "input_layernorm.weight"] = (hidden,)
        s[p + "post_attention_layernorm.weight"] = (hidden,)
    s["model.norm.weight"] = (hidden,)
    if not tied:
        s["lm_head.weight"] = (vocab, hidden)
    return s


def small_shapes() -> dict[str, tuple[int, ...]]:
    """A tiny stand-in with the same structure, for CPU smoke runs."""
    return qwen3_shapes(hidden=64, intermediate=128, layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab=512)
