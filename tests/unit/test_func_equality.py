"""pgs.func against references: torch.optim (AdamW, SGD) and optax (adamw, lion, schedules).

Everything runs in fp64 so that the only differences are rounding in a different order:
torch.optim must agree to rtol 1e-10 over 50 steps, optax (jax on CPU, x64) to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

import pgs.func as pf

F64 = torch.float64
STEPS = 50


def _problem(seed: int = 0, steps: int = STEPS):
    """fp64 params (a matrix, a vector, a scalar) and ``steps`` gradient trees."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (7, 5), "b": (5,), "s": ()}
    params = {k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def _run_pf(opt, params, grads):
    """Params after each step of ``opt`` (a list of trees)."""
    state = opt.init(params)
    out = []
    for g in grads:
        u, state = opt.update(g, state, params)
        params = pf.apply_updates(params, u)
        out.append(params)
    return out


def _run_torch(make_optimizer, params, grads):
    ts = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    optimizer = make_optimizer(list(ts.values()))
    out = []
    for g in grads:
        for k, p in ts.items():
            p.grad = g[k].clone()
        optimizer.step()
        out.append({k: p.detach().clone() for k, p in ts.items()})
    return out


def _assert_trajectories(ours, ref, rtol, atol=0.0):
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref), start=1):
        for k in b:
            torch.testing.assert_close(
                a[k], torch.as_tensor(b[k], dtype=F64), rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {k!r}: {m}"
            )


# ----------------------------------------------------------------------------------------
# torch.optim


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_adamw_matches_torch_adamw(weight_decay, betas):
    params, grads = _problem(1)
    lr, eps = 3e-3, 1e-8
    ours = _run_pf(pf.adamw(lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay), params, grads)
    ref = _run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False),
        params,
        grads,
    )
    _assert_trajectories(ours, ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "momentum, nesterov, weight_decay",
    [(0.0, False, 0.0), (0.0, False, 1e-2), (0.9, False, 0.0), (0.9, False, 1e-2), (0.9, True, 0.0), (0.8, True, 1e-2)],
)
def test_sgd_matches_torch_sgd(momentum, nesterov, weight_decay):
    params, grads = _problem(2)
    lr = 1e-2
    ours = _run_pf(pf.sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay), params, grads)
    ref = _run_torch(
        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, foreach=False),
        params,
        grads,
    )
    _assert_trajectories(ours, ref, rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------------------
# optax (jax on CPU, fp64)


@pytest.fixture(scope="module")
def jx():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    return jax, jnp, optax


def _run_optax(jx, opt, params, grads):
    jax, jnp, optax = jx
    p = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    state = opt.init(p)
    out = []
    for g in grads:
        gj = {k: jnp.asarray(v.numpy()) for k, v in g.items()}
        u, state = opt.update(gj, state, p)
        p = optax.apply_updates(p, u)
        out.append({k: torch.from_numpy(jax.device_get(v).copy()) for k, v in p.items()})
    return out


def test_adamw_matches_optax(jx):
    _, _, optax = jx
    params, grads = _problem(3)
    kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    ours = _run_pf(pf.adamw(pf.cosine_schedule(1e-2, warmup=5, total=40, final=1e-4), **kw), params, grads)
    ref = _run_optax(jx, optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 40, 1e-4), **kw), params, grads)
    _assert_trajectories(ours, ref, rtol=1e-6, atol=1e-12)


def test_adamw_with_mask_matches_optax(jx):
    _, _, optax = jx
    params, grads = _problem(4)
    mask_tree = {"w": True, "b": False, "s": False}
    ours = _run_pf(pf.adamw(1e-2, weight_decay=0.1, mask=mask_tree), params, grads)
    ref = _run_optax(jx, optax.adamw(1e-2, weight_decay=0.1, mask=mask_tree), params, grads)
    _assert_trajectories(ours, ref, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_lion_matches_optax(jx, weight_decay):
    _, _, optax = jx
    params, grads = _problem(5)
    kw = dict(b1=0.95, b2=0.98, weight_decay=weight_decay)
    ours = _run_pf(pf.lion(pf.linear_warmup(3e-4, 10), **kw), params, grads)
    ref = _run_optax(jx, optax.lion(optax.linear_schedule(0.0, 3e-4, 10), **kw), params, grads)
    _assert_trajectories(ours, ref, rtol=1e-6, atol=1e-12)


def _steps(n: int):
    return range(n)


def _ours(schedule, steps):
    return [float(schedule(torch.tensor(s, dtype=torch.int32))) for s in steps]


def _theirs(jx, schedule, steps):
    # int64 steps: with an int32 count some optax schedules compute in float32
    _, jnp, _ = jx
    return [float(schedule(jnp.asarray(s, dtype=jnp.int64))) for s in steps]


def _assert_values(ours, ref, rtol=1e-6):
    for s, (a, b) in enumerate(zip(ours, ref)):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-15), f"step {s}: pgs {a!r} vs reference {b!r}"


