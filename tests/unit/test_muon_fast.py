"""Muon's fast path (issue #3): fused elementwise passes, batched NS, the symmetric kernel.

On a machine without CUDA the Triton kernels run in Triton's CPU interpreter (the root
conftest sets TRITON_INTERPRET=1), so sizes stay small.  Tolerances: fp32 paths are compared
at fp32 rounding (the same operations in another order); bf16 results at bf16 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

import pgs.func as pf
import pgs.func.muon_direction as M
from pgs.func.kernels import ns

needs_triton = pytest.mark.skipif(not ns.HAVE_TRITON, reason="triton not installed")
on_cpu_needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and not M._interpreting(), reason="no CUDA and no Triton interpreter")

#: where the Triton tests run: compiled on a GPU, interpreted on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = {"q": (16, 32), "k": (16, 32), "up": (48, 16), "gate": (48, 16), "conv": (4, 3, 8), "o": (32, 32)}


def _reference(params, grads_seq, lr=0.02, wd=0.1, **kw):
    opt = pf.chain(pf.scale_by_muon(**kw), pf.add_decayed_weights(wd), pf.scale_by_learning_rate(lr))
    state, p = opt.init(params), dict(params)
    for g in grads_seq:
        u, state = opt.update(g, state, p)
        p = pf.apply_updates(p, u)
    return p, state


def _fast(params, grads_seq, lr=0.02, wd=0.1, elementwise="torch", ns_kernel="cublas", **kw):
    p = [v.clone() for v in params.values()]
    m = [torch.zeros_like(v) for v in params.values()]
    for g in grads_seq:
        M.muon_fused_step(p, list(g.values()), m, learning_rate=lr, weight_decay=wd, elementwise=elementwise,
                          ns_kernel=ns_kernel, **kw)
    return dict(zip(params, p)), dict(zip(params, m))


def _data(steps=3, dtype=torch.float32, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


# -- the fused step equals the reference chain ------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},
    {"nesterov": False, "momentum": 0.9},
    {"adjust_lr": "match_rms_adamw"},
    {"adjust_lr": "none", "ns_steps": 3},
])
def test_fused_step_equals_reference_fp32(kw):
    params, grads = _data(steps=2)
    p_ref, s_ref = _reference(params, grads, ns_dtype=torch.float32, **kw)
    p_fast, m_fast = _fast(params, grads, ns_dtype=torch.float32, **kw)
    for k in params:
        torch.testing.assert_close(p_fast[k], p_ref[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m_fast[k], s_ref["0_scale_by_muon"].mu[k], rtol=0, atol=0)


def test_fused_step_equals_reference_bf16_iteration():
    params, grads = _data()
    p_ref, _ = _reference(params, grads)
    p_fast, _ = _fast(params, grads, fold=False)
    for k in params:  # same bf16 iteration; only ‖U‖'s summation order differs
        torch.testing.assert_close(p_fast[k], p_ref[k], rtol=0, atol=2e-3 * 0.02 * 3)


def test_fused_step_bf16_params_and_tensor_hyperparameters():
    params, grads = _data(dtype=torch.bfloat16)
    lr = torch.tensor(0.02, dtype=torch.float64)
    wd = torch.tensor(0.1, dtype=torch.float64)
    mom = torch.tensor(0.95, dtype=torch.float64)
    p_ref, s_ref = _reference(params, grads, lr=lr, wd=wd, momentum=mom)
    p_fast, m_fast = _fast(params, grads, lr=lr, wd=wd, momentum=mom, fold=False)
    for k in params:
        assert p_fast[k].dtype == torch.bfloat16 and m_fast[k].dtype == torch.bfloat16
        # the fast path never rounds the direction to bf16 before the apply: one bf16 ulp apart
        torch.testing.assert_close(p_fast[k].float(), p_ref[k].float(), rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(m_fast[k], s_ref["0_scale_by_muon"].mu[k])


@needs_triton
@on_cpu_needs_interpreter
def test_triton_elementwise_equals_torch_elementwise():
    shapes = {"a": (16, 40), "b": (16, 40), "t": (40, 8), "v": (8,)}
    params, grads = _data(steps=2, shapes=shapes)
    params = {k: v.to(DEV) for k, v in params.items()}
    grads = [{k: v.to(DEV) for k, v in g.items()} for g in grads]
    p_t, m_t = _fast(params, grads, elementwise="torch", ns_dtype=torch.float32)
    p_k, m_k = _fast(params, grads, elementwise="triton", ns_dtype=torch.float32)
    for k in params:
        torch.testing.assert_close(p_k[k], p_t[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m_k[k], m_t[k], rtol=1e-6, atol=1e-7)


@needs_triton
@on_cpu_needs_interpreter
def test_triton_post_pass_stochastic_rounding_is_bf16_and_unbiased():
    p = torch.full((4096,), 1.0, dtype=torch.bfloat16, device=DEV)
    o = torch.full((4096,), 1.0, dtype=torch.bfloat16, device=DEV)
    hp = torch.tensor([0.0, 1.0, -1e-3, 0.0], dtype=torch.float32, device=DEV)  # θ + 1e-3: below bf16's ulp at 1
    out = torch.empty_like(p)
    ns.muon_post(p, o, out, hp, 1.0, seed=torch.tensor([7], dtype=torch.int64, device=DEV))
    vals = out.float()
    assert set(vals.unique().tolist()) <= {1.0, 1.0078125}
    assert abs(vals.mean().item() - 1.001) < 3e-4  # E[round(x)] = x


# -- batched Newton–Schulz ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 16, 40), (3, 40, 16), (2, 24, 24)])
def test_newton_schulz_batched_equals_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    xn = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    ref = M.newton_schulz(x, dtype=torch.float32)
    got = M.newton_schulz_batched(xn.clone(), 5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 64, 192), (2, 192, 64), (2, 96, 96)])
def test_folded_update_is_as_accurate_as_the_reference(shape):
    # (B + aI)X instead of aX + BX: B + aI is rounded to bf16 once; measured against fp64
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    xn = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).bfloat16()
    exact = M.newton_schulz(xn.double(), dtype=torch.float64)
    ref = M.newton_schulz(xn)
    folded = M.newton_schulz_batched(xn.clone(), 5, fold=True)
    unfolded = M.newton_schulz_batched(xn.clone(), 5, fold=False)

    def err(o):
        return ((o.double() - exact).norm() / exact.norm()).item()

    assert err(unfolded) <= 1.05 * err(ref) + 1e-4
    assert err(folded) <= 1.5 * err(ref) + 1e-3


def _spectrum(kind: str, b: int, m: int, n: int) -> torch.Tensor:
    """fp64 inputs: Gaussian, low-rank (8 strong directions over a 1e-3 floor), condition 1e4 / 1e8."""
    gen = torch.Generator().manual_seed(11)
    g = torch.randn((b, m, n), generator=gen, dtype=torch.float64)
    if kind == "gaussian":
        return g
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    k = min(m, n)
    if kind == "lowrank":
        s = 1e-3 * torch.rand(k, generator=gen, dtype=torch.float64)
        s[:8] += 0.5 + torch.rand(8, generator=gen, dtype=torch.float64)
    else:
        s = torch.logspace(0, -int(kind[4:]), k, dtype=torch.float64)
    return u @ torch.diag_embed(s.expand(b, k)) @ vh


def _ns_fp64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = M.NS_COEFFICIENTS
    X = x.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _ns_symmetric_kernel_arithmetic(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """A torch transcription of the symmetric kernel's roundings (fold): products of bf16
    operands accumulated in fp32; A rounded to bf16; B + aI = b·A + c·A·A + a·I in fp32,
    rounded to bf16 once; X ← (B + aI)·X rounded to bf16 (round to nearest, as on a GPU;
    Triton's CPU interpreter truncates instead)."""
    a, b, c = M.NS_COEFFICIENTS
    X = x.clone()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    eye = torch.eye(X.shape[-2])
    for _ in range(steps):
        A = (X.float() @ X.float().mT).bfloat16().float()
        Bp = (b * A + c * (A @ A) + a * eye).bfloat16()
        X = (Bp.float() @ X.float()).bfloat16()
    return X.mT if tall else X


@pytest.mark.parametrize("kind", ["gaussian", "lowrank", "cond4", "cond8"])
@pytest.mark.parametrize("shape", [(2, 64, 192), (2, 192, 64), (2, 128, 128)])
def test_bf16_variants_against_fp64(kind, shape):
    # the accuracy yardstick: each bf16 variant's distance to an fp64 NS5 of the same input.
    # The reference's own bf16 error dominates (≈1% Gaussian, 4-40% ill-conditioned: small
    # singular values are amplified); nofold is the reference's arithmetic; the symmetric
    # kernel's single-rounding fold stays within 3% of the reference's error (it is often
    # below it); the cuBLAS fold (double rounding) within 25%
    x = _spectrum(kind, *shape)
    xn = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).bfloat16()
    exact = _ns_fp64(xn)

    def err(o):
        return ((o.double() - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).mean().item()

    ref = err(M.newton_schulz(xn))
    assert err(M.newton_schulz_batched(xn.clone(), 5, fold=False)) <= 1.001 * ref + 1e-5
    assert err(_ns_symmetric_kernel_arithmetic(xn)) <= 1.03 * ref + 1e-3
    assert err(M.newton_schulz_batched(xn.clone(), 5, fold=True)) <= 1.25 * ref + 1e-3


@pytest.mark.skipif(not (torch.cuda.is_available() and ns.auto_symmetric(torch.device("cuda"))),
                    reason="the symmetric kernel is the default on sm_90 only")
@pytest.mark.parametrize("kind", ["gaussian", "cond4"])
@pytest.mark.parametrize("shape", [(4, 256, 512), (4, 512, 256), (2, 1024, 2048)])
def test_auto_kernel_on_gpu_against_fp64(kind, shape):
    # the compiled symmetric kernel (default config, folded) vs the reference, both against fp64
    x = _spectrum(kind, *shape)
    xn = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).bfloat16().cuda()
    kernel = M._pick_kernel("auto", xn)
    assert kernel != "cublas"
    exact = _ns_fp64(xn)

    def err(o):
        return ((o.double() - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).mean().item()

    ref = err(M.newton_schulz(xn))
    assert err(M.newton_schulz_batched(xn.clone(), 5, kernel=kernel)) <= 1.1 * ref + 1e-3
    assert err(M.newton_schulz_batched(xn.clone(), 5, kernel=kernel, fold=False)) <= 1.1 * ref + 1e-3


# -- which kernel "auto" picks ------------------------------------------------------------------

def test_auto_is_cublas_on_cpu_and_for_fp32_iterations(monkeypatch):
    assert M._pick_kernel("auto", torch.zeros(2, 8, 16, dtype=torch.bfloat16)) == "cublas"
    monkeypatch.setattr(ns, "auto_symmetric", lambda device: True)  # as on an sm_90 GPU
    assert M._pick_kernel("auto", torch.zeros(2, 8, 16, dtype=torch.float32)) == "cublas"


@needs_triton
def test_auto_picks_the_tuned_config_per_shape_and_an_explicit_kernel_wins(monkeypatch):
    monkeypatch.setattr(ns, "auto_symmetric", lambda device: True)  # as on an sm_90 GPU
    for (r, c), config in ns.TUNED.items():
        assert config in ns.CONFIGS
        assert M._pick_kernel("auto", torch.empty(0, r, c, dtype=torch.bfloat16)) == config
    assert M._pick_kernel("auto", torch.empty(0, 96, 80, dtype=torch.bfloat16)) == ns.DEFAULT_CONFIG
    assert M._pick_kernel("cublas", torch.empty(0, 2048, 2048, dtype=torch.bfloat16)) == "cublas"
    assert M._pick_kernel("m64n64k64s4w4", torch.empty(0, 8, 8, dtype=torch.bfloat16, device=DEV)) in (
        "m64n64k64s4w4", "cublas")  # an explicit ns_kernel= wins over "auto"
    with pytest.raises(Exception, match="ns_kernel"):
        M._pick_kernel("nope", torch.empty(0, 8, 8, dtype=torch.bfloat16))


# -- the symmetric kernel (upper tiles, mirrored, fused epilogue) --------------------------------

@needs_triton
@on_cpu_needs_interpreter
@pytest.mark.parametrize("b,m,k,tall,config", [
    (2, 40, 72, False, "m64n64k64s4w4"),
    (2, 64, 128, False, "m64n64k64s4w4"),
    (3, 48, 80, True, "m64n64k64s4w4"),
    (1, 200, 64, False, "m64n64k64s4w4"),  # 4 row blocks, a ragged last one
    (1, 384, 64, True, "m128n256k64s3w8"),  # tiles straddling the diagonal
    (1, 136, 64, False, "m128n256k64s3w8"),
])
def test_sym_mm_equals_bmm(b, m, k, tall, config):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((b, k, m) if tall else (b, m, k), generator=gen).to(DEV)
    p = x.mT if tall else x  # a tall batch is read through its transpose (strided), no copy
    # fp32 accumulation over k terms: |error| ≤ k·2⁻²⁴·Σ|terms| (standard bound), checked in fp64;
    # NaN-filled outputs show every element is written
    a = ns.sym_mm(p, config=config, out=torch.full((b, m, m), float("nan"), device=DEV))
    pd = p.double()
    bound = k * 2**-24 * torch.bmm(pd.abs(), pd.abs().mT) + 1e-12
    assert ((a.double() - torch.bmm(pd, pd.mT)).abs() <= bound).all()
    # fp32 epilogue: B = b·A + c·A·A in one launch
    bb = ns.sym_mm(a, a, alpha=2.0315, beta=-4.7750, config=config, diag=3.4445,
                   out=torch.full((b, m, m), float("nan"), device=DEV))
    ad = a.double()
    ref = -4.7750 * ad + 2.0315 * torch.bmm(ad, ad) + 3.4445 * torch.eye(m, dtype=torch.float64, device=DEV)
    bound = (m + 3) * 2**-24 * (4.7750 * ad.abs() + 2.0315 * torch.bmm(ad.abs(), ad.abs()) + 3.4445) + 1e-12
    assert ((bb.double() - ref).abs() <= bound).all()


@needs_triton
@on_cpu_needs_interpreter
def test_sym_mm_bf16_inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((2, 64, 96), generator=gen).bfloat16().to(DEV)
    exact = torch.bmm(x.double(), x.mT.double())
    a32 = ns.sym_mm(x, out=torch.empty(2, 64, 64, device=DEV), config="m64n64k64s4w4")  # fp32 out: no rounding
    torch.testing.assert_close(a32.double(), exact, rtol=1e-6, atol=1e-4)
    a16 = ns.sym_mm(x, config="m64n64k64s4w4")  # bf16 out: within one bf16 ulp (the interpreter truncates)
    assert ((a16.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-6).all()
    if DEV == "cpu":  # one (diagonal) tile per matrix: symmetric products, symmetric sums
        assert torch.equal(a16, a16.mT)


@needs_triton
@on_cpu_needs_interpreter
def test_ns_with_symmetric_kernel_close_to_reference_and_bounded():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn((2, 64, 160), generator=gen).to(DEV)
    xn = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)).bfloat16()
    sym = M.newton_schulz_batched(xn.clone(), 5, kernel="m64n64k64s4w4")
    ref = M.newton_schulz(x)  # the bf16 reference
    exact = M.newton_schulz(x.double(), dtype=torch.float64)
    err_sym = (sym.double() - exact).norm() / exact.norm()
    err_ref = (ref.double() - exact).norm() / exact.norm()
    assert err_sym < 3 * err_ref + 1e-3
    s = torch.linalg.svdvals(sym.double())
    assert (s > 0).all() and (s <= 1.21).all()


