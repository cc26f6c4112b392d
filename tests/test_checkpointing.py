"""Activation checkpointing and per-layer compile: same loss and gradients, less kept, and
gradient release still exact when layers are recomputed inside backward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pgs.func as pf
from pgs.errors import InvalidArgument, MissingExtra
from pgs.runtime.bind import bind
from pgs.runtime.checkpointing import (
    apply_activation_checkpointing,
    apply_liger,
    compile_layers,
    decoder_layers,
    remove_activation_checkpointing,
)
from pgs.runtime.release import GradientRelease

VOCAB = 96


def tiny_model(layers=3, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, tie_word_embeddings=True,
                      attn_implementation="sdpa")  # use_cache stays True: the wrapper must drop the cache
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).train()


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def loss_and_grads(model, count_ops=False):
    model.zero_grad(set_to_none=True)
    counter = OpCounter()
    if count_ops:
        with counter:
            loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
    else:
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counter.ops


@pytest.mark.parametrize("policy, every", [("full", 1), ("selective", 1), ("full", 2), ("selective", 2)])
def test_loss_and_grads_unchanged(policy, every):
    model = tiny_model()
    ref_loss, ref_grads, _ = loss_and_grads(model)
    done = apply_activation_checkpointing(model, policy, every)
    assert done == list(range(0, 3, every))
    loss, grads, _ = loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_recompute_happens_as_the_policy_says():
    model = tiny_model()
    base = loss_and_grads(model, count_ops=True)[2]
    apply_activation_checkpointing(model, "full")
    full = loss_and_grads(model, count_ops=True)[2]
    apply_activation_checkpointing(model, "selective")
    sel = loss_and_grads(model, count_ops=True)[2]
    # full recomputes every layer's matmuls; selective saves them and recomputes the norms
    assert full["mm"] > base["mm"]
    assert sel["mm"] == base["mm"]
    assert sel["rsqrt"] > base["rsqrt"] and full["rsqrt"] > base["rsqrt"]


def test_remove_and_none_restore_the_plain_forward():
    model = tiny_model()
    apply_activation_checkpointing(model, "full")
    remove_activation_checkpointing(model)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    apply_activation_checkpointing(model, "full")
    assert apply_activation_checkpointing(model, "none") == []
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    names = [n for n, _ in model.named_parameters()]
    assert names[1].startswith("model.layers.0.")  # names unchanged


def test_bad_arguments():
    model = tiny_model()
    with pytest.raises(InvalidArgument, match="policy"):
        apply_activation_checkpointing(model, "some")
    with pytest.raises(InvalidArgument, match="every"):
        apply_activation_checkpointing(model, "full", every=0)
    with pytest.raises(InvalidArgument, match="decoder layers"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_compile_layers_keeps_results_with_one_graph(checkpoint_first):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    ref_loss, ref_grads, _ = loss_and_grads(model)
    if checkpoint_first:
        apply_activation_checkpointing(model, "full")
    assert compile_layers(model, backend="eager") == 3
    if not checkpoint_first:
        apply_activation_checkpointing(model, "full")
    loss, grads, _ = loss_and_grads(model)
    assert counters["stats"]["unique_graphs"] == 1  # one graph serves every layer
    assert torch.allclose(loss, ref_loss)
    for n in ref_grads:
        assert torch.allclose(grads[n], ref_grads[n], atol=1e-6), n
    remove_activation_checkpointing(model)  # the compiled forward stays
    assert all(layer.__dict__.get("forward") is not None for layer in decoder_layers(model))


def test_apply_liger_missing_extra():
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtra, match="liger-kernel"):
            apply_liger(tiny_model())
    else:
        pytest.skip("liger-kernel is installed")


@pytest.mark.parametrize("policy,offload", [("full", False), ("selective", False), ("full", True),
                                            ("sublayer", False), ("sublayer", True)])
def test_release_inside_recomputed_backward_is_exact(policy, offload):
    a, b = tiny_model(), tiny_model()
    apply_activation_checkpointing(b, policy, offload=offload)
    opt = bind(pf.adamw(1e-2, weight_decay=0.1), a)
    rel = GradientRelease(pf.adamw(1e-2, weight_decay=0.1), b)
    for _ in range(2):
        a(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
        b(input_ids=IDS, labels=IDS).loss.backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert rel.counts() == {2}