@pytest.mark.parametrize(
    "init, peak, warmup, total, final",
    [(0.0, 1e-3, 10, 100, 0.0), (1e-5, 3e-4, 0, 50, 3e-5), (0.0, 1.0, 25, 26, 0.1), (2e-4, 1e-3, 7, 61, 1e-4)],
)
def test_cosine_matches_optax(jx, init, peak, warmup, total, final):
    _, _, optax = jx
    steps = _steps(total + 10)
    ours = _ours(pf.cosine_schedule(peak, warmup, total, final=final, init=init), steps)
    ref = _theirs(jx, optax.warmup_cosine_decay_schedule(init, peak, warmup, total, final), steps)
    _assert_values(ours, ref)


@pytest.mark.parametrize("init, peak, warmup", [(0.0, 1e-3, 10), (1e-4, 2e-3, 3), (0.5, 0.1, 20)])
def test_linear_warmup_matches_optax(jx, init, peak, warmup):
    _, _, optax = jx
    steps = _steps(warmup + 10)
    _assert_values(_ours(pf.linear_warmup(peak, warmup, init=init), steps), _theirs(jx, optax.linear_schedule(init, peak, warmup), steps))


def test_constant_matches_optax(jx):
    _, _, optax = jx
    steps = _steps(5)
    _assert_values(_ours(pf.constant_schedule(0.25), steps), _theirs(jx, optax.constant_schedule(0.25), steps))


def test_join_schedules_matches_optax(jx):
    _, _, optax = jx
    steps = _steps(120)
    ours = pf.join_schedules(
        [pf.linear_warmup(1e-3, 10), pf.constant_schedule(1e-3), pf.cosine_schedule(1e-3, 0, 50, final=1e-5)], [10, 60]
    )
    ref = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-3, 10), optax.constant_schedule(1e-3), optax.cosine_decay_schedule(1e-3, 50, alpha=1e-2)],
        [10, 60],
    )
    _assert_values(_ours(ours, steps), _theirs(jx, ref, steps))


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("warmup, init", [(0, 0.0), (12, 1e-5)])
def test_power_decay_matches_optax(jx, gamma, warmup, init):
    _, _, optax = jx
    peak, total = 2e-3, 80
    steps = _steps(total + 10)
    decay = optax.polynomial_schedule(init_value=peak, end_value=0.0, power=gamma, transition_steps=total - warmup)
    ref = decay if warmup == 0 else optax.join_schedules([optax.linear_schedule(init, peak, warmup), decay], [warmup])
    ours = pf.power_decay_schedule(peak, total, gamma=gamma, warmup=warmup, init=init)
    _assert_values(_ours(ours, steps), _theirs(jx, ref, steps))


def _wsd_direct(s, *, peak, warmup, stable, decay, shape, final, init, power):
    """WSD (docs/techniques/schedules.md) written out with Python floats, one step at a time."""
    if s < warmup:
        return init + (peak - init) * s / warmup
    if s <= warmup + stable:
        return peak
    z = min((s - warmup - stable) / decay, 1.0)
    if shape == "exponential":
        return peak * (final / peak) ** z
    f = {
        "linear": 1.0 - z,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * z)),
        "1-sqrt": 1.0 - math.sqrt(z),
        "power": (1.0 - z) ** power,
    }[shape]
    return final + (peak - final) * f


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt", "power", "exponential"])
@pytest.mark.parametrize("warmup, stable, decay", [(10, 50, 20), (0, 5, 1), (3, 0, 37)])
def test_wsd_matches_direct_transcription(shape, warmup, stable, decay):
    kw = dict(peak=1e-3, warmup=warmup, stable=stable, decay=decay, shape=shape, final=1e-5, init=1e-6, power=3.0)
    sched = pf.wsd_schedule(**kw)
    steps = _steps(warmup + stable + decay + 10)
    _assert_values(_ours(sched, steps), [_wsd_direct(s, **kw) for s in steps], rtol=1e-12)


