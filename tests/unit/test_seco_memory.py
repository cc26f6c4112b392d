"""``pgs profile``'s prediction of chunk-wise training (``memory.seco_chunk``) against what the CPU
holds: the saved tensors of a chunk's recompute, the row's key/value cache and its gradient, and
the whole-row path's saved tensors at the same length."""

from __future__ import annotations

import pytest
import torch

from pgs.runtime.model import seco
from pgs.runtime.tools.profile import activation_parts, predict_memory, seco_cache_bytes
from tests.tiny import tiny_model
from tests.unit.test_seco import _loss_fn, _row

S, C = 64, 16


def _saved(model, run, exclude=()) -> int:
    """Bytes autograd saves while ``run()`` builds its graph (parameters, integer tensors and the
    storages in ``exclude`` not counted), plus the hidden state it returns."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | set(exclude)
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if t.dtype != torch.long and key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = run()
    return sum(saved.values()) + h.numel() * h.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prediction_equals_the_chunks_saved_tensors_and_the_cache(dtype):
    model = tiny_model("qwen3", dtype=dtype, hidden_size=64, intermediate_size=160, num_hidden_layers=3)
    ids, pos, labels = _row([[S]])
    whole = _saved(model, lambda: model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state)
    assert whole == activation_parts(model.config, S, dtype=dtype)[0]

    row = seco.ChunkedRow(model, ids, pos, C, _loss_fn(model, labels))
    row._forward()
    state = row.state
    cache = {t.untyped_storage().data_ptr() for d in (state.keys, state.values) for t in d.values()}
    with seco._chunk_attention(model, state):
        state.enter(len(state.bounds) - 1)  # the first chunk the sweep recomputes
        chunk = _saved(model, lambda: seco._chunk_hidden(model, ids[:, S - C:], pos[:, S - C:]), cache)
    assert chunk == activation_parts(model.config, C, dtype=dtype, cached_kv=True)[0]
    for layer in range(model.config.num_hidden_layers):
        state.accumulators(layer)
    predicted_cache, span = seco_cache_bytes(model.config, S, C, dtype=dtype)
    assert state.cache_bytes() == predicted_cache
    assert span == 2 * (2 * 8) * S * torch.empty((), dtype=dtype).element_size()  # K and V: 2 heads of 8 a token
    # what the two paths hold for backward at this length, measured and predicted alike
    assert chunk + state.cache_bytes() < whole


def test_profile_predicts_less_for_chunks_at_long_rows_and_the_cache_grows_with_the_row():
    cfg = tiny_model("qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=4).config
    whole = predict_memory(cfg, micro_batch_tokens=65536, state_bytes_per_param=8)
    chunked = predict_memory(cfg, micro_batch_tokens=65536, state_bytes_per_param=8, seco_chunk_tokens=4096)
    assert chunked["kv_cache"] > 0 and whole["kv_cache"] == 0
    assert chunked["activations"] < whole["activations"] and chunked["peak"] < whole["peak"]
    longer = predict_memory(cfg, micro_batch_tokens=131072, state_bytes_per_param=8, seco_chunk_tokens=4096)
    assert longer["activations"] - chunked["activations"] == seco_cache_bytes(cfg, 131072, 4096)[1] - \
        seco_cache_bytes(cfg, 65536, 4096)[1]
    # L·2·n_kv·d·b·(2N − C): twice the row, one chunk more
    assert longer["kv_cache"] == 2 * chunked["kv_cache"] + seco_cache_bytes(cfg, 4096, 4096)[0]


def test_plan_hands_the_chunk_to_the_prediction(tmp_path):
    from pgs.runtime.spec.load import load_spec
    from pgs.runtime.tools.profile import plan_from_spec
    from tests.helpers import tiny_spec

    path = tiny_spec(tmp_path)
    plain = plan_from_spec(load_spec(path))
    chunked = plan_from_spec(load_spec(path, ["memory.seco_chunk=24"]))
    micro = chunked["micro_batch"]
    assert plain["kwargs"]["seco_chunk_tokens"] == 0 and chunked["kwargs"]["seco_chunk_tokens"] == micro * 24
    a = predict_memory(plain["config"], **plain["kwargs"])
    b = predict_memory(chunked["config"], **chunked["kwargs"])
    assert a["kv_cache"] == 0 and b["kv_cache"] == seco_cache_bytes(chunked["config"], micro * 96, micro * 24,
                                                                     dtype=chunked["kwargs"]["dtype"])[0]
