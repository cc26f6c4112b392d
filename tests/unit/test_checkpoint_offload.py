"""Checkpointing with the layer inputs offloaded to host memory (``apply_activation_checkpointing(...,
offload=True)``): the same loss and gradients bit for bit, the input not kept on the device
after forward, one compiled graph, and gradient release still exact."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.runtime.optim.bound import bind
from pgs.runtime.model.layers import (
    OffloadedInput,
    apply_activation_checkpointing,
    compile_layers,
    decoder_layers,
    remove_activation_checkpointing,
)
from pgs.runtime.optim.release import GradientRelease
from test_checkpointing import IDS, loss_and_grads, tiny_model


@pytest.mark.parametrize("policy", ["full", "sublayer"])
@pytest.mark.parametrize("compiled", [False, True])
def test_offload_keeps_loss_and_grads(compiled, policy):
    ref_loss, ref_grads, _ = loss_and_grads(tiny_model())
    model = tiny_model()
    assert apply_activation_checkpointing(model, policy, offload=True) == [0, 1, 2]
    if compiled:
        torch._dynamo.reset()
        compile_layers(model, backend="eager")
    loss, grads, _ = loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_compiled_offload_is_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    apply_activation_checkpointing(model, "full", offload=True)
    compile_layers(model, backend="eager")
    loss_and_grads(model)
    loss_and_grads(model)
    # two for all layers: the forward's graph (no autograd, checkpointing._Recompute) and the
    # recompute's (its input requires grad as the original's)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("offload", [False, True])
def test_offloaded_input_is_not_kept(offload):
    model = tiny_model()
    apply_activation_checkpointing(model, "full", offload=offload)
    seen = []
    decoder_layers(model)[1].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(weakref.ref(args[0])), with_kwargs=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    gc.collect()
    assert (seen[0]() is None) == offload  # without offload the checkpoint keeps its input
    loss.backward()


def test_offload_needs_full_policy():
    with pytest.raises(InvalidArgument, match="offload=True needs policy"):
        apply_activation_checkpointing(tiny_model(), "selective", offload=True)


def test_offload_is_undone_by_remove():
    model = tiny_model()
    apply_activation_checkpointing(model, "full", offload=True)
    remove_activation_checkpointing(model)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_offloaded_input_handle():
    x = torch.randn(3, 4, requires_grad=True)
    held = OffloadedInput(x)
    assert held.get() is x
    held.release()
    y = held.get()
    assert y is not x and torch.equal(y, x.detach()) and y.requires_grad and y.is_leaf


def test_recompute_of_a_layer_prefetches_the_layer_before():
    xs = [torch.randn(2, 3) for _ in range(3)]
    held = [OffloadedInput(x) for x in xs]  # one forward: layers 0, 1, 2
    for h in held:
        h.release()
    assert all(h.ready is None for h in held)
    y2 = held[2].get()  # backward starts at the last layer ...
    assert held[1].ready is not None and held[0].ready is None  # ... and starts layer 1's copy
    y1 = held[1].get()
    assert held[1].ready is None and held[0].ready is not None
    y0 = held[0].get()
    for y, x in zip((y0, y1, y2), xs):
        assert torch.equal(y, x)
    assert torch.equal(held[0].get(), xs[0])  # asked again: a fresh copy


def test_prefetch_depth_starts_that_many_layers_ahead():
    xs = [torch.randn(2, 3) for _ in range(5)]
    held = [OffloadedInput(x, depth=2) for x in xs]  # one forward: layers 0..4
    for h in held:
        h.release()
    held[4].get()  # backward's first layer starts the copies of layers 3 and 2
    assert [h.ready is not None for h in held] == [False, False, True, True, False]
    held[3].get()  # then each layer starts the one two below it (3's own copy is taken)
    assert [h.ready is not None for h in held] == [False, True, True, False, False]
    ys = [held[i].get() for i in (2, 1, 0)]
    for y, x in zip(ys, (xs[2], xs[1], xs[0])):
        assert torch.equal(y, x)


@pytest.mark.parametrize("policy", ["full", "sublayer"])
def test_prefetch_depth_keeps_loss_and_grads(policy):
    ref_loss, ref_grads, _ = loss_and_grads(tiny_model())
    model = tiny_model()
    apply_activation_checkpointing(model, policy, offload=3)
    loss, grads, _ = loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    with pytest.raises(InvalidArgument, match="layers to fetch ahead"):
        apply_activation_checkpointing(tiny_model(), policy, offload=-1)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fast", [True, False], ids=["recompute", "torch-checkpoint"])
@pytest.mark.parametrize("policy", ["full", "sublayer"])
def test_offload_on_cuda_keeps_loss_and_grads(policy, fast):
    """The CUDA path (pinned copies out and back on the side stream, prefetched one layer
    ahead) gives the unchecked model's loss and gradients, over two steps (the second reuses
    the first step's freed blocks)."""

    def run(model):
        out = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=IDS.cuda(), labels=IDS.cuda()).loss
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        return out

    ref = run(tiny_model().cuda())
    model = tiny_model().cuda()
    apply_activation_checkpointing(model, policy, offload=True, fast_recompute=fast)
    got = run(model)
    # torch's checkpoint recomputes in grad mode as the reference ran: bit for bit. The
    # recompute's forward ran without autograd, where SDPA may pick another kernel: ulps.
    tol = dict(rtol=0, atol=0) if not fast else dict(rtol=1e-5, atol=1e-6)
    for (la, ga), (lb, gb) in zip(got, ref):
        torch.testing.assert_close(la, lb, **tol)
        for n in gb:
            torch.testing.assert_close(ga[n], gb[n], **tol, msg=n)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_inputs_reuse_exactly_sized_page_locked_buffers(monkeypatch):
    """The inputs' host copies come from ``HOST_POOL``: after the first step no buffer is made
    again, and each holds its input's bytes, not the pinned allocator's next power of two."""
    from pgs.runtime.model import layers as layers_mod
    from pgs.runtime.pinned import HostPool

    pool = HostPool()  # the process's pool already holds buffers of earlier tests
    monkeypatch.setattr(layers_mod, "HOST_POOL", pool)
    model = tiny_model().cuda()
    apply_activation_checkpointing(model, "sublayer", offload=True)
    made = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(input_ids=IDS.cuda(), labels=IDS.cuda()).loss.backward()
        gc.collect()
        made.append(pool.made)
    torch.cuda.synchronize()
    layers = len(decoder_layers(model))
    hidden = model.config.hidden_size
    assert 0 < made[0] <= 2 * layers and made[1] == made[2] == made[0]
    assert pool.bytes == made[0] * IDS.numel() * hidden * 4  # fp32 inputs, exact size


