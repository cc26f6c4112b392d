"""pf.lion8bit / pf.adamw8bit against bitsandbytes and against their fp32 twins (CPU)."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.func.step import NO_CONTEXT
from pgs.errors import InvalidArgument

SHAPES = {"w": (64, 96), "e": (128, 64), "b": (96,)}  # two 8-bit tensors, one fp32 (< 4096)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    init = {k: torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}
    target = {k: torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}
    return init, target


def _run_pair(bnb_cls, ours, kw, steps=100):
    """The same noisy quadratic for both: g = (θ − θ*) + noise, noise shared across runs."""
    init, target = _problem()
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    bopt = bnb_cls(list(tp.values()), **kw, min_8bit_size=4096)  # bnb's CPU block size is 256
    p = {k: v.clone() for k, v in init.items()}
    s = ours.init(p)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        noise = {k: torch.randn(SHAPES[k], generator=gen) * 0.05 for k in SHAPES}
        for k in tp:
            tp[k].grad = (tp[k].detach() - target[k]) + noise[k]
        bopt.step()
        u, s = ours.update({k: (p[k] - target[k]) + noise[k] for k in SHAPES}, s, p)
        p = pf.apply_updates(p, u)
    return p, {k: v.detach() for k, v in tp.items()}, init, s, bopt


def _lion_pair():
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    return kw, pf.lion8bit(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)


def _adam_pair():
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    return kw, pf.adamw8bit(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture
def bnb_reference_quantizer(monkeypatch):
    """Route bitsandbytes' CPU optimizers through its own pure-torch reference quantizer.

    Its compiled CPU quantizer is not always nearest-code (see test_quant8_props), which is
    the only reason trajectories drift apart; with the reference one they agree closely.
    """
    cpu_ops = pytest.importorskip("bitsandbytes.backends.cpu.ops")
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    ref = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)

    def quant(a, code, absmax_out, out_uint8, blocksize):
        codes, absmax = op.redispatch(ref, a, code, blocksize)
        out_uint8.copy_(codes)
        absmax_out.copy_(absmax)

    monkeypatch.setattr(cpu_ops, "_quant_blockwise_fp32_direct", quant)


@pytest.mark.parametrize("which", ["lion", "adam"])
def test_trajectory_matches_bitsandbytes_with_its_reference_quantizer(which, bnb_reference_quantizer):
    bnb = pytest.importorskip("bitsandbytes")
    kw, ours = _lion_pair() if which == "lion" else _adam_pair()
    cls = bnb.optim.Lion8bit if which == "lion" else bnb.optim.AdamW8bit
    p, q, init, s, bopt = _run_pair(cls, ours, kw)
    for k in SHAPES:
        d = (p[k] - q[k]).abs()
        # bnb computes β·m + (1−β)·g, we lerp; the two differ by an ulp, which can flip a
        # Lion sign where c ≈ 0 (one step of 2η) or move an 8-bit code by one.  So: almost
        # every coordinate within 1e-5, none further than a few learning-rate steps.
        assert (d > 1e-5).float().mean() <= 1e-3, k
        assert float(d.max()) <= 4 * kw["lr"], k
    st = bopt.state[bopt.param_groups[0]["params"][0]]
    mu = s["0_scale_by_lion8bit" if which == "lion" else "0_scale_by_adam8bit"].mu["w"]
    assert (mu.codes == st["state1"]).float().mean() >= 0.99
    torch.testing.assert_close(mu.absmax, st["absmax1"], rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("which", ["lion", "adam"])
def test_trajectory_close_to_stock_bitsandbytes(which):
    """Stock bnb on CPU (compiled quantizer, ~0.15% non-nearest codes): trajectories stay
    close in aggregate; after 100 steps the mean |Δθ| is under 1% of the mean distance
    travelled (measured ~0.1%)."""
    bnb = pytest.importorskip("bitsandbytes")
    kw, ours = _lion_pair() if which == "lion" else _adam_pair()
    cls = bnb.optim.Lion8bit if which == "lion" else bnb.optim.AdamW8bit
    p, q, init, _, _ = _run_pair(cls, ours, kw)
    for k in SHAPES:
        moved = float((q[k] - init[k]).abs().mean())
        assert float((p[k] - q[k]).abs().mean()) <= 0.01 * moved, k


def _exact_pair(ours, ref, steps=20):
    init, target = _problem(3)
    p1, p2 = dict(init), dict(init)
    s1, s2 = ours.init(p1), ref.init(p2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        g = {k: torch.randn(SHAPES[k], generator=gen) for k in SHAPES}
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = ref.update(g, s2, p2)
        p1, p2 = pf.apply_updates(p1, u1), pf.apply_updates(p2, u2)
    for k in SHAPES:
        assert torch.equal(p1[k], p2[k]), k


def test_lion8bit_without_quantization_equals_lion():
    _exact_pair(pf.lion8bit(1e-3, weight_decay=0.1, quantize=False), pf.lion(1e-3, weight_decay=0.1))


def test_adamw8bit_without_quantization_equals_adamw():
    _exact_pair(pf.adamw8bit(1e-3, weight_decay=0.1, quantize=False), pf.adamw(1e-3, weight_decay=0.1))


@pytest.mark.parametrize("make", [lambda: pf.lion8bit(1e-3, weight_decay=0.1), lambda: pf.adamw8bit(1e-3)])
def test_flat_layout_equals_per_parameter(make):
    init, _ = _problem()
    opt, fast = make(), pf.compile(make(), jit=False)
    s1, s2 = opt.init(init), fast.init(init)
    p1, p2 = dict(init), dict(init)
    for i in range(3):
        g = {k: torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(i)) for k in SHAPES}
        u, s1 = opt.update(g, s1, p1)
        p1 = pf.apply_updates(p1, u)
        p2, s2 = fast.step(g, s2, p2)
    for k in SHAPES:
        assert torch.equal(p1[k], p2[k]), k
    # per-tensor codes equal the flat buffer's slice: blocks never straddle two tensors
    mu1 = s1[next(iter(s1))].mu
    mu2 = s2[next(iter(s2))].mu
    lay = fast.layout
    for key, grp in lay.groups.items():
        if isinstance(mu2[key], pf.Quantized8bit):
            for path, off, n in zip(grp.paths, grp.offsets, grp.numels):
                assert torch.equal(mu2[key].codes[off : off + n], mu1[path].codes.reshape(-1))


def test_state_is_named_and_round_trips():
    init, _ = _problem()
    opt = pf.adamw8bit(1e-3)
    s = opt.init(init)
    _, s = opt.update({k: torch.randn_like(v) for k, v in init.items()}, s, init)
    d = pf.state_to_dict(s)
    assert {"0_scale_by_adam8bit.mu.w.codes", "0_scale_by_adam8bit.mu.w.absmax",
            "0_scale_by_adam8bit.nu.e.codes", "0_scale_by_adam8bit.mu.b"} <= set(d)
    assert d["0_scale_by_adam8bit.mu.w.codes"].dtype == torch.uint8
    assert d["0_scale_by_adam8bit.mu.b"].dtype == torch.float32
    back = pf.state_from_dict(opt.init(init), d)
    assert all(torch.equal(a, b) for a, b in zip(pf.tree.leaves(back), pf.tree.leaves(s)))


def test_state_bytes_per_param_at_qwen3_1p7b_shapes():
    """≤ 1.02 B/param of Lion8bit state at Qwen3-1.7B shapes (meta tensors: nothing allocated)."""
    h, kv, inter, L, vocab = 2048, 1024, 6144, 28, 151936
    params = {"embed": torch.empty(vocab, h, device="meta"), "norm": torch.empty(h, device="meta")}
    for i in range(L):
        for name, shape in [("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)), ("gate", (inter, h)),
                            ("up", (inter, h)), ("down", (h, inter)), ("qn", (128,)), ("kn", (128,)),
                            ("ln1", (h,)), ("ln2", (h,))]:
            params[f"l{i}.{name}"] = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    bpp = pf.state_bytes_per_param(pf.lion8bit(1e-4).init(params), params)
    assert 1.0 < bpp <= 1.02
    assert pf.state_bytes_per_param(pf.adamw8bit().init(params), params) <= 2.04


def test_errors_name_the_argument():
    with pytest.raises(InvalidArgument, match="block_size"):
        pf.scale_by_lion8bit(block_size=0)
    with pytest.raises(InvalidArgument, match="backend"):
        pf.scale_by_adam8bit(backend="cuda")
    with pytest.raises(InvalidArgument, match="b1"):
        pf.lion8bit(b1=1.5)


@pytest.mark.parametrize("alias", ["lion8bit", "adamw8bit"])
@pytest.mark.parametrize("donate", [False, True])
def test_small_leaves_stepped_as_one_equal_leaf_by_leaf(alias, donate):
    """The fused step steps a call's small (fp32-state) leaves as one concatenated leaf: the
    same values as one call per leaf (elementwise maths, no stochastic rounding), and without
    donation every new leaf has its own storage."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (7,), "b": (3, 5), "c": (64,)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in shapes.items()}
    opt = getattr(pf, alias)(1e-2, weight_decay=0.1, backend="triton")

    def run(keys):
        p = {k: params[k].clone() for k in keys}
        state = opt.init(p)
        out_p, out_s = opt.fused_step({k: grads[k].clone() for k in keys}, state, p, ctx=NO_CONTEXT, donate=donate,
                                      memory=pf.MemoryOptions(stochastic_rounding=False))
        return out_p, out_s

    together, state = run(list(shapes))
    for k in shapes:
        alone, _ = run([k])
        assert torch.equal(together[k], alone[k]), k
        assert together[k].shape == shapes[k]
    storages = {together[k].untyped_storage().data_ptr() for k in shapes}
    assert len(storages) == len(shapes)