# ----------------------------------------------------------------------------------------
# closed forms: the invariants of docs/techniques/lion.md and adamw.md


def _updates(opt, params, grads):
    state = opt.init(params)
    out = []
    for g in grads:
        u, state = opt.update(g, state, params)
        params = pf.apply_updates(params, u)
        out.append(u)
    return out, params, state


@pytest.mark.parametrize("seed", [0, 1])
def test_lion_moves_each_coordinate_by_exactly_lr_or_zero(seed):
    params, grads = _problem(10 + seed, steps=10)
    grads[0]["w"][0, :] = 0.0  # c = 0 on the first step: those coordinates must not move
    lr = 3e-4
    us, _, state = _updates(pf.lion(lr, b1=0.9, b2=0.99), params, grads)
    for u in us:
        for k, x in u.items():
            assert torch.all((x.abs() == lr) | (x == 0)), k
    assert torch.all(us[0]["w"][0] == 0) and torch.all(us[0]["w"][1:].abs() == lr)
    inner = state["0_scale_by_lion"]
    assert inner._fields == ("count", "mu"), "Lion keeps one state tensor per parameter"


def test_lion_is_invariant_to_gradient_scale():
    params, grads = _problem(12, steps=20)
    base, _, _ = _updates(pf.lion(1e-3, weight_decay=0.1), params, grads)
    for k in (0.25, 8.0, 1024.0):  # powers of two: the scaled run is exact, not just close
        scaled = [{n: g * k for n, g in gs.items()} for gs in grads]
        us, _, _ = _updates(pf.lion(1e-3, weight_decay=0.1), params, scaled)
        for a, b in zip(us, base):
            for n in a:
                assert torch.equal(a[n], b[n]), (k, n)


def test_lion_without_momentum_is_sign_sgd():
    params, grads = _problem(13, steps=5)
    us, _, _ = _updates(pf.lion(1e-3, b1=0.0, b2=0.0), params, grads)
    for u, g in zip(us, grads):
        for n in u:
            assert torch.equal(u[n], -1e-3 * torch.sign(g[n])), n


def test_adamw_without_decay_is_adam():
    params, grads = _problem(14, steps=20)
    a, _, _ = _updates(pf.adamw(1e-3, weight_decay=0.0), params, grads)
    b, _, _ = _updates(pf.chain(pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3)), params, grads)
    for x, y in zip(a, b):
        for n in x:
            assert torch.equal(x[n], y[n]), n


def test_adamw_first_step_is_bounded_by_lr():
    params, grads = _problem(15, steps=1)
    lr, eps = 1e-2, 1e-8
    (u,), _, _ = _updates(pf.adamw(lr, eps=eps, weight_decay=0.0), params, grads)
    for n, g in grads[0].items():
        torch.testing.assert_close(u[n].abs(), lr * g.abs() / (g.abs() + eps), rtol=1e-12, atol=0)
        assert torch.all(u[n].abs() <= lr)


def test_adamw_with_zero_gradients_decays_geometrically():
    params, _ = _problem(16, steps=0)
    lr, wd, steps = 1e-2, 0.1, 30
    zeros = [{n: torch.zeros_like(p) for n, p in params.items()} for _ in range(steps)]
    _, final, _ = _updates(pf.adamw(lr, weight_decay=wd), params, zeros)
    for n, p in params.items():
        torch.testing.assert_close(final[n], (1 - lr * wd) ** steps * p, rtol=1e-12, atol=0)


def test_adamw_decay_does_not_depend_on_the_gradient():
    params, grads = _problem(17, steps=3)
    lr, wd = 1e-2, 0.1
    with_wd, _, _ = _updates(pf.adamw(lr, weight_decay=wd), params, grads[:1])
    without, _, _ = _updates(pf.adamw(lr, weight_decay=0.0), params, grads[:1])
    for n, p in params.items():
        torch.testing.assert_close(with_wd[0][n] - without[0][n], -lr * wd * p, rtol=1e-9, atol=1e-15)
