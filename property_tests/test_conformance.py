"""The conformance suite: properties every registered transform must have.

Each entry of ``registry.ENTRIES`` is checked, over random pytrees (nested dicts and lists
of 1-3 tensors; 0-d, 1-D and 2-D leaves; fp32/fp64/bf16 as the entry allows; values that
include exact zeros), for:

- purity: ``init``/``update`` leave updates, state and params untouched (both paths);
- dtype preservation: updates keep the incoming dtype and shape; the state keeps its
  structure, shapes and dtypes from step to step;
- params: ``update(g, s, None)`` equals ``update(g, s, params)``, or, for an entry that
  needs params, raises a ``pgs.errors`` error;
- a state round-trip through safetensors bytes gives an identical next update (both paths);
- ``pf.inject_hyperparams`` gives the plain transform's results;
- ``pf.compile(opt, jit=False)`` (the flat layout) gives the per-parameter results over 3
  steps; entries with ``jit_check`` also run once under ``torch.compile``;
- ``pf.accumulate(opt, k)`` over k micro-steps equals one step on the mean gradient.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

import pgs.func as pf
from pgs.errors import PgsError
from pgs.func import tree as T

import registry
from registry import ENTRIES, Entry

IDS = [e.name for e in ENTRIES]
STEPS = 3

# ----------------------------------------------------------------------------------------
# random pytrees


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """What to build: the arrangement, each leaf's shape and dtype, and how to fill values."""

    kind: str  # "bare" | "dict" | "list" | "nested"
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    seed: int
    fill: str  # "normal" | "sparse" (about half exact zeros) | "zeros" (all-zero grads)
    scale: float  # gradient magnitude


@st.composite
def tree_specs(draw, entry: Entry) -> TreeSpec:
    dim = st.integers(1, entry.max_dim)
    n = draw(st.integers(1, 3))
    leaves = []
    for _ in range(n):
        ndim = draw(st.integers(entry.min_ndim, 2))
        shape = tuple(draw(dim) for _ in range(ndim))
        leaves.append((shape, draw(st.sampled_from(entry.dtypes))))
    kinds = ["dict", "list", "nested"] + (["bare"] if n == 1 else [])
    return TreeSpec(
        kind=draw(st.sampled_from(kinds)),
        leaves=tuple(leaves),
        seed=draw(st.integers(0, 2**31 - 1)),
        fill=draw(st.sampled_from(["normal", "normal", "sparse", "zeros"])),
        scale=draw(st.sampled_from([1e-3, 1.0, 1e3])),
    )


def _arrange(kind: str, xs: list):
    if kind == "bare":
        return xs[0]
    if kind == "dict":
        return {f"w{i}": x for i, x in enumerate(xs)}
    if kind == "list":
        return list(xs)
    # nested: {"layers": [{"weight": .., "bias": ..}, ...], "head": ..}
    head, rest = xs[-1], xs[:-1]
    layers = [{"weight": rest[i], **({"bias": rest[i + 1]} if i + 1 < len(rest) else {})} for i in range(0, len(rest), 2)]
    return {"layers": layers, "head": head}


def make_inputs(spec: TreeSpec, steps: int = STEPS):
    """``params`` and ``steps`` gradient trees, reproducible from ``spec.seed``."""
    gen = torch.Generator().manual_seed(spec.seed)

    def tensor(shape, dtype, scale, fill):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        if fill == "sparse":
            x = x * (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5)
        elif fill == "zeros":
            x = torch.zeros(shape, dtype=torch.float64)
        return x.to(dtype)

    params = _arrange(spec.kind, [tensor(s, d, 1.0, "sparse" if spec.fill == "sparse" else "normal") for s, d in spec.leaves])
    grads = [_arrange(spec.kind, [tensor(s, d, spec.scale, spec.fill) for s, d in spec.leaves]) for _ in range(steps)]
    return params, grads


# ----------------------------------------------------------------------------------------
# comparisons


def clone(tree):
    return T.tree_map(lambda x: x.clone(), tree)


def assert_same(a, b, what: str) -> None:
    """Bitwise equal trees (NaN equals NaN), same dtypes and shapes."""
    assert_close(a, b, 0.0, what)


def assert_close(a, b, tol: float, what: str) -> None:
    la, lb = T.leaves_with_paths(a), T.leaves_with_paths(b)
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: different leaf paths"
    for (path, x), (_, y) in zip(la, lb):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: leaf {path!r} is None on one side only"
            continue
        assert x.dtype == y.dtype, f"{what}: leaf {path!r} dtype {x.dtype} vs {y.dtype}"
        assert x.shape == y.shape, f"{what}: leaf {path!r} shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if tol == 0.0 or not x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: leaf {path!r}: {m}")
            continue
        rtol = max(tol, 2.0**-7) if x.dtype == torch.bfloat16 else tol
        atol = rtol * float(y.detach().double().abs().max()) if y.numel() else 0.0
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: leaf {path!r}: {m}")


