"""The chunked loss's two-pass Triton kernels (``pgs.func.losses.triton_ce``) equal the torch path.

On the CPU they run in the Triton interpreter (the root conftest sets TRITON_INTERPRET=1 when
there is no CUDA; ``KernelConfig(triton_on_cpu=True)`` routes the chunked loss through them); on a GPU the
same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from pgs.func import kernels as K

from pgs.func.losses import OBJECTIVES, chunked, token_loss

pytest.importorskip("triton")


def problem(device, n=37, d=16, v=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * 0.7).to(device, dtype).requires_grad_()
    W = (torch.randn(v, d, generator=g) * 0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    doc_ids = torch.arange(n) // 5
    return h, W, labels.to(device), doc_ids.to(device)


def run(h, W, labels, **kw):
    r = token_loss(h, W, labels, backend="chunked", **kw)
    gh, gw = torch.autograd.grad(r.loss_sum * 0.37, (h, W))
    return r, gh, gw


def test_kernel_path_is_taken(kernels_on, monkeypatch):
    h, W, labels, _ = problem(kernels_on)
    calls = []
    real = chunked._kernel_chunk
    monkeypatch.setattr(chunked, "_kernel_chunk", lambda *a: calls.append(1) or real(*a))
    run(h, W, labels, chunk_size=8)
    assert calls, "the Triton path did not run"
    monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(ce_kernels=False))
    calls.clear()
    run(h, W, labels, chunk_size=8)
    assert not calls


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (3.0, 1e-2)])
def test_kernels_equal_torch_path_fp32(kernels_on, monkeypatch, objective, softcap, z_loss):
    h, W, labels, doc_ids = problem(kernels_on)
    kw = dict(objective=objective, softcap=softcap, z_loss=z_loss, chunk_size=16)
    if objective == "cadft":
        kw["doc_ids"] = doc_ids
    fast, fh, fw = run(h, W, labels, **kw)
    monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(ce_kernels=False))
    ref, rh, rw = run(h, W, labels, **kw)
    for field in ("loss_sum", "entropy_sum", "target_prob_sum", "z_loss_sum"):
        torch.testing.assert_close(getattr(fast, field), getattr(ref, field), rtol=2e-5, atol=2e-5)
    assert int(fast.num_valid) == int(ref.num_valid)
    torch.testing.assert_close(fh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fw, rw, rtol=1e-4, atol=1e-5)


def test_kernels_bf16_as_close_to_fp64_as_torch_path(kernels_on, monkeypatch):
    """bf16: the kernel path's error against an fp64 reference is no worse than the torch path's."""
    h, W, labels, _ = problem(kernels_on, n=64, d=32, v=1000, dtype=torch.bfloat16, seed=3)
    h64, W64 = (t.detach().double().requires_grad_() for t in (h, W))
    ref, rh, rw = run(h64, W64, labels, chunk_size=16)
    fast, fh, fw = run(h, W, labels, chunk_size=16)
    monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(ce_kernels=False))
    slow, sh, sw = run(h, W, labels, chunk_size=16)
    for a, b, r in ((fh, sh, rh), (fw, sw, rw)):
        err_fast = (a.double() - r).abs().max().item()
        err_slow = (b.double() - r).abs().max().item()
        assert err_fast <= 2 * err_slow + 1e-6, (err_fast, err_slow)
    assert abs(float(fast.loss_sum) - float(ref.loss_sum)) <= 1e-3 * abs(float(ref.loss_sum))


def test_all_masked_and_no_grad(kernels_on):
    h, W, labels, _ = problem(kernels_on)
    r, gh, gw = run(h, W, torch.full_like(labels, -100), chunk_size=8)
    assert float(r.loss_sum) == 0 and int(r.num_valid) == 0
    assert float(gh.abs().sum()) == 0 and float(gw.abs().sum()) == 0
    with torch.no_grad():
        r = token_loss(h, W, labels, backend="chunked", chunk_size=8)
    assert torch.isfinite(r.loss_sum)


def test_large_logits_and_softcap_limits(kernels_on, monkeypatch):
    """Logits of ±1e4 (online-softmax rescaling across tiles) and a tight softcap stay finite and exact."""
    h, W, labels, _ = problem(kernels_on, v=9000)  # > one 4096-column tile
    with torch.no_grad():
        W.mul_(300.0)
    for softcap in (None, 5.0):
        fast, fh, fw = run(h, W, labels, chunk_size=32, softcap=softcap)
        monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(ce_kernels=False))
        ref, rh, rw = run(h, W, labels, chunk_size=32, softcap=softcap)
        monkeypatch.setattr(K, "CONFIG", K.CONFIG.evolve(ce_kernels=True))
        assert torch.isfinite(fast.loss_sum) and torch.isfinite(fh).all() and torch.isfinite(fw).all()
        torch.testing.assert_close(fast.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-2)
        torch.testing.assert_close(fh, rh, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fw, rw, rtol=1e-4, atol=1e-4)
