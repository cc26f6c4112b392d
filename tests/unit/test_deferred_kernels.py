"""The deferred head gradient rebuilt with the loss's Triton pass equals the plain chunked loss's
head gradient; ``hp_tensor`` builds the same vector without creating device tensors from numbers.

On the CPU the kernels run in the Triton interpreter (``KernelConfig(triton_on_cpu=True)``), as in
tests/unit/test_losses_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from pgs.func import MemoryOptions
from pgs.func.kernels import fused_transform as F
from pgs.func.losses import chunked, token_loss

pytest.importorskip("triton")


def problem(device, dtype, n=45, d=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * 0.7).to(device, dtype).requires_grad_()
    W = (torch.randn(v, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return h, W, labels.to(device)


@pytest.mark.parametrize("softcap,z_loss,objective", [(None, 0.0, "ce"), (5.0, 1e-3, "ce"), (None, 0.0, "deft")])
def test_deferred_kernel_rebuild_equals_plain(kernels_on, softcap, z_loss, objective):
    h, W, labels = problem(kernels_on, torch.float32)
    kw = dict(backend="chunked", softcap=softcap, z_loss=z_loss, objective=objective, chunk_size=8)
    r = token_loss(h, W, labels, **kw)
    gh_ref, gw_ref = torch.autograd.grad(r.loss_sum * 0.37, (h, W))
    r = token_loss(h, W, labels, memory=MemoryOptions(defer_head_grad=True), **kw)
    (gh,) = torch.autograd.grad(r.loss_sum * 0.37, (h,))
    assert chunked._use_kernels(h, W, r.head_grad._saved[-1], W)
    gw = torch.zeros_like(W)
    r.head_grad.add_to(gw)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_deferred_kernel_rebuild_bf16(kernels_on):
    h, W, labels = problem(kernels_on, torch.bfloat16, n=64, v=500)
    r = token_loss(h.float(), W.float(), labels, backend="chunked", chunk_size=16)
    (gw_ref,) = torch.autograd.grad(r.loss_sum * 0.37, (W,))
    r = token_loss(h, W, labels, backend="chunked", chunk_size=16, memory=MemoryOptions(defer_head_grad=True))
    (r.loss_sum * 0.37).backward()
    gw = torch.zeros_like(W)
    r.head_grad.add_to(gw)
    scale = gw_ref.abs().max()
    assert ((gw.float() - gw_ref).abs().max() / scale) < 2e-2  # bf16 chunks, as the plain bf16 path


def test_hp_tensor_values_without_number_tensors(monkeypatch):
    lr = torch.full((), 3e-5, dtype=torch.float64)
    expected = torch.tensor([0.1, 0.01, 3e-5, 0.0], dtype=torch.float64).to(torch.float32)
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    F._hp_cached.cache_clear()
    assert torch.equal(F.hp_tensor(torch.device("cpu"), 0.1, 0.01, lr, 0.0), expected)
    assert torch.equal(F.hp_tensor(torch.device("cpu"), 0.1, 0.01, lr * 2, 0.0)[2], (lr * 2).float())
    assert len(made) == 1  # the cached vector of numbers, once; no tensor per number per call


@pytest.mark.parametrize("use_kernels", [True, False])
def test_slabs_reuse_chunk_inputs_and_equal_add_to(request, use_kernels):
    """``add_rows_to`` over slabs equals ``add_to`` (rows assembled), and the slab-independent
    per-chunk inputs (hidden rows, labels, coefficients) are built once, not once per slab."""
    dev = request.getfixturevalue("kernels_on") if use_kernels else "cpu"
    h, W, labels = problem(dev, torch.float32, n=45, v=300)
    kw = dict(backend="chunked", chunk_size=8)
    r = token_loss(h, W, labels, memory=MemoryOptions(defer_head_grad=True), **kw)
    (r.loss_sum * 0.37).backward()
    calls = []
    real = chunked.DeferredHeadGrad._chunk_inputs

    def counted(self, *a, **k):
        calls.append(getattr(self, "_inputs", None) is None)
        return real(self, *a, **k)

    chunked.DeferredHeadGrad._chunk_inputs = counted
    try:
        slabs = [(0, 128), (128, 256), (256, 300)]
        got = torch.cat([r.head_grad.add_rows_to(torch.zeros(b - a, W.shape[1], device=W.device), a, b)
                         for a, b in slabs])
    finally:
        chunked.DeferredHeadGrad._chunk_inputs = real
    assert calls == [True, False, False], f"chunk inputs rebuilt per slab: {calls}"
    r2 = token_loss(h, W, labels, memory=MemoryOptions(defer_head_grad=True), **kw)
    (r2.loss_sum * 0.37).backward()
    want = r2.head_grad.add_to(torch.zeros_like(W))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    r.head_grad.discard()
    assert r.head_grad._inputs is None
