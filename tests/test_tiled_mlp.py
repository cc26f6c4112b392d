"""Sequence-tiled gated MLP (``pgs.runtime.tiled_mlp``): same outputs and gradients as the
module's own forward, one gradient per weight per backward, no second MLP forward in the
recompute of a checkpointed layer."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.runtime import tiled_mlp as T
from pgs.runtime.checkpointing import apply_activation_checkpointing, compile_layers
from pgs.runtime.release import GradientRelease

CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**CFG, attn_implementation="sdpa")).to(dtype).train()


IDS = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(1))


def grads_of(model):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tiles", [2, 3, 7, 64])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_tiled_equals_untiled(tiles, policy):
    ref, tiled = tiny(), tiny()
    apply_activation_checkpointing(tiled, policy)
    assert T.apply_mlp_tiles(tiled, tiles) == 2
    loss_a, ga = grads_of(ref)
    loss_b, gb = grads_of(tiled)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-5, msg=name)


def test_function_gradients_against_autograd_bf16_and_fp32():
    torch.manual_seed(2)
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 3e-2)):
        x = torch.randn(3, 10, 16, dtype=dtype, requires_grad=True)
        ws = [torch.randn(40, 16, dtype=dtype, requires_grad=True), torch.randn(40, 16, dtype=dtype, requires_grad=True),
              torch.randn(16, 40, dtype=dtype, requires_grad=True)]
        act = torch.nn.functional.silu
        y = T.tiled_gated_mlp(x, *ws, act, 4)
        y_ref = (act(x @ ws[0].t()) * (x @ ws[1].t())) @ ws[2].t()
        torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, *ws), dy)
        want = torch.autograd.grad(y_ref, (x, *ws), dy)
        for a, b in zip(got, want):
            scale = b.abs().max().item()
            torch.testing.assert_close(a, b, atol=tol * scale, rtol=tol)


def test_release_steps_each_weight_once_and_matches_untiled():
    a, b = tiny(), tiny()
    for m in (a, b):
        apply_activation_checkpointing(m, "full")
    T.apply_mlp_tiles(b, 3)
    # SGD: linear in the gradient, so the tiles' different summation order stays at rounding level
    # (Adam's normalisation would blow a 1e-12 difference of a near-zero gradient up to ±lr)
    ra = GradientRelease(pf.sgd(0.1), a)
    rb = GradientRelease(pf.sgd(0.1), b)
    for _ in range(2):
        for m in (a, b):
            m(input_ids=IDS, labels=IDS).loss.backward()
    assert rb.counts() == ra.counts() == {2}
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5)


def test_recompute_does_not_run_the_mlp_forward_again(monkeypatch):
    model = tiny()
    apply_activation_checkpointing(model, "full")
    T.apply_mlp_tiles(model, 2)
    loops = []
    original = T._tiles

    def counting(n, tiles):
        loops.append(n)
        return original(n, tiles)

    monkeypatch.setattr(T, "_tiles", counting)
    loss = model(input_ids=IDS, labels=IDS).loss
    assert len(loops) == 2  # the forward's tile loop, once per layer
    loss.backward()
    # backward: one tile loop per layer; the recompute re-enters the function to save x and
    # stops there (early stop), so no third and fourth forward tile loop
    assert len(loops) == 4


def test_compiled_layers_keep_working():
    ref, tiled = tiny(), tiny()
    for m in (ref, tiled):
        apply_activation_checkpointing(m, "full")
    T.apply_mlp_tiles(tiled, 2)
    compile_layers(tiled, backend="eager")
    _, ga = grads_of(ref)
    _, gb = grads_of(tiled)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-5, msg=name)


def test_eval_and_no_grad_use_the_module_forward():
    model = tiny()
    T.apply_mlp_tiles(model, 4)
    with torch.no_grad():
        model(input_ids=IDS)
    model.eval()
    model(input_ids=IDS)  # neither call goes through the tiled function (nothing to check but no error)


def test_untiling_restores_the_forward_and_bad_input_is_refused():
    model = tiny()
    T.apply_mlp_tiles(model, 4)
    T.apply_mlp_tiles(model, 2)
    assert model.model.layers[0].mlp.forward._pgs_mlp_tiles == 2
    assert T.apply_mlp_tiles(model, 0) == 0
    assert "forward" not in model.model.layers[0].mlp.__dict__
    with pytest.raises(InvalidArgument, match="tiles"):
        T.apply_mlp_tiles(model, -1)
    model.model.layers[1].mlp.gate_proj = torch.nn.Linear(32, 80, bias=True)
    with pytest.raises(InvalidArgument, match="decoder layer 1"):
        T.apply_mlp_tiles(model, 2)
