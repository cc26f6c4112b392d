"""The fused Triton kernels against the torch reference.

On CPU they run in Triton's interpreter: ``TRITON_INTERPRET=1`` is read by ``triton.jit``
when a kernel is *defined*, so it is set here at import (only when there is no GPU, so a
GPU run of the whole suite is not forced into the interpreter) and the kernel module is
reloaded if something imported it before.  Sizes stay tiny: the interpreter is slow.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "pgs.func.kernels.blockwise8" in sys.modules:
        importlib.reload(sys.modules["pgs.func.kernels.blockwise8"])

triton = pytest.importorskip("triton")

import pgs.func as pf  # noqa: E402
from pgs.func import kernels as K  # noqa: E402
from pgs.func.adam8bit import _adam_hp, adam_leaf  # noqa: E402
from pgs.func.lion8bit import lion_leaf  # noqa: E402
from pgs.func.quant8 import dynamic_map, quantize_blockwise  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B = 64


def _moment(n, signed, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.empty(n // B + 1).uniform_(-6, 0, generator=g).repeat_interleave(B)[:n]
    return quantize_blockwise(x if signed else x.abs(), dynamic_map(signed), B)


def _to(q, dev):
    return pf.Quantized8bit(q.codes.to(dev), q.absmax.to(dev))


def _assert_codes_close(a, b):
    """Codes equal except where an FMA moved a value across a midpoint (≤ 1 code, rare)."""
    diff = (a.codes.int() - b.codes.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 0.01
    torch.testing.assert_close(a.absmax, b.absmax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [5 * B, 5 * B + 7])
def test_lion_direction_matches_reference(n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    m = _moment(n, True, 1)
    u, m_new = K.lion8bit(g.to(DEV), _to(m, DEV), torch.tensor([0.1, 0.01], device=DEV), B)
    u_r, m_r = lion_leaf(g, m, 0.1, 0.01, B)
    assert torch.equal(u.cpu(), u_r)
    _assert_codes_close(_to(m_new, "cpu"), m_r)


@pytest.mark.parametrize("n", [4 * B, 4 * B + 3])
def test_adam_direction_matches_reference(n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    m, v = _moment(n, True, 1), _moment(n, False, 2)
    bc1 = torch.tensor(1 - 0.9**3, dtype=torch.float64)
    bc2 = torch.tensor(1 - 0.999**3, dtype=torch.float64)
    hp = _adam_hp(torch.device(DEV), 0.9, 0.999, 1e-8, 0.0, bc1, bc2)
    u, m2, v2 = K.adam8bit(g.to(DEV), _to(m, DEV), _to(v, DEV), hp, B)
    u_r, m_r, v_r = adam_leaf(g, m, v, 0.9, 0.999, 1e-8, 0.0, bc1, bc2, B)
    torch.testing.assert_close(u.cpu(), u_r, rtol=1e-5, atol=1e-6)
    _assert_codes_close(_to(m2, "cpu"), m_r)
    _assert_codes_close(_to(v2, "cpu"), v_r)


@pytest.mark.parametrize("make", [
    lambda be: pf.lion8bit(1e-2, weight_decay=0.1, mask=lambda p, x: x.ndim >= 2, block_size=B, min_8bit_size=200, backend=be),
    lambda be: pf.adamw8bit(1e-2, weight_decay=0.1, block_size=B, min_8bit_size=200, backend=be),
])
@pytest.mark.parametrize("donate", [False, True])
def test_fused_step_matches_generic_chain(make, donate):
    """pf.compile(...).step through the fused hook equals the unfused chain (fp32 params)."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 40, generator=gen), "b": torch.randn(10, generator=gen),
              "v": torch.randn(300, generator=gen)}
    fused = pf.compile(make("triton"), jit=False, donate=donate)
    plain = pf.compile(make("torch"), jit=False)
    pa = {k: v.clone().to(DEV) for k, v in params.items()}
    pb = {k: v.clone() for k, v in params.items()}
    sa, sb = fused.init(pa), plain.init(pb)
    for _ in range(3):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        pa, sa = fused.step({k: x.to(DEV) for k, x in g.items()}, sa, pa)
        pb, sb = plain.step(g, sb, pb)
    for k in params:
        torch.testing.assert_close(pa[k].cpu(), pb[k], rtol=1e-5, atol=1e-6)
    da, db = pf.state_to_dict(sa), pf.state_to_dict(sb)
    assert list(da) == list(db)
    for k in da:
        if da[k].dtype == torch.uint8:
            assert int((da[k].cpu().int() - db[k].int()).abs().max()) <= 1, k
        else:
            torch.testing.assert_close(da[k].cpu(), db[k], rtol=1e-5, atol=1e-7, msg=k)


def test_stochastic_rounding_is_unbiased():
    """Mean over many draws of the bf16 parameter equals the fp32 update (to 1% of an ulp·√n)."""
    n, draws = 4 * B, 64
    p = torch.full((n,), 1.0, dtype=torch.bfloat16, device=DEV)  # bf16 ulp at 1.0 is 2^-7
    g = torch.ones(n, device=DEV)
    m = _to(quantize_blockwise(torch.zeros(n), dynamic_map(True), B), DEV)
    lr = 2.0**-9  # a quarter of an ulp: nearest rounding would never move the weight
    hp = torch.tensor([0.1, 0.01, lr, 0.0], device=DEV)
    acc = torch.zeros(n, dtype=torch.float64, device=DEV)
    for s in range(draws):
        out, _ = K.lion8bit(g, m, hp, B, p=p, seed=torch.tensor([s], device=DEV))
        acc += out.double()
    mean = float(acc.mean()) / draws
    want = 1.0 - lr
    ulp = 2.0**-8  # below 1.0 the bf16 ulp is 2^-8
    assert abs(mean - want) < 4 * ulp / (n * draws) ** 0.5 * 0.5 + 1e-4
    assert set(out.float().unique().tolist()) <= {1.0, 1.0 - ulp}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_backend_picks_triton_and_matches_reference():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(256, 256, generator=gen), "b": torch.randn(100, generator=gen)}
    for make in (lambda be: pf.lion8bit(1e-3, weight_decay=0.1, backend=be),
                 lambda be: pf.adamw8bit(1e-3, weight_decay=0.1, backend=be)):
        fast = pf.compile(make("auto"), jit=False, donate=True)
        ref = make("torch")
        pa = {k: v.cuda() for k, v in params.items()}
        pb = {k: v.clone() for k, v in params.items()}
        sa, sb = fast.init(pa), ref.init(pb)
        for _ in range(5):
            g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
            pa, sa = fast.step({k: x.cuda() for k, x in g.items()}, sa, pa)
            u, sb = ref.update(g, sb, pb)
            pb = pf.apply_updates(pb, u)
        for k in params:
            close = torch.isclose(pa[k].cpu(), pb[k], rtol=1e-5, atol=1e-6).float().mean()
            assert close >= 0.999, k  # a rare Lion sign flip where c ≈ 0 (FMA) is allowed
