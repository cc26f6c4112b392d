"""GradientRelease's fused path (one update-and-apply kernel per tensor, in place) equals its
plain path (the chain's ``update`` then ``θ + u``).

On the CPU the Triton kernels run in Triton's interpreter (the root conftest sets
``TRITON_INTERPRET=1``): ``backend="triton"`` for the 8-bit chains, ``KernelConfig(triton_on_cpu=True)``
for the AdamW/Lion kernels of ``pgs.func.fused_adamw_lion``.  Sizes stay tiny (the interpreter is slow).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import pgs.func as pf
from pgs.func import kernels as K
from pgs.runtime.optim.bound import bind
from pgs.runtime.optim.release import GradientRelease
from test_release import batches, loss_of, run_release, tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def lion8(**kw):
    return pf.lion8bit(1e-3, weight_decay=0.1, block_size=64, min_8bit_size=256, backend="triton", **kw)


def adam8(**kw):
    return pf.adamw8bit(1e-2, weight_decay=0.1, block_size=64, min_8bit_size=256, backend="triton", **kw)


@pytest.mark.parametrize("make", [lion8, adam8], ids=["lion8bit", "adamw8bit"])
def test_8bit_fused_equals_plain_fp32(make):
    data = batches(3)
    a = tiny_model(layers=1).to(DEV)
    b = copy.deepcopy(a)
    plain = run_release(a, make(), [x.to(DEV) for x in data], fused=False)
    fast = run_release(b, make(), [x.to(DEV) for x in data])
    assert plain.fused_group_steps == 0 and fast.plain_group_steps == 0 and fast.fused_group_steps > 0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    # the state is the chain's own: same leaves, same values
    sa, sb = plain.state_dict(), fast.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        if sa[k].dtype == torch.uint8 and k.endswith(".codes"):
            assert (sa[k].int() - sb[k].int()).abs().max() <= 1, k  # a code may sit on a midpoint
        else:
            torch.testing.assert_close(sb[k], sa[k], rtol=1e-5, atol=1e-6, msg=k)
    assert fast.counts() == {3}


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_adamw_lion_kernels_equal_bind(name, monkeypatch):
    """GradientRelease with the fused AdamW/Lion kernels against ``bind`` (the reference chain).

    Lion: the two fp32 runs agree to rounding (a sign flips only where c ≈ 0).  AdamW: three
    steps of a transformer amplify rounding differences chaotically (Adam divides each
    gradient by its own scale, so an ulp moved upstream becomes a relative change of the
    smallest gradients, and η times that of the step), so the two fp32 runs are compared
    against an fp64 run of the reference instead: the fused path's error must be of the size
    of the reference path's own fp32 error (RMS and max over every tensor).  A systematic
    bias is not: computing 1 − β from an fp32 β in the kernel (what the GPU did before the
    hyperparameters became a float64-derived tensor) gave 20× the RMS error on every tensor.
    """
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    make = {"adamw": lambda: pf.adamw(1e-2, weight_decay=0.1), "lion": lambda: pf.lion(1e-3, weight_decay=0.1)}[name]
    data = [x.to(DEV) for x in batches(3)]

    def run_bind(model):
        opt = bind(make(), model)
        for ids in data:
            loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
        return model

    a = run_bind(tiny_model().to(DEV))
    b = tiny_model().to(DEV)
    fast = run_release(b, make(), data)
    assert fast.fused_group_steps > 0 and fast.plain_group_steps == 0
    if name == "lion":
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
        return
    r = run_bind(tiny_model().to(DEV).double())
    for (n, p), q, x in zip(a.named_parameters(), b.parameters(), r.parameters()):
        e_ref, e_fused = p.double() - x, q.double() - x
        rms_ref, rms_fused = e_ref.pow(2).mean().sqrt().item(), e_fused.pow(2).mean().sqrt().item()
        max_ref, max_fused = e_ref.abs().max().item(), e_fused.abs().max().item()
        assert rms_fused <= 2 * rms_ref + 2e-9, (n, rms_fused, rms_ref)
        assert max_fused <= 4 * max_ref + 2e-7, (n, max_fused, max_ref)


def _constant_grad_run(fused: bool, steps: int, sr: bool):
    """Two bf16 tensors at 1.0 with gradient +1: Lion steps each by −lr, below half a bf16 ulp."""
    torch.manual_seed(0)
    params = {f"w{i}": torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16, device=DEV)) for i in range(2)}
    rel = GradientRelease(pf.lion8bit(1e-4, backend="triton"), params, groups="parameter",
                          stochastic_rounding=sr, fused=fused)
    for _ in range(steps):
        sum(p.float().sum() for p in params.values()).backward()
    return rel, params


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_bf16_stochastic_rounding_is_unbiased(fused):
    steps = 12
    rel, params = _constant_grad_run(fused, steps, sr=True)
    assert (rel.fused_group_steps > 0) == fused
    expected = 1.0 - steps * 1e-4  # 0.9988: between the bf16 neighbours 0.99609375 and 1.0
    for p in params.values():
        mean = p.float().mean().item()
        assert abs(mean - expected) < 3e-4, mean  # sd of the mean ≈ 3e-5
    # every tensor of a step draws its own random bits (release groups included)
    assert not torch.equal(params["w0"], params["w1"])
    if not fused or torch.cuda.is_available():  # Triton's CPU interpreter truncates bf16 stores
        _, nearest = _constant_grad_run(fused, steps, sr=False)
        assert all(torch.equal(p, torch.ones_like(p)) for p in nearest.values())  # round-to-nearest freezes


def test_master_weights_fused():
    data = [x.to(DEV) for x in batches(2)]
    a = tiny_model(torch.bfloat16, layers=1).to(DEV)
    b = copy.deepcopy(a)
    plain = run_release(a, lion8(), data, master_weights="fp32", fused=False)
    fast = run_release(b, lion8(), data, master_weights="fp32")
    assert fast.fused_group_steps > 0
    for n, p in b.named_parameters():
        torch.testing.assert_close(fast.masters[n], plain.masters[n], rtol=1e-5, atol=1e-6, msg=n)
        assert torch.equal(p, fast.masters[n].to(torch.bfloat16))
