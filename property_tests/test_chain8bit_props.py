"""Properties of the fused ``adagc → mona → lion8bit → hyperball`` step (``pgs.func.fused_chain8bit``).

For any set of tensor shapes (sizes that are and are not multiples of the 256-element block,
8-bit and fp32 momenta, constrained and free tensors), hyperparameters and gradients:

1. hyperball's invariant (docs/techniques/hyperball.md): every constrained matrix keeps its initial
   Frobenius norm R = ‖W_0‖ after each fused step, up to the bf16 rounding of its elements;
2. the fused step equals the generic flat path (``fused=False``): parameters up to a few bf16
   ulps on ≤ 0.2% of the elements (tests/unit/test_chain8bit.py says why), 8-bit codes up to ±1.

On CPU the kernels run in Triton's interpreter, so the examples are small and few.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pgs.func as pf
from pgs.func import kernels as K

pytestmark = pytest.mark.skipif(not K.triton_importable(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def problems(draw):
    n = draw(st.integers(1, 3))
    shapes = {}
    for i in range(n):
        rows = draw(st.integers(2, 40))
        cols = draw(st.integers(2, 70))
        shapes[f"w{i}"] = (rows, cols)
    if draw(st.booleans()):
        shapes["bias"] = (draw(st.integers(1, 600)),)
    hp = dict(
        lr=draw(st.sampled_from([1e-3, 1e-2, 0.1])),
        warmup=draw(st.integers(0, 3)),
        alpha=draw(st.sampled_from([0.0, 0.5, 0.92])),
        beta=draw(st.sampled_from([0.0, 0.9])),
        min8=draw(st.sampled_from([256, 1024])),
        gscale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return shapes, hp


def _record(ran: list, out):
    if out is not None:
        ran.append(1)
    return out


@settings(max_examples=8)
@given(problems())
def test_fused_step_keeps_the_sphere_and_equals_generic(problem):
    shapes, hp = problem
    gen = torch.Generator().manual_seed(hp["seed"])
    params = {k: torch.randn(s, generator=gen).bfloat16().to(DEV) for k, s in shapes.items()}
    grads = [{k: (torch.randn(s, generator=gen) * hp["gscale"]).bfloat16().to(DEV) for k, s in shapes.items()}
             for _ in range(hp["steps"])]
    opt = pf.chain(pf.adagc(warmup_steps=hp["warmup"]), pf.mona(hp["alpha"], hp["beta"]),
                   pf.scale_by_lion8bit(min_8bit_size=hp["min8"], backend="triton"), pf.hyperball(hp["lr"]))
    out = {}
    for fused in (True, False):
        fast = pf.compile(opt, jit=False, fused=fused)
        p = {k: v.clone() for k, v in params.items()}
        s = fast.init(p)
        ran = []
        if fast.plan is not None:  # record the steps the fused plan served
            inner = fast.plan.step
            fast.plan = attrs.evolve(fast.plan, step=lambda *a, **k: _record(ran, inner(*a, **k)))
        for g in grads:
            p, s = fast.step(g, s, p)
            if fused:
                for k, v in params.items():
                    if v.ndim >= 2:
                        r = v.float().norm().item()
                        assert p[k].float().norm().item() == pytest.approx(r, rel=4e-3)
        assert len(ran) == (len(grads) if fused else 0)
        out[fused] = (p, s)
    (pf_, sf), (pg, sg) = out[True], out[False]
    for k in params:
        x, y = pf_[k].float(), pg[k].float()
        d = (x - y).abs()
        assert bool((d <= 4 * torch.maximum(x.abs(), y.abs()) * 2.0**-7).all()), k
        assert (d > 0).float().mean().item() <= 2e-3 + 1.0 / d.numel(), k
    for key, q in sf["2_scale_by_lion8bit"].mu.items():
        if hasattr(q, "codes"):
            dc = (q.codes.int() - sg["2_scale_by_lion8bit"].mu[key].codes.int()).abs()
            assert int(dc.max()) <= 1