# -- the execution layer: pf.compile(...).step runs the fused path ------------------------------

@pytest.mark.parametrize("donate", [False, True])
def test_compile_step_runs_fused_and_equals_reference(donate, monkeypatch):
    params, grads = _data(steps=3)
    sched = pf.cosine_schedule(peak=0.02, warmup=1, total=10)  # a per-step learning rate
    ref = pf.chain(pf.scale_by_muon(ns_dtype=torch.float32), pf.add_decayed_weights(0.1),
                   pf.scale_by_learning_rate(sched))
    s_ref, p_ref = ref.init(params), dict(params)
    calls = []
    real = M.muon_fused_step
    monkeypatch.setattr(M, "muon_fused_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = pf.compile(M.muon_matrices(sched, weight_decay=0.1, ns_dtype=torch.float32), donate=donate)
    p_fast = {k: v.clone() for k, v in params.items()}
    s_fast = fast.init(p_fast)
    for g in grads:
        u, s_ref = ref.update(g, s_ref, p_ref)
        p_ref = pf.apply_updates(p_ref, u)
        p_fast, s_fast = fast.step(g, s_fast, p_fast)
    assert len(calls) == 3
    for k in params:
        torch.testing.assert_close(p_fast[k], p_ref[k], rtol=1e-6, atol=1e-6)
    assert int(s_fast["2_scale_by_learning_rate"].count) == 3
    torch.testing.assert_close(s_fast["2_scale_by_learning_rate"].lr, s_ref["2_scale_by_learning_rate"].lr)


def test_muon_matrices_update_is_the_chain():
    params, grads = _data(steps=1)
    chain = pf.chain(pf.scale_by_muon(), pf.add_decayed_weights(0.1), pf.scale_by_learning_rate(0.02))
    fused = M.muon_matrices(0.02, weight_decay=0.1)
    u1, _ = chain.update(grads[0], chain.init(params), params)
    u2, _ = fused.update(grads[0], fused.init(params), params)
    for k in params:
        assert torch.equal(u1[k], u2[k])


@pytest.mark.parametrize("donate", [False, True])
def test_compile_step_of_pf_muon_runs_the_muon_groups_fused(donate, monkeypatch):
    shapes = {"embed.weight": (20, 8), "layers.0.q.weight": (16, 8), "layers.0.up.weight": (24, 8),
              "layers.0.norm.weight": (8,), "layers.1.q.weight": (16, 8)}
    params, grads = _data(steps=3, shapes=shapes)
    opt = pf.muon(0.02, weight_decay=0.1, adam_lr=1e-3, adam_weight_decay=0.01, ns_dtype=torch.float32)
    s_ref, p_ref = opt.init(params), dict(params)
    calls = []
    real = M.muon_fused_step
    monkeypatch.setattr(M, "muon_fused_step", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    fast = pf.compile(opt, donate=donate, jit=False)
    p_fast = {k: v.clone() for k, v in params.items()}
    s_fast = fast.init(p_fast)
    for g in grads:
        u, s_ref = opt.update(g, s_ref, p_ref)
        p_ref = pf.apply_updates(p_ref, u)
        p_fast, s_fast = fast.step(g, s_fast, p_fast)
    assert calls == [3, 3, 3]  # the three hidden matrices, fused; embed and norm through AdamW
    for k in params:
        torch.testing.assert_close(p_fast[k], p_ref[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("elementwise", ["torch", pytest.param("triton", marks=[needs_triton, on_cpu_needs_interpreter])])
def test_stochastic_rounding_into_bf16_parameters(elementwise):
    shapes = {"a": (16, 32), "b": (16, 32), "t": (32, 16)}
    params, grads = _data(steps=1, shapes=shapes, dtype=torch.bfloat16)
    dev = DEV if elementwise == "triton" else "cpu"
    params = {k: v.to(dev) for k, v in params.items()}
    grads = [{k: v.to(dev) for k, v in g.items()} for g in grads]
    p_near, _ = _fast(params, grads, elementwise=elementwise)
    p_sr, _ = _fast(params, grads, elementwise=elementwise, memory=pf.MemoryOptions(stochastic_rounding=True),
                    step=torch.tensor(3, device=dev))
    for k in params:
        assert p_sr[k].dtype == torch.bfloat16
        # each element rounds to one of the two bf16 neighbours of the fp32 result
        ulp = p_near[k].float().abs().clamp(min=1e-30) * 2**-7
        assert ((p_sr[k].float() - p_near[k].float()).abs() <= ulp + 1e-12).all()
    assert any(not torch.equal(p_sr[k], p_near[k]) for k in params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need CUDA")
def test_changing_hyperparameters_compiles_nothing_new():
    shapes = {"a": (64, 128), "b": (64, 128), "t": (128, 64)}
    params, grads = _data(steps=4, shapes=shapes)
    p = [v.cuda() for v in params.values()]
    m = [torch.zeros_like(v) for v in p]
    kernels = (ns._muon_pre_kernel, ns._muon_post_kernel, ns._sym_mm_kernel)
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps its kernel cache elsewhere")

    def compiled():
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    seen = None
    for t, g in enumerate(grads):
        hp = {name: torch.tensor(v * (1 + 0.1 * t), dtype=torch.float64, device="cuda")
              for name, v in (("learning_rate", 0.02), ("weight_decay", 0.1), ("momentum", 0.9))}
        M.muon_fused_step(p, [x.cuda() for x in g.values()], m, ns_kernel="m64n64k64s4w4", **hp)
        torch.cuda.synchronize()
        if seen is None:
            seen = compiled()
        assert compiled() == seen  # per-step values are read from device memory


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the seeded rounding runs in Triton: a GPU or the interpreter")
def test_pf_muon_stochastic_rounding_ignores_the_global_generator():
    """``pf.muon``'s fused step on bf16 parameters with stochastic rounding (the Muon groups'
    elementwise pass and the AdamW fallback's apply) seeds every draw from Muon's step count:
    two runs from one state with torch's global generator reseeded and drawn from in between
    give the same bits, and the rounding did decide something (nearest differs)."""
    shapes = {"embed.weight": (20, 8), "layers.0.q.weight": (16, 8), "layers.0.up.weight": (24, 8),
              "layers.0.norm.weight": (8,), "layers.1.q.weight": (16, 8)}
    params, grads = _data(steps=2, shapes=shapes, dtype=torch.bfloat16)
    params = {k: v.to(DEV) for k, v in params.items()}
    grads = [{k: v.to(DEV) for k, v in g.items()} for g in grads]

    from test_8bit_sr_seed import compiled_run

    def run(global_seed, sr=True):
        opt = pf.muon(0.02, weight_decay=0.1, adam_lr=3e-3, adam_weight_decay=0.01, ns_dtype=torch.float32)
        fast = pf.compile(opt, donate=True, jit=False, memory=pf.MemoryOptions(stochastic_rounding=sr))
        return compiled_run(fast, params, grads, global_seed)[0]

    a, b, near = run(0), run(500), run(0, sr=False)
    for k in shapes:
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k
    assert all(not torch.equal(a[k], near[k]) for k in ("embed.weight", "layers.0.q.weight")), "no draw decided"
