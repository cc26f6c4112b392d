"""The ``"sublayer"`` checkpoint policy: a decoder layer's attention half and MLP half are
checkpointed apart.  Same loss and gradients as the unchecked model bit for bit (with and
without offloaded inputs, eager and compiled), one compiled graph per half for all layers,
backward holding one half at a time, gradient release still exact, other layers refused."""

from __future__ import annotations

import pytest
import torch

from pgs.errors import InvalidArgument
from pgs.runtime.model.layers import apply_activation_checkpointing, compile_layers, decoder_layers
from test_checkpointing import IDS, loss_and_grads, tiny_model


# loss and gradients, offloaded and compiled: tests/unit/test_checkpoint_offload.py; release
# exactness: tests/unit/test_checkpointing.py (both parametrized over the policy)


@pytest.mark.parametrize("compiled", [False, True])
def test_sublayer_without_offload_keeps_loss_and_grads(compiled):
    ref_loss, ref_grads, _ = loss_and_grads(tiny_model())
    model = tiny_model()
    assert apply_activation_checkpointing(model, "sublayer") == [0, 1, 2]
    if compiled:
        torch._dynamo.reset()
        compile_layers(model, backend="eager")
    loss, grads, _ = loss_and_grads(model)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_compiled_sublayers_are_two_graphs_for_all_layers():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(layers=4)
    apply_activation_checkpointing(model, "sublayer", offload=True)
    compile_layers(model, backend="eager")
    loss_and_grads(model)
    loss_and_grads(model)
    # the attention half and the MLP half, each as the forward's graph (no autograd,
    # checkpointing._Recompute) and the recompute's
    assert counters["stats"]["unique_graphs"] == 4


def test_backward_recomputes_one_half_at_a_time():
    """Backward recomputes the halves one after the other (MLP half, then attention half), each
    once, so one half's activations exist at a time."""
    model = tiny_model(layers=2)
    apply_activation_checkpointing(model, "sublayer")
    calls = []
    layer = decoder_layers(model)[1]
    attn_fwd, mlp_fwd = layer.self_attn.forward, layer.mlp.forward

    def tag(name, fn):
        def run(*a, **k):
            calls.append((name, torch.is_grad_enabled()))
            return fn(*a, **k)
        return run

    layer.self_attn.forward = tag("attn", attn_fwd)
    layer.mlp.forward = tag("mlp", mlp_fwd)
    loss = model(input_ids=IDS, labels=IDS).loss
    assert [c[0] for c in calls] == ["attn", "mlp"]
    loss.backward()
    # backward recomputes the MLP half first, then the attention half, each once
    assert [c[0] for c in calls] == ["attn", "mlp", "mlp", "attn"]


def test_other_layers_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)).train()
    with pytest.raises(InvalidArgument, match="sublayer"):
        apply_activation_checkpointing(model, "sublayer")
    with pytest.raises(InvalidArgument, match="offload"):
        apply_activation_checkpointing(tiny_model(), "selective", offload=True)


def test_eval_and_no_grad_run_the_layer_as_is():
    model = tiny_model()
    apply_activation_checkpointing(model, "sublayer")
    with torch.no_grad():
        a = model(input_ids=IDS).logits
    model.eval()
    b = model(input_ids=IDS).logits
    assert torch.equal(a, b)