def run_steps(opt, params, grads, state=None, with_params=True):
    """Run ``opt`` over ``grads``; returns (list of updates, final state).  Params stay fixed."""
    state = opt.init(params) if state is None else state
    outs = []
    for g in grads:
        u, state = opt.update(g, state, params if with_params else None)
        outs.append(u)
    return outs, state


def signature(state):
    """Paths, shapes and dtypes of a state's leaves."""
    return [(p, None if x is None else (tuple(x.shape), x.dtype)) for p, x in T.leaves_with_paths(state)]


def roundtrip(state):
    """state -> dict -> safetensors bytes -> dict -> state shaped like the original."""
    blob = safetensors.torch.save(pf.state_to_dict(state))
    return pf.state_from_dict(state, safetensors.torch.load(blob))


def entry_inputs(data, entry: Entry, steps: int = STEPS):
    return make_inputs(data.draw(tree_specs(entry), label="tree"), steps)


per_entry = pytest.mark.parametrize("entry", ENTRIES, ids=IDS)

# ----------------------------------------------------------------------------------------
# the registry itself


def test_registry_names_are_unique():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names)), f"duplicate entry names: {sorted({n for n in names if names.count(n) > 1})}"
    assert len(registry.BY_NAME) == len(ENTRIES)


def test_every_public_transform_is_registered():
    public = {"inject_hyperparams"}
    for name in pf.__all__:
        f = getattr(pf, name)
        if inspect.isfunction(f) and inspect.signature(f).return_annotation in ("Transform", pf.Transform):
            public.add(name)
    covered = {c for e in ENTRIES for c in e.covered()}
    missing = sorted(public - covered)
    assert not missing, f"public transforms without a conformance entry in property_tests/registry*.py: {missing}"


@per_entry
def test_entry_is_well_formed(entry: Entry):
    assert isinstance(entry.make(), pf.Transform)
    assert entry.dtypes and all(d.is_floating_point for d in entry.dtypes)
    assert 0 <= entry.min_ndim <= 2 and entry.max_dim >= 1 and entry.tol >= 0


# ----------------------------------------------------------------------------------------
# the properties


@per_entry
@given(data=st.data())
def test_purity(entry: Entry, data):
    params, grads = entry_inputs(data, entry)
    for opt in (entry.make(), pf.compile(entry.make(), jit=False)):
        p0 = clone(params)
        state = opt.init(params)
        assert_same(params, p0, "init changed params")
        for g in grads:
            g0, s0 = clone(g), clone(state)
            _, new_state = opt.update(g, state, params)
            assert_same(g, g0, "update changed its updates argument")
            assert_same(params, p0, "update changed params")
            assert_same(state, s0, "update changed the state it was given")
            state = new_state


@per_entry
@given(data=st.data())
def test_dtypes_and_state_are_stable(entry: Entry, data):
    params, grads = entry_inputs(data, entry)
    opt = entry.make()
    state = opt.init(params)
    sig0 = signature(state)
    for g in grads:
        u, state = opt.update(g, state, params)
        for (path, x), (_, y) in zip(T.leaves_with_paths(u), T.leaves_with_paths(g)):
            assert x.dtype == y.dtype, f"update of {path!r} is {x.dtype}, the incoming gradient was {y.dtype}"
            assert x.shape == y.shape, f"update of {path!r} has shape {tuple(x.shape)}, expected {tuple(y.shape)}"
        assert signature(state) == sig0, "the state changed structure, shape or dtype across steps"


@per_entry
@given(data=st.data())
def test_params_argument(entry: Entry, data):
    params, grads = entry_inputs(data, entry, steps=2)
    opt = entry.make()
    _, state = run_steps(opt, params, grads[:1])
    if entry.needs_params:
        with pytest.raises(PgsError):
            opt.update(grads[1], state, None)
    else:
        with_p, _ = opt.update(grads[1], state, params)
        without, _ = opt.update(grads[1], state, None)
        assert_same(without, with_p, "params=None vs params")


@per_entry
@given(data=st.data())
def test_state_roundtrip_through_safetensors(entry: Entry, data):
    params, grads = entry_inputs(data, entry)
    for opt in (entry.make(), pf.compile(entry.make(), jit=False)):
        _, state = run_steps(opt, params, grads[:2])
        loaded = roundtrip(state)
        assert signature(loaded) == signature(state)
        u_a, s_a = opt.update(grads[2], state, params)
        u_b, s_b = opt.update(grads[2], loaded, params)
        assert_same(u_b, u_a, "next update after a safetensors round-trip")
        assert_same(s_b, s_a, "next state after a safetensors round-trip")


