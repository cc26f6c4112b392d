"""Activation checkpointing and per-layer compile: same loss and gradients, less kept, and
gradient release still exact when layers are recomputed inside backward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pgs.func as pf
from pgs.errors import InvalidArgument, MissingExtra
from pgs.runtime.optim.bound import bind
from pgs.runtime.model.layers import (
    apply_activation_checkpointing,
    apply_liger,
    compile_layers,
    decoder_layers,
    remove_activation_checkpointing,
)
from pgs.runtime.optim.release import GradientRelease
from tiny import tiny_model as build_tiny

VOCAB = 96


def tiny_model(layers=3, seed=0):
    # use_cache stays True: the wrapper must drop the cache
    return build_tiny(seed=seed, num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=True,
                      attn_implementation="sdpa")


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
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, counter.ops


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


@pytest.mark.parametrize("fast", [True, False], ids=["recompute", "torch-checkpoint"])
@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_compile_layers_keeps_results_with_one_graph(checkpoint_first, fast):
    """One graph serves every layer: one per grad mode with ``_Recompute`` (its forward runs
    without autograd, its recompute with), one with ``torch.utils.checkpoint``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    ref_loss, ref_grads, _ = loss_and_grads(model)
    if checkpoint_first:
        apply_activation_checkpointing(model, "full", fast_recompute=fast)
    assert compile_layers(model, backend="eager") == 3
    if not checkpoint_first:
        apply_activation_checkpointing(model, "full", fast_recompute=fast)
    loss, grads, _ = loss_and_grads(model)
    assert counters["stats"]["unique_graphs"] == (2 if fast else 1)  # not one per layer
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


