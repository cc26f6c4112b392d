"""The fused AdamW / Lion Triton kernels (pgs.func.fused) equal the reference chain.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by the root conftest) when
PGS_TRITON_ON_CPU=1; on CUDA they run compiled.
"""

import copy
import os

import pytest
import torch

import pgs.func as pf
from pgs.func import fused
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
    monkeypatch.setenv("PGS_TRITON_ON_CPU", "1")
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
    assert ref.last_metrics()["lr"] == pytest.approx(fast.last_metrics()["lr"])


def test_match_recognises_only_exact_chains():
    assert fused.match(pf.adamw(1e-3)) is not None
    assert fused.match(pf.lion(1e-3, weight_decay=0.0)) is not None
    assert fused.match(pf.chain(pf.clip_by_global_norm(1.0), pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3))) is None
    assert fused.match(pf.chain(pf.scale_by_adam(eps_root=1e-8), pf.scale_by_learning_rate(1e-3))) is None
    assert fused.match(pf.scale_by_adam()) is None


def test_not_used_on_cpu_unless_asked(monkeypatch):
    monkeypatch.delenv("PGS_TRITON_ON_CPU", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    opt = bind(pf.adamw(1e-3), _model(), compile=True, jit=False)
    assert not opt.flat.uses_fused_kernel()
