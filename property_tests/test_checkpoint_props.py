"""Property: activation checkpointing changes no arithmetic (docs/memory.md).

For random small Qwen3 shapes, batches, checkpoint policies (``full``, ``sublayer``, every
k-th layer), offloaded or kept inputs, and either recompute path (``checkpointing._Recompute``:
the forward without autograd, the graph rebuilt under a nested backward; or
``torch.utils.checkpoint``), the loss and every parameter's gradient equal the unchecked
model's bit for bit on the CPU, over two steps (the second after a plain SGD update, so the
recompute reads updated weights)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pgs.runtime.model.layers import apply_activation_checkpointing
from tiny import tiny_model


def _model(layers: int, heads: int, kv: int, head_dim: int, inter: int, vocab: int, seed: int):
    return tiny_model(seed=seed, hidden_size=heads * head_dim, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab,
                      tie_word_embeddings=True, attn_implementation="sdpa")


def _two_steps(model, ids):
    out = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append((loss.detach(), grads))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
    return out


@given(layers=st.integers(1, 3), heads=st.sampled_from([2, 4]), kv_div=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([4, 8]), inter=st.sampled_from([8, 24]), batch=st.integers(1, 2),
       seq=st.integers(2, 9), policy=st.sampled_from(["full", "sublayer"]), every=st.integers(1, 2),
       offload=st.booleans(), fast=st.booleans(), seed=st.integers(0, 2**16))
def test_checkpointed_steps_equal_unchecked(layers, heads, kv_div, head_dim, inter, batch, seq, policy, every,
                                            offload, fast, seed):
    vocab = 40
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    shape = (layers, heads, heads // kv_div, head_dim, inter, vocab, seed)
    ref = _two_steps(_model(*shape), ids)
    model = _model(*shape)
    apply_activation_checkpointing(model, policy, every=every, offload=offload, fast_recompute=fast)
    got = _two_steps(model, ids)
    for (la, ga), (lb, gb) in zip(got, ref):
        assert torch.equal(la, lb)
        assert ga.keys() == gb.keys()
        for n in gb:
            assert torch.equal(ga[n], gb[n]), n
