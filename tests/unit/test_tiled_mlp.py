"""Sequence-tiled gated MLP (``pgs.runtime.model.tiled_mlp``): same outputs and gradients as the
module's own forward, one gradient per weight per backward, no second MLP forward in the
recompute of a checkpointed layer."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.runtime.model import tiled_mlp as T
from pgs.runtime.model.layers import apply_activation_checkpointing, compile_layers
from pgs.runtime.optim.release import GradientRelease
from tiny import tiny_model

CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def tiny(dtype=torch.float32):
    return tiny_model(seed=0, dtype=dtype, **CFG, attn_implementation="sdpa")


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


@pytest.mark.parametrize("act_name", ["silu", "gelu"])  # silu: the fused SwiGLU pass; gelu: autograd
def test_function_gradients_against_fp64(act_name):
    """The tiled function in fp64 equals autograd in fp64; in bf16 it is as close to the fp64
    answer as plain bf16 autograd is (the fused pass rounds once, autograd after every op)."""
    torch.manual_seed(2)
    act = getattr(torch.nn.functional, act_name)

    def ref(x, wg, wu, wd):
        return (act(x @ wg.t()) * (x @ wu.t())) @ wd.t()

    base = [torch.randn(3, 10, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64) / 4,
            torch.randn(40, 16, dtype=torch.float64) / 4, torch.randn(16, 40, dtype=torch.float64) / 6]
    dy = torch.randn(3, 10, 16, dtype=torch.float64)
    x64 = [t.clone().requires_grad_(True) for t in base]
    y64 = ref(*x64)
    g64 = torch.autograd.grad(y64, x64, dy)
    for dtype in (torch.float64, torch.bfloat16):
        xs = [t.to(dtype).requires_grad_(True) for t in base]
        y = T.tiled_gated_mlp(*xs, act, 4)
        got = torch.autograd.grad(y, xs, dy.to(dtype))
        if dtype == torch.float64:
            torch.testing.assert_close(y, y64, atol=1e-12, rtol=1e-12)
            for a_, b_ in zip(got, g64):
                torch.testing.assert_close(a_, b_, atol=1e-12, rtol=1e-12)
            continue
        xb = [t.to(dtype).requires_grad_(True) for t in base]
        yb = ref(*xb)
        plain = torch.autograd.grad(yb, xb, dy.to(dtype))
        assert (y.double() - y64).abs().max() <= 2 * (yb.double() - y64).abs().max() + 1e-3
        for a_, p_, b_ in zip(got, plain, g64):
            assert (a_.double() - b_).abs().max() <= 2 * (p_.double() - b_).abs().max() + 1e-3


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
    if torch.cuda.is_available():  # CPU tensors on a CUDA machine: compile would first touch CUDA inside
        torch.cuda.init()          # the checkpoint's forward, which torch.utils.checkpoint refuses
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernel_matches_the_torch_formulas(monkeypatch, dtype):
    """The Triton pass (the interpreter here, as on CPU CI) against the torch fallback."""
    import os

    from pgs.func import kernels as K
    from pgs.func.kernels import swiglu as S

    if not S.HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1 (set by conftest.py without CUDA)")
    gen = torch.Generator().manual_seed(5)
    g, u, dh = (torch.randn(3, 1001, generator=gen).mul(4).to(dtype) for _ in range(3))
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=flag == "1"))
        assert S._use_triton(g) == (flag == "1")
        fwd = S.swiglu_forward_(g.clone(), u.clone())
        bwd = S.swiglu_backward_(g.clone(), u.clone(), dh.clone())
        outs[flag] = (fwd, *bwd)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2 ** -7)
    for a, b in zip(outs["1"], outs["0"]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    # and the formulas: SiLU(g)·u and its derivatives, against autograd in fp64
    g64, u64 = g.double().requires_grad_(True), u.double().requires_grad_(True)
    h64 = torch.nn.functional.silu(g64) * u64
    dg64, du64 = torch.autograd.grad(h64, (g64, u64), dh.double())
    scale = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(outs["1"][1:], (h64, du64, dg64)):
        torch.testing.assert_close(got.double(), want.detach(), atol=scale * want.abs().max().item(), rtol=scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiled_mlp_against_fp64():
    """The compiled SwiGLU kernel inside the tiled function on the GPU, bf16, against fp64."""
    torch.manual_seed(3)
    dev = "cuda"
    base = [torch.randn(2, 300, 256, dtype=torch.float64, device=dev), torch.randn(1024, 256, dtype=torch.float64, device=dev) / 16,
            torch.randn(1024, 256, dtype=torch.float64, device=dev) / 16, torch.randn(256, 1024, dtype=torch.float64, device=dev) / 32]
    dy = torch.randn(2, 300, 256, dtype=torch.float64, device=dev)
    act = torch.nn.functional.silu

    def ref(x, wg, wu, wd):
        return (act(x @ wg.t()) * (x @ wu.t())) @ wd.t()

    x64 = [t.clone().requires_grad_(True) for t in base]
    y64 = ref(*x64)
    g64 = torch.autograd.grad(y64, x64, dy)
    xs = [t.bfloat16().requires_grad_(True) for t in base]
    y = T.tiled_gated_mlp(*xs, act, 3)
    got = torch.autograd.grad(y, xs, dy.bfloat16())
    xb = [t.bfloat16().requires_grad_(True) for t in base]
    yb = ref(*xb)
    plain = torch.autograd.grad(yb, xb, dy.bfloat16())
    assert (y.double() - y64).abs().max() <= 2 * (yb.double() - y64).abs().max() + 1e-3
    for a_, p_, b_ in zip(got, plain, g64):
        assert (a_.double() - b_).abs().max() <= 2 * (p_.double() - b_).abs().max() + 1e-3
