"""The fused AdamW / Lion Triton kernels (pgs.func.fused_adamw_lion) equal the reference chain.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest) when
KernelConfig(triton_on_cpu=True); on CUDA they run compiled.
"""

import copy
import inspect
import os

import pytest
import torch

import pgs.func as pf
from pgs.func import kernels as K
from pgs.func import fused_adamw_lion as fused
from pgs.runtime import bind

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(DEV)


CHAINS = {
    "adamw": lambda: pf.adamw(1e-2, b2=0.95, weight_decay=0.1),
    "lion": lambda: pf.lion(1e-3, weight_decay=0.1),
    "adam_masked_decay_cosine": lambda: pf.chain(
        pf.scale_by_adam(b2=0.95),
        pf.add_decayed_weights(0.1, mask=lambda p, x: x.ndim >= 2),
        pf.scale_by_learning_rate(pf.cosine_schedule(1e-2, 2, 10)),
    ),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_fused_kernel_equals_reference_over_steps(name, monkeypatch):
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=True))
    m_ref, m_fast = _model(), None
    m_fast = copy.deepcopy(m_ref)
    ref = bind(CHAINS[name](), m_ref)
    fast = bind(CHAINS[name](), m_fast, compile=True, jit=False)
    assert fast.flat.uses_fused_kernel()
    calls = []
    real = fused.step
    monkeypatch.setattr(fused, "step", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(16, 8, device=DEV)
    for _ in range(4):
        for mod, opt in ((m_ref, ref), (m_fast, fast)):
            mod(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert len(calls) == 4  # the kernels really ran (the flag alone once hid that they did not)
    for a, b in zip(m_ref.parameters(), m_fast.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the fused kernel writes the chain's own state: it round-trips into the reference path
    assert ref.metrics().lr == pytest.approx(fast.metrics().lr)


def test_match_recognises_only_exact_chains():
    assert fused.match(pf.adamw(1e-3)) is not None
    assert fused.match(pf.lion(1e-3, weight_decay=0.0)) is not None
    assert fused.match(pf.chain(pf.clip_by_global_norm(1.0), pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3))) is None
    assert fused.match(pf.chain(pf.scale_by_adam(eps_root=1e-8), pf.scale_by_learning_rate(1e-3))) is None
    assert fused.match(pf.scale_by_adam()) is None


def test_not_used_on_cpu_unless_asked(monkeypatch):
    monkeypatch.setattr(K, "CONFIG", K.KernelConfig(triton_on_cpu=False))
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    opt = bind(pf.adamw(1e-3), _model(), compile=True, jit=False)
    assert not opt.flat.uses_fused_kernel()


def test_kernels_take_no_float_scalars():
    """Hyperparameters reach the AdamW/Lion kernels as fp32 device tensors, never as float
    arguments.  A float argument is fp32 on a GPU but a Python double in Triton's CPU
    interpreter, so arithmetic on it in the kernel (``1.0 - b2`` gave 1 − fp32(0.999), 1.3e-5
    off fp32(0.001)) differs between the two and no CPU test sees it."""
    from pgs.func.kernels import elementwise as E

    for k in (E._adamw_kernel, E._lion_kernel):
        fn = getattr(k, "fn", k)
        params = inspect.signature(fn).parameters
        scalars = [a for a, p in params.items()
                   if not a.endswith("_ptr") and a != "n" and "constexpr" not in str(p.annotation)]
        assert scalars == [], scalars


@pytest.mark.parametrize("b1,b2", [(0.9, 0.999), (0.9, 0.9999), (0.95, 0.99999)])
def test_one_adamw_step_matches_reference(b1, b2):
    """One kernel step against ``scale_by_adam`` + decay + lr on the same fp32 inputs: the
    moments to an ulp or two of their scale (not a bias: 1 − β is rounded from float64, as the reference)."""
    from pgs.func.kernels import elementwise as E

    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter")
    gen = torch.Generator().manual_seed(0)
    n = 3 * E.BLOCK + 17
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    t, lr, wd, eps = 5, 1e-2, 0.1, 1e-8
    st = pf.scale_by_adam(b1=b1, b2=b2, eps=eps)
    state = st.init({"x": p})._replace(count=torch.tensor(t - 1, dtype=torch.int32), mu={"x": m.clone()},
                                       nu={"x": v.clone()})
    u, st2 = st.update({"x": g}, state, {"x": p})
    p_ref = p - lr * (u["x"] + wd * p)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    scal = torch.tensor([lr, bc1, bc2], dtype=torch.float64).float().to(DEV)
    pk, mk, vk = p.to(DEV).clone(), m.to(DEV).clone(), v.to(DEV).clone()
    E.adamw_step_(pk, g.to(DEV), mk, vk, scal, b1, b2, eps, wd)
    # m: lerp (reference) and m + w(g − m) (kernel) round differently where m cancels to ≈ 0
    torch.testing.assert_close(mk.cpu(), st2.mu["x"], rtol=3e-7, atol=3e-7 * float(st2.mu["x"].abs().max()))
    torch.testing.assert_close(vk.cpu(), st2.nu["x"], rtol=3e-7, atol=0)
    torch.testing.assert_close(pk.cpu(), p_ref, rtol=1e-6, atol=1e-8)
