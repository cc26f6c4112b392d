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


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_adamw_lion_fused_step_rounds_with_the_documented_noise(name, monkeypatch):
    """The fused AdamW/Lion step on bf16 tensors with stochastic rounding (a release group's
    per-tensor tree, ``sr_offset`` 5): tensor i is exactly its fp32 result (the same step on fp32
    copies) rounded by ``stochastic_round_fp32`` with the seed ``sr_seed(new count, 5 + i)``,
    i.e. the noise ``pf.apply_updates`` draws on the plain path."""
    from pgs.func.apply import stochastic_round_fp32
    from pgs.func.kernels.fused_transform import sr_seeds
    from pgs.func.plan import RELEASE, plan_for
    from pgs.func.step import StepContext

    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    f32 = torch.float32
    chain = {"adamw": pf.adamw(1e-2, weight_decay=0.1, mu_dtype=f32, nu_dtype=f32),
             "lion": pf.lion(1e-3, weight_decay=0.1, mu_dtype=f32)}[name]
    plan = plan_for(chain, RELEASE)
    assert plan is not None and plan.name == "adamw_lion"
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (64, 48), "b": (700,), "c": (3, 5, 7)}
    bf = {k: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16).to(DEV) for k, s in shapes.items()}
    grads = {k: (torch.randn(s, generator=gen) * 1e-3).to(torch.bfloat16).to(DEV) for k, s in shapes.items()}
    fp = {k: v.float() for k, v in bf.items()}
    state = chain.init(fp)  # fp32 moments
    for _ in range(2):  # the second step has non-zero moments and bias corrections below 1
        fp_in = {k: v.float() for k, v in bf.items()}
        new_fp, _ = plan.step(grads, state, fp_in, ctx=StepContext(sr_offset=5), donate=False,
                              memory=pf.MemoryOptions(stochastic_rounding=True))  # fp32 tensors: nothing to round; state untouched
        new_bf, state = plan.step(grads, state, bf, ctx=StepContext(sr_offset=5), donate=True,
                                  memory=pf.MemoryOptions(stochastic_rounding=True))
        seeds = sr_seeds(pf.apply.step_count(state), 5, len(bf))
        moved = 0
        for i, k in enumerate(bf):
            want = stochastic_round_fp32(new_fp[k], seed=seeds[i:i + 1]).to(torch.bfloat16)
            assert torch.equal(new_bf[k], want), k
            moved += int((new_bf[k] != fp_in[k].to(torch.bfloat16)).sum())
        assert moved > sum(v.numel() for v in bf.values()) // 2
        bf = new_bf


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_release_rounds_adamw_lion_stochastically_in_the_kernel(name, monkeypatch):
    """Gradient release with bf16 weights and stochastic rounding takes the fused AdamW/Lion step
    (it fell back to the plain chain before).  Against the plain path from the same weights: the
    same noise, and fp32 values that differ by the plain chain's rounding of the update η·u to
    the gradients' bf16 (the kernel keeps it in fp32): at most a bf16 ulp of the weight and one of
    the update apart (near 0, where θ and η·u cancel, the kernel keeps digits the plain path
    loses)."""
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    f32 = torch.float32
    lr = {"adamw": 1e-2, "lion": 1e-3}[name]
    make = {"adamw": lambda: pf.adamw(lr, mu_dtype=f32, nu_dtype=f32), "lion": lambda: pf.lion(lr, mu_dtype=f32)}[name]
    data = [x.to(DEV) for x in batches(1)]
    a = tiny_model(torch.bfloat16, layers=1).to(DEV)
    b = copy.deepcopy(a)
    plain = run_release(a, make(), data, memory=pf.MemoryOptions(stochastic_rounding=True), fused=False)
    fast = run_release(b, make(), data, memory=pf.MemoryOptions(stochastic_rounding=True))
    assert plain.fused_group_steps == 0 and fast.plain_group_steps == 0 and fast.fused_group_steps > 0
    eps = torch.finfo(torch.bfloat16).eps
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        bound = eps * (torch.maximum(p.float().abs(), q.float().abs()) + lr)
        assert ((p.float() - q.float()).abs() <= 1.01 * bound).all(), n


def _constant_grad_run(fused: bool, steps: int, sr: bool, chain=None):
    """Two bf16 tensors at 1.0 with gradient +1: Lion steps each by −lr, below half a bf16 ulp."""
    torch.manual_seed(0)
    params = {f"w{i}": torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16, device=DEV)) for i in range(2)}
    rel = GradientRelease(chain or pf.lion8bit(1e-4, backend="triton"), params, groups="parameter",
                          memory=pf.MemoryOptions(stochastic_rounding=sr), fused=fused)
    for _ in range(steps):
        sum(p.float().sum() for p in params.values()).backward()
    return rel, params


def test_lion_kernel_stochastic_rounding_is_unbiased(monkeypatch):
    """The fp32-state Lion kernel's rounding: the mean weight follows the exact trajectory."""
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    steps = 12
    rel, params = _constant_grad_run(True, steps, sr=True, chain=pf.lion(1e-4))
    assert rel.fused_group_steps > 0 and rel.plain_group_steps == 0
    for p in params.values():
        assert abs(p.float().mean().item() - (1.0 - steps * 1e-4)) < 3e-4
    assert not torch.equal(params["w0"], params["w1"])


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