@pytest.mark.parametrize("policy", ["full", "sublayer"])
def test_rng_state_kept_only_for_models_that_draw(policy, monkeypatch):
    """A model with dropout recomputes with the forward's masks (the RNG state is saved and
    restored); without the saved state its gradients would differ, which the last part checks.
    A model without dropout skips the save (``_pgs_rng`` False) and still matches."""
    import pgs.runtime.model.layers as ckpt

    plain = tiny_model()
    assert not ckpt.model_draws_random(plain)
    apply_activation_checkpointing(plain, policy)
    assert all(layer.forward._pgs_rng is False for layer in decoder_layers(plain))

    def run(model):
        torch.manual_seed(5)
        return loss_and_grads(model)

    def dropout_model():
        m = tiny_model()
        m.config.attention_dropout = 0.3
        for layer in decoder_layers(m):
            layer.self_attn.attention_dropout = 0.3
        return m

    model = dropout_model()
    assert ckpt.model_draws_random(model)
    ref_loss, ref_grads, _ = run(model)
    apply_activation_checkpointing(model, policy)
    assert all(layer.forward._pgs_rng is True for layer in decoder_layers(model))
    loss, grads, _ = run(model)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n

    monkeypatch.setattr(ckpt, "model_draws_random", lambda m: False)
    unsaved = dropout_model()
    apply_activation_checkpointing(unsaved, policy)
    _, bad, _ = run(unsaved)
    assert any(not torch.equal(bad[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
@pytest.mark.parametrize("policy", ["full", "sublayer"])
def test_recompute_path_taken_and_exact(policy, offload, monkeypatch):
    """``_Recompute`` (forward without autograd, graph rebuilt in backward) runs once per
    checkpointed call and gives the unchecked model's loss and gradients bit for bit; with a
    frozen embedding the first layer's input needs no gradient, so that call falls back to
    ``torch.utils.checkpoint`` and its parameters still get theirs."""
    import pgs.runtime.model.layers as ckpt

    calls = []
    real = ckpt._Recompute.apply
    monkeypatch.setattr(ckpt._Recompute, "apply", lambda *a: calls.append(1) or real(*a))
    model = tiny_model()
    ref_loss, ref_grads, _ = loss_and_grads(model)
    apply_activation_checkpointing(model, policy, offload=offload)
    loss, grads, _ = loss_and_grads(model)
    n_calls = 3 * (2 if policy == "sublayer" else 1)
    assert len(calls) == n_calls
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n

    frozen = tiny_model()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    ref_loss, ref_grads, _ = loss_and_grads(frozen)
    apply_activation_checkpointing(frozen, policy, offload=offload)
    calls.clear()
    loss, grads, _ = loss_and_grads(frozen)
    assert len(calls) == n_calls - 1 and torch.equal(loss, ref_loss)  # the first call's input needs no gradient
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_recompute_refuses_autograd_grad_with_a_clear_message():
    """``torch.autograd.grad`` cannot see the parameters' gradients of a nested backward: the
    recompute says so instead of returning wrong gradients; ``fast_recompute=False`` works."""
    model = tiny_model()
    apply_activation_checkpointing(model, "full")
    params = [p for p in model.parameters()]
    with pytest.raises(RuntimeError, match="fast_recompute=False"):
        torch.autograd.grad(model(input_ids=IDS, labels=IDS).loss, params)
    twin = tiny_model()
    ref = torch.autograd.grad(twin(input_ids=IDS, labels=IDS).loss, list(twin.parameters()))
    apply_activation_checkpointing(model, "full", fast_recompute=False)
    got = torch.autograd.grad(model(input_ids=IDS, labels=IDS).loss, params)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_recompute_passes_tuple_outputs_through():
    """A layer returning ``(hidden, None)`` (older transformers layers did) goes through the
    recompute with the same loss and gradients as unchecked."""
    model = tiny_model()
    ref_loss, ref_grads, _ = loss_and_grads(model)
    layers = decoder_layers(model)
    for layer in layers:
        plain = layer.forward

        def as_tuple(*a, _f=plain, **k):
            return (_f(*a, **k), None)
        layer.forward = as_tuple
    apply_activation_checkpointing(model, "full")
    for layer in layers:
        wrapped = layer.forward
        layer.forward = lambda *a, _w=wrapped, **k: _w(*a, **k)[0]
    loss, grads, _ = loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_recompute_frees_its_output_before_the_nested_backward(monkeypatch):
    """The recomputed layer output is not needed by its own backward: it must be gone while
    the nested backward runs (checked from a parameter's gradient hook, which fires inside it).
    Keeping it (as a leftover reference did) holds one activation more at the peak; the
    second half of the test keeps it on purpose and sees the check fail."""
    import weakref

    import pgs.runtime.model.layers as ckpt

    def run(keep: list | None):
        model = tiny_model()
        refs, alive = [], []
        for layer in decoder_layers(model):
            plain = layer.forward

            def recording(*a, _f=plain, **k):
                out = _f(*a, **k)
                if torch.is_grad_enabled():  # the recompute (the forward runs without autograd)
                    refs.append(weakref.ref(out))
                return out
            layer.forward = recording
            layer.mlp.down_proj.weight.register_post_accumulate_grad_hook(
                lambda p: alive.append(refs[-1]() is not None))
        apply_activation_checkpointing(model, "full")
        if keep is not None:
            real = ckpt._gradient_edges
            monkeypatch.setattr(ckpt, "_gradient_edges", lambda outs, grads: keep.append(outs) or real(outs, grads))
        model(input_ids=IDS, labels=IDS).loss.backward()
        return alive

    assert run(None) == [False, False, False]
    assert run([]) == [True, True, True]


def test_model_draws_random_reads_modules_and_configs():
    """Dropout modules with p > 0 and ``*dropout*`` rates above 0 count; p = 0, booleans and
    other names do not."""
    from types import SimpleNamespace

    from pgs.runtime.model.layers import model_draws_random

    class Net(torch.nn.Module):
        def __init__(self, p=0.0, **attrs):
            super().__init__()
            self.drop = torch.nn.Dropout(p)
            self.lin = torch.nn.Linear(2, 2)
            for k, v in attrs.items():
                setattr(self, k, v)

    assert not model_draws_random(Net())
    assert model_draws_random(Net(0.1))
    assert not model_draws_random(Net(use_dropout=True, dropout_seed=0))
    assert model_draws_random(Net(hidden_dropout=0.2))
    assert not model_draws_random(Net(rate=0.5))
    net = Net()
    net.config = SimpleNamespace(attention_dropout=0.0, text_config=SimpleNamespace(resid_dropout=0.1))
    assert model_draws_random(net)
    net.config.text_config.resid_dropout = 0.0
    assert not model_draws_random(net)
