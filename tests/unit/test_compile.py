"""The flat execution layer (``pf.compile``): in-place donation, ``step``, buffer binding,
grouping by labels and dtypes, and stochastic rounding into bf16."""

from __future__ import annotations

import math

import pytest
import torch

import pgs.func as pf
from pgs.func import tree as T

BF16 = torch.bfloat16


def make_params(seed: int = 0, dtypes=(torch.float32,)):
    """A small model-like tree; leaf i gets ``dtypes[i % len(dtypes)]``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"emb": (11, 4), "layers": [{"w": (4, 4), "b": (4,)}, {"w": (4, 3), "b": (3,)}], "scale": ()}
    counter = iter(range(100))

    def one(shape):
        return torch.randn(shape, generator=gen).to(dtypes[next(counter) % len(dtypes)])

    return _map_shapes(one, shapes)


def _map_shapes(fn, shapes):
    if isinstance(shapes, dict):
        return {k: _map_shapes(fn, v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_map_shapes(fn, v) for v in shapes]
    return fn(shapes)


def grads_like(params, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return T.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)


def clone(tree):
    return T.tree_map(lambda x: x.clone(), tree)


def assert_trees_equal(a, b, what=""):
    for (path, x), (_, y) in zip(T.leaves_with_paths(a), T.leaves_with_paths(b)):
        assert x.dtype == y.dtype, f"{what} {path}: {x.dtype} vs {y.dtype}"
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{what} {path}: {m}")


def ref_trajectory(opt, params, grads_list):
    """Params after each step of the per-parameter reference path."""
    state = opt.init(params)
    out = []
    for g in grads_list:
        u, state = opt.update(g, state, params)
        params = pf.apply_updates(params, u)
        out.append(params)
    return out


def _opt():
    return pf.chain(
        pf.scale_by_adam(b2=0.95),
        pf.add_decayed_weights(0.1, mask=lambda path, p: p.ndim >= 2),
        pf.scale_by_learning_rate(pf.cosine_schedule(1e-2, 1, 10, init=1e-3)),
    )


# ----------------------------------------------------------------------------------------
# donation


def _buffers(state):
    return {p: x.data_ptr() for p, x in T.leaves_with_paths(state) if isinstance(x, torch.Tensor) and x.numel() > 1}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_donate_updates_state_in_place_with_the_same_results(jit):
    torch._dynamo.reset()
    params = make_params(0)
    grads = [grads_like(params, s) for s in (1, 2, 3)]
    plain, donated = pf.compile(_opt(), jit=False), pf.compile(_opt(), jit=jit, donate=True)
    s_plain, s_don = plain.init(params), donated.init(params)
    ptrs = _buffers(s_don)
    assert ptrs, "the state has no buffers to donate"
    for g in grads:
        u_plain, s_plain = plain.update(g, s_plain, params)
        u_don, s_don = donated.update(g, s_don, params)
        assert _buffers(s_don) == ptrs, "donate=True allocated new state buffers"
        tol = 0 if not jit else 1e-6
        for (path, a), (_, b) in zip(T.leaves_with_paths(u_don), T.leaves_with_paths(u_plain)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * 1e-2, msg=lambda m: f"{path}: {m}")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_donated_step_writes_params_in_place(jit):
    torch._dynamo.reset()
    params = make_params(1)
    grads = [grads_like(params, s) for s in (4, 5)]
    ref = ref_trajectory(_opt(), clone(params), grads)
    fc = pf.compile(_opt(), jit=jit, donate=True)
    state = fc.init(params)
    ptrs = [p.data_ptr() for p in T.leaves(params)]
    for i, g in enumerate(grads):
        out, state = fc.step(g, state, params)
        assert out is params
        assert [p.data_ptr() for p in T.leaves(params)] == ptrs
        tol = 0 if not jit else 1e-6
        for (path, a), (_, b) in zip(T.leaves_with_paths(params), T.leaves_with_paths(ref[i])):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * 1e-2, msg=lambda m: f"step {i + 1} {path}: {m}")


# ----------------------------------------------------------------------------------------
# step == update + apply_updates


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, BF16)], ids=["fp32", "fp32+bf16"])
def test_step_equals_update_then_apply(dtypes):
    params = make_params(2, dtypes)
    grads = [grads_like(params, s) for s in (6, 7, 8)]
    a, b = pf.compile(_opt(), jit=False), pf.compile(_opt(), jit=False)
    sa, sb = a.init(params), b.init(params)
    pa = pb = params
    for g in grads:
        pa, sa = a.step(g, sa, pa)
        u, sb = b.update(g, sb, pb)
        pb = pf.apply_updates(pb, u)
        assert_trees_equal(pa, pb, "step vs update + apply_updates")
    assert_trees_equal(pa, ref_trajectory(_opt(), params, grads)[-1], "flat step vs reference")


# ----------------------------------------------------------------------------------------
# bind_buffers


def test_bind_buffers_makes_params_views_and_flatten_zero_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    params = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in params.items()}
    fc = pf.compile(_opt(), jit=False)
    bufs = fc.bind_buffers(params)
    storages = {b.untyped_storage().data_ptr() for b in bufs.values()}
    for k, p in params.items():
        assert isinstance(p, torch.nn.Parameter)
        assert p.untyped_storage().data_ptr() in storages, f"{k} is not a view of a flat buffer"
        torch.testing.assert_close(p.detach(), before[k], rtol=0, atol=0)
    flat = fc.flatten({k: p.detach() for k, p in params.items()})
    assert flat.keys() == bufs.keys()
    for key in bufs:
        assert flat[key].data_ptr() == bufs[key].data_ptr(), "flatten copied instead of viewing"
    # writing the buffer is writing the parameters
    key = next(iter(bufs))
    bufs[key].add_(1.0)
    first = fc.layout.groups[key].paths[0]
    torch.testing.assert_close(params[first].detach(), before[first] + 1.0)
    # and the model still runs on the re-homed parameters
    model(torch.randn(3, 5)).sum().backward()


def test_bound_step_updates_the_model_in_place():
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 3)
    params = dict(model.named_parameters())
    ref_params = {k: p.detach().clone() for k, p in params.items()}
    fc = pf.compile(_opt(), jit=False, donate=True)
    with torch.no_grad():  # as the runtime drives it: parameters are leaves that require grad
        fc.bind_buffers(params)
        state = fc.init(params)
        grads = grads_like(ref_params, 9)
        fc.step(grads, state, params)
    expected = ref_trajectory(_opt(), ref_params, [grads])[-1]
    for k, p in model.named_parameters():
        assert not torch.equal(p.detach(), ref_params[k]), f"{k} did not move"
        torch.testing.assert_close(p.detach(), expected[k], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# grouping on the flat path


def _groups(fc):
    return [(g.dtype, g.labels, g.paths) for g in fc.layout.groups.values()]


def _check_groups_and_results(opt_factory, params, expect_groups: int):
    fc = pf.compile(opt_factory(), jit=False)
    state = fc.init(params)
    assert len(fc.layout.groups) == expect_groups, _groups(fc)
    for g in fc.layout.groups.values():
        assert g.num_tensors >= 1
    grads = [grads_like(params, s) for s in (10, 11, 12)]
    ref = ref_trajectory(opt_factory(), params, grads)
    p = params
    for i, g in enumerate(grads):
        p, state = fc.step(g, state, p)
        assert_trees_equal(p, ref[i], f"step {i + 1}")
    return fc


def test_add_decayed_weights_mask_splits_groups():
    params = make_params(3)
    fc = _check_groups_and_results(_opt, params, expect_groups=2)
    by_label = {g.labels: set(g.paths) for g in fc.layout.groups.values()}
    assert by_label[(True,)] == {"emb", "layers.0.w", "layers.1.w"}
    assert by_label[(False,)] == {"layers.0.b", "layers.1.b", "scale"}


def test_partition_splits_groups_by_label():
    def label(path, p):
        return "embed" if path.startswith("emb") else ("matrix" if p.ndim >= 2 else "vector")

    def make():
        return pf.partition(
            {"embed": pf.sgd(1e-2, momentum=0.9), "matrix": pf.adamw(1e-3, weight_decay=0.1), "vector": pf.lion(1e-4)},
            label,
        )

    fc = _check_groups_and_results(make, make_params(4), expect_groups=3)
    for g in fc.layout.groups.values():
        assert len({label(p, torch.empty(s)) for p, s in zip(g.paths, g.shapes)}) == 1, g.paths


def test_masked_splits_groups():
    def make():
        return pf.chain(pf.masked(pf.scale_by_adam(), lambda path, p: "layers" in path), pf.scale_by_learning_rate(1e-2))

    fc = _check_groups_and_results(make, make_params(5), expect_groups=2)
    inner = {g.labels[0]: set(g.paths) for g in fc.layout.groups.values()}
    assert inner[True] == {"layers.0.w", "layers.0.b", "layers.1.w", "layers.1.b"}


def test_mixed_dtypes_form_separate_groups():
    params = make_params(6, dtypes=(torch.float32, BF16))
    fc = _check_groups_and_results(_opt, params, expect_groups=4)  # 2 dtypes x 2 mask labels
    leaf_dtype = {p: x.dtype for p, x in T.leaves_with_paths(params)}
    for g in fc.layout.groups.values():
        assert {leaf_dtype[p] for p in g.paths} == {g.dtype}
    assert {g.dtype for g in fc.layout.groups.values()} == {torch.float32, BF16}


def test_mixed_dtypes_state_and_updates_keep_their_dtypes():
    params = make_params(7, dtypes=(torch.float32, BF16))
    fc = pf.compile(pf.adamw(1e-3), jit=False)
    state = fc.init(params)
    u, state = fc.update(grads_like(params, 13), state, params)
    for (path, x), (_, p) in zip(T.leaves_with_paths(u), T.leaves_with_paths(params)):
        assert x.dtype == p.dtype, path


# ----------------------------------------------------------------------------------------
# stochastic rounding into bf16
#
# For x between neighbouring bf16 values lo < hi (spacing ulp), a draw is hi with probability
# q = (x − lo)/ulp, so E = x and Var ≤ ulp²/4.  The mean of N independent draws is within
# 6·ulp/(2√N) of x except with probability < 2e-9 per value (normal tail at 6σ; N is large
# enough for the CLT with q not extreme).  The generators are seeded, so the test is also
# deterministic; the bound says that passing is not a fluke of the seed.


def _bf16_neighbours(x: torch.Tensor):
    down = x.to(BF16, copy=True)
    lo = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-math.inf, dtype=BF16)), down)
    hi = torch.nextafter(lo, torch.tensor(math.inf, dtype=BF16))
    return lo.float(), hi.float()


def test_stochastic_rounding_is_unbiased_and_stays_on_the_neighbours():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([
        (torch.rand(96, generator=gen) + 1.0),  # [1, 2): ulp 2^-7
        -(torch.rand(96, generator=gen) * 1e-3 + 1e-3),  # small negatives
        torch.rand(64, generator=gen) * 1e4,  # large
    ])
    n = 4096
    draws = pf.stochastic_round_to_bf16(values.expand(n, -1).contiguous(), generator=gen)
    assert draws.dtype == BF16
    lo, hi = _bf16_neighbours(values)
    d = draws.float()
    assert torch.all((d == lo) | (d == hi)), "a draw left the two neighbouring bf16 values"
    ulp = hi - lo
    err = (d.double().mean(0) - values.double()).abs()
    bound = 6.0 * ulp.double() / (2.0 * math.sqrt(n))
    worst = int((err / bound).argmax())
    assert torch.all(err <= bound), f"value {values[worst]!r}: bias {err[worst]!r} > {bound[worst]!r}"
    # and the draws are not all the same: the up-fraction follows q = (x − lo)/ulp
    q = ((values - lo) / ulp).double()
    up = (d == hi).double().mean(0)
    assert torch.all((up - q).abs() <= 6.0 * 0.5 / math.sqrt(n))


def test_stochastic_rounding_keeps_exact_and_non_finite_values():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan])
    out = pf.stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(1)).float()
    torch.testing.assert_close(out, x, equal_nan=True, rtol=0, atol=0)


def test_apply_updates_stochastic_rounding_accumulates_sub_ulp_updates():
    n = 1 << 16
    params = {"w": torch.ones(n, dtype=BF16)}
    updates = {"w": torch.full((n,), 1e-3)}  # an eighth of bf16's ulp at 1.0 (2^-7)
    gen = torch.Generator().manual_seed(2)
    nearest = pf.apply_updates(params, updates)["w"]
    assert torch.all(nearest == 1.0), "round-to-nearest should lose a sub-ulp update"
    out = pf.apply_updates(params, updates, memory=pf.MemoryOptions(stochastic_rounding=True), generator=gen)["w"]
    assert out.dtype == BF16
    target = 1.0 + float(torch.tensor(1e-3, dtype=torch.float32))
    ulp = 2.0**-7
    q = (target - 1.0) / ulp
    bound = 6.0 * ulp * math.sqrt(q * (1 - q)) / math.sqrt(n)
    assert abs(out.double().mean().item() - target) <= bound


def test_flat_step_with_stochastic_rounding_is_unbiased():
    # FlatChain's plain step seeds its noise from the state's step count (tests/unit/test_sr_pure.py)
    n = 1 << 16
    params = {"w": torch.ones(n, dtype=BF16)}
    grads = {"w": torch.ones(n, dtype=BF16)}
    fc = pf.compile(pf.sgd(1e-3), jit=False, memory=pf.MemoryOptions(stochastic_rounding=True))
    state = fc.init(params)
    new, _ = fc.step(grads, state, params)
    # the update keeps the gradient's dtype (bf16), then 1 + u is rounded: 1 + u lies in
    # [1 − 2^-8, 1), where the bf16 ulp is 2^-8
    target = 1.0 + float(torch.tensor(-1e-3, dtype=torch.float32).to(BF16))
    ulp = 2.0**-8
    q = (target - (1.0 - ulp)) / ulp
    bound = 6.0 * ulp * math.sqrt(q * (1 - q)) / math.sqrt(n)
    assert abs(new["w"].double().mean().item() - target) <= bound
    assert set(new["w"].float().unique().tolist()) <= {1.0 - ulp, 1.0}


# ----------------------------------------------------------------------------------------
# the compiled graph of a clipped chain.  Regression: the global norm went through per-block
# sums and a segment sum, which inductor compiles to one atomic add per 256 elements, nearly
# all to the same address (the suspected cause of 19 ms against a 6.9 ms byte floor on the
# H200 at Qwen3-1.7B shapes).  Checked on the captured graph, not on a clock.


def _clip_chain():
    return pf.chain(
        pf.clip_by_global_norm(1.0),
        pf.scale_by_adam(b2=0.95, mu_dtype=BF16, nu_dtype=BF16),
        pf.add_decayed_weights(0.1, mask=lambda path, p: p.ndim >= 2),
        pf.scale_by_learning_rate(pf.cosine_schedule(1e-2, 1, 10, init=1e-3)),
    )


def test_compiled_clip_chain_is_one_graph_with_one_plain_reduction_per_buffer():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    params = make_params(8, dtypes=(BF16,))
    grads = [grads_like(params, s) for s in (20, 21, 22, 23)]
    ref = ref_trajectory(_clip_chain(), clone(params), grads)
    fc = pf.compile(_clip_chain(), jit=True, donate=True, compile_options={"backend": capture})
    state = fc.init(params)
    sizes = {g.size for g in fc.layout.groups.values()}
    assert len(fc.layout.groups) == 2
    for i, g in enumerate(grads):  # the schedule and the counters move: no recompile
        params, state = fc.step(g, state, params)
        for (path, a), (_, b) in zip(T.leaves_with_paths(params), T.leaves_with_paths(ref[i])):
            torch.testing.assert_close(a, b, rtol=2.0**-7, atol=1e-6, msg=lambda m: f"step {i + 1} {path}: {m}")
    assert len(graphs) == 1, f"{len(graphs)} graphs: a graph break or a recompile"
    nodes = [n for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    names = [n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)) for n in nodes]
    assert not [t for t in names if "index_add" in t or "index_put" in t or "scatter" in t], names
    assert not [t for t in names if t == "item"], "a host sync inside the step"

    def numel(x):
        v = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        return v.numel() if isinstance(v, torch.Tensor) else 0

    full_reductions = [n for n, t in zip(nodes, names) if t in ("sum", "amax", "max", "norm") and n.args
                       and numel(n.args[0]) in sizes]
    # one sum of squares over each gradient buffer, nothing else reads a whole buffer to reduce
    assert len(full_reductions) == len(fc.layout.groups), [(n.target, numel(n.args[0])) for n in full_reductions]


def test_zero_copy_flatten_is_cached_and_revalidated():
    """A bound dict flattens from the cache while its leaves stay the same views; rebinding a
    leaf (``p.data = ...``), replacing one, or a new dict with other keys misses, and a step
    then still writes the caller's tensors (issue #4's host-time cut must not change results)."""
    torch.manual_seed(0)
    params = {"a": torch.randn(8, 16), "b": torch.randn(300), "c": torch.randn(4, 4)}
    fast = pf.compile(pf.sgd(0.1), donate=True)
    p = {k: v.clone() for k, v in params.items()}
    fast.bind_buffers(p)
    state = fast.init(p)
    layout = fast.layout
    first = layout.flatten(p, what="params")
    again = layout.flatten(p, what="params")
    assert all(again[k] is first[k] for k in first), "a second flatten of the same views was not cached"
    assert layout.zero_copy(again)
    g = {k: torch.ones_like(v) for k, v in params.items()}
    want = {k: v - 0.1 for k, v in p.items()}
    out, state = fast.step(g, state, p)
    assert out is p and all(torch.equal(p[k], want[k]) for k in p)
    # rebinding a leaf to other storage: the cache must miss, and the step must reach it
    p["b"].data = p["b"].detach().clone()
    assert layout._cached_views(p, None, "params") is None
    before = {k: v.clone() for k, v in p.items()}
    out, state = fast.step(g, state, p)
    for k in p:
        torch.testing.assert_close(p[k], before[k] - 0.1)
    # a new dict holding copies (same keys): not the cached objects
    q = {k: v.clone() for k, v in p.items()}
    assert layout._cached_views(q, None, "params") is None
    # a dict with another key order is another tree
    r = dict(reversed(list(p.items())))
    assert layout._cached_views(r, None, "params") is None