@per_entry
@given(data=st.data())
def test_state_loads_in_place_into_a_fresh_init(entry: Entry, data):
    """What a resume does (``BoundOptimizer.load_state_dict``): each saved entry copied into the
    tensors of a freshly initialised state (``pf.state_entries``, ``leaf.copy_``).  Holds only if
    no two leaves of ``init``'s state share memory; the next update then equals the original's."""
    params, grads = entry_inputs(data, entry)
    for opt in (entry.make(), pf.compile(entry.make(), jit=False)):
        _, state = run_steps(opt, params, grads[:2])
        saved = safetensors.torch.load(safetensors.torch.save(pf.state_to_dict(state)))
        fresh = opt.init(params)
        with torch.no_grad():
            for leaf, value in pf.state_entries(fresh, saved):
                leaf.copy_(value)
        assert signature(fresh) == signature(state)
        u_a, s_a = opt.update(grads[2], state, params)
        u_b, s_b = opt.update(grads[2], fresh, params)
        assert_same(u_b, u_a, "next update after loading in place")
        assert_same(s_b, s_a, "next state after loading in place")


@per_entry
@given(data=st.data())
def test_inject_hyperparams_matches_plain(entry: Entry, data):
    if entry.inject is None:
        pytest.skip(f"{entry.name}: no inject recipe ({entry.notes})")
    params, grads = entry_inputs(data, entry)
    recipe = entry.inject
    plain = recipe.factory(**recipe.kwargs)
    injected = pf.inject_hyperparams(recipe.factory, static_args=recipe.static_args)(**recipe.kwargs)
    u_plain, _ = run_steps(plain, params, grads)
    u_inj, state = run_steps(injected, params, grads)
    assert isinstance(state, pf.InjectHyperparamsState)
    for i, (a, b) in enumerate(zip(u_inj, u_plain)):
        assert_close(a, b, entry.tol, f"step {i + 1}: injected vs plain")


@per_entry
@given(data=st.data())
def test_flat_layout_matches_reference(entry: Entry, data):
    params, grads = entry_inputs(data, entry)
    ref, _ = run_steps(entry.make(), params, grads)
    flat, _ = run_steps(pf.compile(entry.make(), jit=False), params, grads)
    for i, (a, b) in enumerate(zip(flat, ref)):
        assert_close(a, b, entry.tol, f"step {i + 1}: pf.compile(jit=False) vs reference")


@per_entry
@given(data=st.data(), every=st.integers(2, 3))
def test_accumulate_equals_one_step_on_the_mean(entry: Entry, data, every: int):
    if not entry.accumulate_ok:
        pytest.skip(f"{entry.name}: accumulate_ok=False ({entry.notes})")
    params, grads = entry_inputs(data, entry, steps=2 * every)
    opt, acc = entry.make(), pf.accumulate(entry.make(), every)
    ref_state, acc_state = opt.init(params), acc.init(params)
    for cycle in range(2):
        micro = grads[cycle * every : (cycle + 1) * every]
        inner_before = clone(acc_state.inner_state)
        for j, g in enumerate(micro):
            u, acc_state = acc.update(g, acc_state, params)
            if j < every - 1:
                assert_same(u, T.tree_map(torch.zeros_like, g), f"micro-step {j + 1} must emit zeros")
                assert_same(acc_state.inner_state, inner_before, f"micro-step {j + 1} touched the inner state")
        # the mean as the wrapper defines it: summed in fp32 (fp64 for fp64), divided, cast back
        total = T.tree_map(lambda x: torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32)), params)
        for g in micro:
            total = T.tree_map(lambda a, x: a + x.to(a.dtype), total, g)
        mean = T.tree_map(lambda a, x: (a / every).to(x.dtype), total, micro[0])
        ref_u, ref_state = opt.update(mean, ref_state, params)
        assert_same(u, ref_u, f"cycle {cycle + 1}: accumulate({every}) vs one step on the mean")


# ----------------------------------------------------------------------------------------
# torch.compile: one fixed tree per entry (compiling on CPU takes seconds)

JIT_ENTRIES = [e for e in ENTRIES if e.jit_check]


def _fixed_tree(entry: Entry):
    gen = torch.Generator().manual_seed(1234)
    shapes = {"w": (8, 6), "v": (6, 4), "b": (6,)}
    dtypes = [d for d in (torch.float32, torch.bfloat16) if d in entry.dtypes] or list(entry.dtypes)
    params, grads = {}, [{}, {}]
    for i, (k, s) in enumerate(shapes.items()):
        if len(s) < entry.min_ndim:
            continue
        d = dtypes[i % len(dtypes)]
        params[k] = torch.randn(s, generator=gen).to(d)
        for g in grads:
            g[k] = torch.randn(s, generator=gen).to(d)
    return params, grads


@pytest.mark.parametrize("entry", JIT_ENTRIES, ids=[e.name for e in JIT_ENTRIES])
def test_jit_matches_reference(entry: Entry):
    torch._dynamo.reset()
    params, grads = _fixed_tree(entry)
    ref, _ = run_steps(entry.make(), params, grads)
    jit, _ = run_steps(pf.compile(entry.make(), jit=True), params, grads)
    for i, (a, b) in enumerate(zip(jit, ref)):
        tol = max(entry.tol, 1e-5) if entry.jit_tol is None else entry.jit_tol
        assert_close(a, b, tol, f"step {i + 1}: pf.compile(jit=True) vs reference")
