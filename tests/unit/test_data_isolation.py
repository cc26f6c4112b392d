"""A document inside a pack gets the logits it gets alone (tiny random-init HF models)."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

from pgs.errors import SpecError
from pgs.runtime.data import Document, collate, packing_isolation, require_packing_isolation
from tiny import tiny_model

def tiny(kind: str, attn: str):
    kind, head_dim = ("qwen3", 8) if kind == "qwen3" else ("llama", None)
    return tiny_model(kind, seed=0, mode="eval", head_dim=head_dim, max_position_embeddings=64,
                      attn_implementation=attn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_document_logits_equal_alone(kind, attn):
    model = tiny(kind, attn)
    assert packing_isolation(model).isolates
    g = torch.Generator().manual_seed(1)
    docs = [
        Document(tuple(torch.randint(1, 96, (n,), generator=g).tolist()), (True,) * n)
        for n in (7, 5, 9)
    ]
    batch = collate([docs, docs[1:]], pad_id=0, seq_len=24)
    with torch.no_grad():
        packed = model(**batch.forward_kwargs()).logits
        for row, row_docs in enumerate([docs, docs[1:]]):
            bounds = batch.cu_seqlens[row].tolist()
            for d, start, stop in zip(row_docs, bounds, bounds[1:]):
                alone = model(input_ids=torch.tensor([d.input_ids]), use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, start:stop], alone, atol=1e-5, rtol=1e-5)


def test_linear_attention_models_are_refused_unless_allowed():
    # qwen3_5 and qwen3_next are isolated through their document boundaries (tests/integration/test_hybrid_packing.py)
    for config in (
        PretrainedConfig(model_type="mamba"),
        PretrainedConfig(model_type="falcon_h1"),
        PretrainedConfig(layer_types=["linear_attention", "full_attention"]),
    ):
        verdict = packing_isolation(config)
        assert not verdict.isolates
        with pytest.raises(SpecError, match="allow_packing_leakage"):
            require_packing_isolation(config)
        assert require_packing_isolation(config, allow_leakage=True) == verdict


def test_nested_text_config_is_checked():
    outer = PretrainedConfig(model_type="wrapper")
    outer.text_config = PretrainedConfig(layer_types=["full_attention", "linear_attention"])
    assert not packing_isolation(outer).isolates
    assert packing_isolation(PretrainedConfig(layer_types=["full_attention", "sliding_attention"])).isolates
