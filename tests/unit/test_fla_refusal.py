"""flash-linear-attention's refusal of its gated backward on Hopper with Triton 3.4-3.7.0 is asked
before a hybrid model trains (``pgs.runtime.model.linear_attention.backward_refusal``): a stand-in
fla package states the conditions fla itself reads, so the rule is checked without a GPU."""

import sys
import types

import pytest
import torch

from pgs.runtime.model import linear_attention as LA


def fake_fla(monkeypatch, hopper: bool, triton_ok: bool, tilelang: bool):
    utils = types.ModuleType("fla.utils")
    utils.IS_NVIDIA_HOPPER, utils.TRITON_ABOVE_3_4_0, utils.TRITON_ABOVE_3_7_1 = hopper, True, triton_ok
    backends = types.ModuleType("fla.backends")
    backends.TileLangBackend = type("TileLangBackend", (), {"is_available": classmethod(lambda cls: tilelang)})
    fla = types.ModuleType("fla")
    for name, module in (("fla", fla), ("fla.utils", utils), ("fla.backends", backends)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(LA, "_KERNELS", [(lambda *a: None, lambda *a: None)])  # fla's kernels "found"


@pytest.mark.parametrize("hopper,triton_ok,tilelang,refused", [
    (True, False, False, True),   # the broken combination: refused
    (True, False, True, False),   # TileLang takes the kernel
    (True, True, False, False),   # Triton >= 3.7.1
    (False, False, False, False),  # not a Hopper GPU
])
def test_refusal_follows_fla_rule(monkeypatch, hopper, triton_ok, tilelang, refused):
    fake_fla(monkeypatch, hopper, triton_ok, tilelang)
    line = LA.backward_refusal(torch.device("cuda", 0))
    assert (line is not None) == refused
    if refused:
        assert "tilelang" in line and "3.7.1" in line and "\n" not in line


def test_no_refusal_on_cpu_or_without_fla(monkeypatch):
    fake_fla(monkeypatch, True, False, False)
    assert LA.backward_refusal(torch.device("cpu")) is None
    monkeypatch.setattr(LA, "_KERNELS", [()])  # fla not installed
    assert LA.backward_refusal(torch.device("cuda", 0)) is None


def test_a_hybrid_model_is_refused_before_it_is_built(monkeypatch):
    """``build_model`` asks before building or loading: a hybrid config (or a composite whose text
    model is one) is refused with the refusal's line, another model type is not."""
    from types import SimpleNamespace

    from pgs.errors import PreflightRefused
    from pgs.runtime.model.build import refuse_untrainable

    cuda = torch.device("cuda", 0)
    asked = []
    line = "flash-linear-attention refuses ..."
    monkeypatch.setattr(LA, "backward_refusal", lambda device: asked.append(device) or line)
    with pytest.raises(PreflightRefused, match="^model: flash-linear-attention refuses"):
        refuse_untrainable(SimpleNamespace(model_type="qwen3_5_text"), cuda)
    with pytest.raises(PreflightRefused):
        refuse_untrainable(SimpleNamespace(model_type="qwen3_5", text_config=SimpleNamespace(model_type="x")), cuda)
    with pytest.raises(PreflightRefused):
        refuse_untrainable(SimpleNamespace(model_type="outer", text_config=SimpleNamespace(model_type="qwen3_next")),
                           cuda)
    assert asked == [cuda] * 3
    refuse_untrainable(SimpleNamespace(model_type="qwen3"), cuda)  # not a hybrid: nothing to refuse,
    assert len(asked) == 3  # and fla not asked
    monkeypatch.setattr(LA, "backward_refusal", lambda device: None)
    refuse_untrainable(SimpleNamespace(model_type="qwen3_5_text"), cuda)  # fla can train it here


def test_build_model_asks_before_building(monkeypatch, tmp_path):
    """Through ``build_model`` itself: with the refusal standing (stand-in fla on a "CUDA"
    device), a hybrid architecture table stops before any module is made."""
    from pgs.errors import PreflightRefused
    from pgs.runtime.model import build

    monkeypatch.setattr(build.linear_attention, "backward_refusal", lambda device: "fla refuses (stand-in)")
    built = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_config", lambda *a, **k: built.append(1))
    table = {"model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 64, "head_dim": 16,
             "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(PreflightRefused, match="fla refuses"):
        build.build_model(config=table, dtype="float32", device="cpu")
    assert not built
