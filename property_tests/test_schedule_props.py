"""Invariants of the power-decay (B1) and WSD (B2) schedules of docs/techniques/schedules.md, as properties.

Schedules are evaluated on float64 step tensors, which lets the continuity checks probe
fractional steps on either side of a phase boundary.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pgs.func as pf

F64 = torch.float64
# Schedules are cheap scalar maths: afford many more examples than the profile's default.
many = settings(max_examples=max(settings().max_examples, 100))

peaks = st.floats(1e-6, 10.0)
gammas = st.floats(0.0, 8.0)
totals = st.integers(1, 5_000)


def values(schedule, steps) -> torch.Tensor:
    return schedule(torch.as_tensor(steps, dtype=F64))


def grid(lo: float, hi: float, n: int = 257) -> torch.Tensor:
    """``n`` float64 points from lo to hi, plus every integer step in between when few."""
    pts = torch.linspace(lo, hi, n, dtype=F64)
    if hi - lo <= 2_000:
        pts = torch.cat([pts, torch.arange(math.ceil(lo), math.floor(hi) + 1, dtype=F64)])
    return pts.sort().values


def assert_non_increasing(v: torch.Tensor, what: str) -> None:
    d = v[1:] - v[:-1]
    worst = int(d.argmax())
    assert float(d.max()) <= 0.0, f"{what}: increases by {float(d[worst])!r} at grid point {worst}"


# ----------------------------------------------------------------------------------------
# B1: power decay  η(z) = η_peak (1 − z/N)^γ


@many
@given(peak=peaks, total=totals, gamma=gammas)
def test_power_decay_starts_at_peak(peak, total, gamma):
    assert float(values(pf.power_decay_schedule(peak, total, gamma=gamma), 0.0)) == peak


@many
@given(peak=peaks, total=totals, gamma=st.floats(1e-3, 8.0))
def test_power_decay_ends_at_zero_and_stays_clamped(peak, total, gamma):
    s = pf.power_decay_schedule(peak, total, gamma=gamma)
    beyond = values(s, [total, total + 1, total + 7.5, 10 * total + 3])
    assert torch.all(beyond == 0.0), beyond


@many
@given(peak=peaks, total=totals, gamma=gammas, warmup=st.integers(0, 200))
def test_power_decay_is_monotone_after_warmup_and_never_negative(peak, total, gamma, warmup):
    total = total + warmup
    s = pf.power_decay_schedule(peak, total, gamma=gamma, warmup=warmup)
    v = values(s, grid(warmup, total + 10))
    assert_non_increasing(v, "power decay")
    assert torch.all(v >= 0.0)
    assert float(values(s, warmup)) == peak


@many
@given(peak=peaks, total=totals)
def test_power_decay_gamma_zero_is_constant(peak, total):
    v = values(pf.power_decay_schedule(peak, total, gamma=0.0), grid(0, total + 10))
    assert torch.all(v == peak)


@many
@given(peak=peaks, total=totals)
def test_power_decay_gamma_one_is_linear(peak, total):
    z = grid(0, total)
    v = values(pf.power_decay_schedule(peak, total, gamma=1.0), z)
    torch.testing.assert_close(v, peak * (1.0 - z / total), rtol=1e-12, atol=1e-15 * peak)


@many
@given(peak=peaks, total=st.integers(2, 5_000), g1=gammas, g2=gammas)
def test_power_decay_larger_gamma_is_pointwise_smaller(peak, total, g1, g2):
    assume(abs(g1 - g2) > 1e-9)
    lo, hi = sorted((g1, g2))
    z = grid(0, total)[1:-1]  # the open interval (0, N)
    v_lo = values(pf.power_decay_schedule(peak, total, gamma=lo), z)
    v_hi = values(pf.power_decay_schedule(peak, total, gamma=hi), z)
    assert torch.all(v_hi <= v_lo), float((v_hi - v_lo).max())


@many
@given(peak=peaks, total=totals, gamma=gammas, warmup=st.integers(1, 200), init_frac=st.floats(0.0, 1.0))
def test_power_decay_warmup_is_linear_and_continuous(peak, total, gamma, warmup, init_frac):
    init = peak * init_frac
    total = total + warmup
    s = pf.power_decay_schedule(peak, total, gamma=gamma, warmup=warmup, init=init)
    z = grid(0, warmup)[:-1]
    torch.testing.assert_close(values(s, z), init + (peak - init) * z / warmup, rtol=1e-12, atol=1e-15 * peak)
    eps = 1e-9
    assert abs(float(values(s, warmup - eps)) - peak) <= (peak - init) * eps / warmup * 1.01 + 1e-15 * peak


# ----------------------------------------------------------------------------------------
# B2: WSD


@st.composite
def wsd_configs(draw):
    shape = draw(st.sampled_from(["linear", "cosine", "1-sqrt", "power", "exponential"]))
    peak = draw(peaks)
    lo_final = 1e-3 if shape == "exponential" else 0.0  # exponential needs final > 0
    return dict(
        peak=peak,
        warmup=draw(st.integers(0, 300)),
        stable=draw(st.integers(0, 2_000)),
        decay=draw(st.integers(1, 1_000)),
        shape=shape,
        final=peak * draw(st.floats(lo_final, 1.0)),
        init=peak * draw(st.floats(0.0, 1.0)),
        power=draw(st.floats(0.5, 6.0)),
    )


@many
@given(cfg=wsd_configs())
def test_wsd_is_continuous_at_warmup_end_and_stable_end(cfg):
    s = pf.wsd_schedule(**cfg)
    peak, w, t, d = cfg["peak"], cfg["warmup"], cfg["warmup"] + cfg["stable"], cfg["decay"]
    eps = 1e-10
    if w > 0:
        left = float(values(s, w - eps))
        assert abs(left - peak) <= (peak - cfg["init"]) * eps / w * 1.01 + 1e-15 * peak
    # right of T: ≤ a Lipschitz bound per shape, and √z for 1-sqrt (not Lipschitz at 0)
    z = eps / d
    slope = {"linear": 1.0, "cosine": math.pi / 2, "1-sqrt": 0.0, "power": cfg["power"]}.get(cfg["shape"], 0.0)
    if cfg["shape"] == "exponential":
        slope = abs(math.log(cfg["final"] / peak)) if cfg["final"] < peak else 0.0
    bound = (peak - cfg["final"]) * (slope * z + (math.sqrt(z) if cfg["shape"] == "1-sqrt" else 0.0))
    if cfg["shape"] == "exponential":
        bound = peak * slope * z
    right = float(values(s, t + eps))
    assert abs(right - peak) <= bound * 1.01 + 1e-14 * peak, (right, peak, bound)


@many
@given(cfg=wsd_configs())
def test_wsd_is_exactly_constant_on_the_stable_phase(cfg):
    s = pf.wsd_schedule(**cfg)
    w, t = cfg["warmup"], cfg["warmup"] + cfg["stable"]
    assert torch.all(values(s, grid(w, t)) == cfg["peak"])


@many
@given(cfg=wsd_configs())
def test_wsd_is_monotone_after_warmup(cfg):
    s = pf.wsd_schedule(**cfg)
    w, end = cfg["warmup"], cfg["warmup"] + cfg["stable"] + cfg["decay"]
    v = values(s, grid(w, end + 10))
    assert_non_increasing(v, f"wsd {cfg['shape']}")
    assert torch.all(v > 0.0) if cfg["final"] > 0 else torch.all(v >= 0.0)


@many
@given(cfg=wsd_configs())
def test_wsd_endpoints(cfg):
    s = pf.wsd_schedule(**cfg)
    w, t, end = cfg["warmup"], cfg["warmup"] + cfg["stable"], cfg["warmup"] + cfg["stable"] + cfg["decay"]
    assert float(values(s, 0)) == (cfg["init"] if w > 0 else cfg["peak"])
    assert float(values(s, t)) == cfg["peak"]  # f(0) = 1
    tail = values(s, [end, end + 1, end + 100.5])
    torch.testing.assert_close(tail, torch.full_like(tail, cfg["final"]), rtol=1e-12, atol=1e-15 * cfg["peak"])


@many
@given(cfg=wsd_configs(), other_decay=st.integers(1, 1_000))
def test_wsd_stable_value_does_not_depend_on_decay_length(cfg, other_decay):
    a = pf.wsd_schedule(**cfg)
    b = pf.wsd_schedule(**{**cfg, "decay": other_decay})
    z = grid(0, cfg["warmup"] + cfg["stable"])
    assert torch.equal(values(a, z), values(b, z))


def test_wsd_stable_phase_is_exact_for_many_peak_final_pairs():
    """A dense deterministic sweep next to the properties above: ``final + (peak − final)·1``
    differs from ``peak`` by an ulp for many pairs, so the stable phase must not compute it."""
    gen = torch.Generator().manual_seed(0)
    peaks_, fracs = torch.rand(300, generator=gen, dtype=F64) * 10, torch.rand(300, generator=gen, dtype=F64)
    for peak, frac in zip(peaks_.tolist(), fracs.tolist()):
        for shape in ("linear", "cosine", "1-sqrt", "power"):
            s = pf.wsd_schedule(peak, warmup=3, stable=4, decay=5, shape=shape, final=peak * frac)
            assert torch.all(values(s, [3.0, 5.5, 7.0]) == peak), (peak, frac, shape)