@pytest.mark.parametrize("policy", ["full", "sublayer"])
def test_profile_predicts_the_host_bytes_the_offloaded_inputs_hold(policy):
    """``pgs profile``'s ``host_inputs`` equals the host copies alive between forward and
    backward (every checkpointed layer's kept inputs)."""
    from pgs.runtime.tools.profile import offloaded_input_bytes, predict_memory

    model = tiny_model()
    apply_activation_checkpointing(model, policy, offload=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    held, ref = [], OffloadedInput._last[IDS.device]  # the forward's handles, newest first
    while ref is not None and ref() is not None:
        held.append(ref())
        ref = held[-1].previous
    host = sum(o.host.numel() * o.host.element_size() for o in held)
    loss.backward()
    want = offloaded_input_bytes(model.config, IDS.numel(), dtype=torch.float32, policy=policy)
    assert host == want > 0
    pred = predict_memory(model.config, dtype=torch.float32, chain=pf.lion(1e-4), gradient_release=True,
                          activation_checkpointing=policy, checkpoint_offload=1, micro_batch_tokens=IDS.numel())
    assert pred["host_inputs"] == want
    assert "host_inputs" not in predict_memory(model.config, dtype=torch.float32, chain=pf.lion(1e-4),
                                               activation_checkpointing=policy, micro_batch_tokens=IDS.numel())
