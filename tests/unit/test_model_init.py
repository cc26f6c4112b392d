"""``build_model`` initialises a ``model.config`` model directly on its device (issue 19: a 4B's
random init took ~3 minutes on the CPU before the ``.to(device)``), and loads a ``model.path``
folder straight onto it.  Same seed, same weights on the same kind of device; on the CPU the
device path gives exactly the old CPU init (parameters and buffers); tied weights stay tied;
HF's ``_init_weights`` ran (no uninitialised memory)."""

from __future__ import annotations

import pytest
import torch

from pgs.runtime.model.build import build_model

TINY = dict(
    model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _old_cpu_init(config: dict, seed: int, dtype=torch.float32):
    """What build_model did before it took a device: HF's init on the CPU under torch.manual_seed."""
    from transformers import AutoModelForCausalLM

    from pgs.runtime.model.build import build_config

    hf_config = build_config(config)
    hf_config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa").train()


def _tensors(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (the non-persistent ones too: rotary ``inv_freq``)."""
    out = {f"param:{n}": p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def _assert_same(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    assert any(k.endswith("inv_freq") for k in ta)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name].cpu(), tb[name].cpu()), name


def _assert_initialised(model, std=0.02) -> None:
    """HF's ``_init_weights`` ran: finite everywhere, matrices ~N(0, std), norms at one."""
    for name, p in model.named_parameters():
        p = p.detach().float()
        assert torch.isfinite(p).all(), name
        if p.ndim == 2:
            assert abs(p.mean().item()) < 0.1 * std, name
            assert 0.9 * std < p.std().item() < 1.1 * std, (name, p.std().item())
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("tied", [True, False])
def test_the_device_path_on_the_cpu_is_the_old_cpu_init(tied):
    config = {**TINY, "tie_word_embeddings": tied}
    new = build_model(config=config, attn_implementation="sdpa", init_seed=7, device="cpu")
    _assert_same(new, _old_cpu_init(config, 7))
    _assert_same(build_model(config=config, attn_implementation="sdpa", init_seed=7), new)  # device=None: the CPU
    assert _tied(new) == tied
    assert new.training


def test_same_seed_same_weights_other_seed_others():
    a, b = (build_model(config=TINY, attn_implementation="sdpa", init_seed=3, device="cpu") for _ in range(2))
    _assert_same(a, b)
    c = build_model(config=TINY, attn_implementation="sdpa", init_seed=4, device="cpu")
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_the_init_is_hf_s_and_leaves_the_caller_s_random_state_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = build_model(config=TINY, attn_implementation="sdpa", init_seed=0, device="cpu", dtype="bfloat16")
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _assert_initialised(model)


def test_the_default_device_context_is_honoured():
    """``device=None`` inside ``with torch.device(...)`` builds there (pgs.runtime.tools.profile does that)."""
    with torch.device("meta"):
        model = build_model(config=TINY, attn_implementation="sdpa")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_folder_loads_onto_the_device(tmp_path):
    saved = build_model(config={**TINY, "tie_word_embeddings": True}, attn_implementation="sdpa", init_seed=5)
    saved.save_pretrained(tmp_path)
    loaded = build_model(path=str(tmp_path), attn_implementation="sdpa", device="cpu")
    _assert_same(loaded, saved)
    assert _tied(loaded) and loaded.training


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("tied", [True, False])
def test_cuda_init_runs_on_the_device_reproducibly(tied):
    config = {**TINY, "tie_word_embeddings": tied}
    cpu = build_model(config=config, attn_implementation="sdpa", init_seed=7, device="cpu")
    state = torch.cuda.get_rng_state()
    a = build_model(config=config, attn_implementation="sdpa", init_seed=7, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), state)  # the caller's CUDA generator untouched
    b = build_model(config=config, attn_implementation="sdpa", init_seed=7, device=torch.device("cuda"))
    assert all(t.is_cuda for t in _tensors(a).values())
    _assert_same(a, b)  # same seed, same device type: same weights
    assert _tied(a) == tied
    _assert_initialised(a)
    # another generator than the CPU's: other draws, but the same deterministic buffers
    assert not torch.equal(a.model.embed_tokens.weight.cpu(), cpu.model.embed_tokens.weight)
    for (name, buf), (_, ref) in zip(a.named_buffers(), cpu.named_buffers()):
        torch.testing.assert_close(buf.cpu(), ref, rtol=1e-6, atol=0, msg=name)


@pytest.mark.cuda
@cuda
def test_cuda_a_folder_loads_onto_the_device(tmp_path):
    saved = build_model(config={**TINY, "tie_word_embeddings": True}, attn_implementation="sdpa", init_seed=5)
    saved.save_pretrained(tmp_path)
    loaded = build_model(path=str(tmp_path), attn_implementation="sdpa", device="cuda")
    assert all(t.is_cuda for t in _tensors(loaded).values())
    _assert_same(loaded, saved)
    assert _tied(loaded)
