"""Schedule-free optimization (arXiv 2405.15682): ``pf.schedule_free`` and
``pf.schedule_free_adamw`` against the paper's equations written out here (x kept explicitly),
against the reference algorithm's y-only form, and against optax's implementation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pgs.func as pf
from pgs.errors import InvalidArgument

F64 = torch.float64


def _problem(seed: int = 0, n: int = 6):
    """A convex quadratic f(θ) = ½ θᵀAθ − bᵀθ (its gradient is exact) and a start."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=F64)
    a = m @ m.T / n + 0.1 * torch.eye(n, dtype=F64)
    b = torch.randn(n, generator=g, dtype=F64)
    theta0 = torch.randn(n, generator=g, dtype=F64)
    return (lambda th: a @ th - b), theta0


def _warmup(peak: float, steps: int):
    return lambda t: peak * min(1.0, (t + 1) / steps)


def _torch_schedule(fn):
    return lambda count: torch.tensor(fn(int(count)), dtype=F64)


# ---------------------------------------------------------------------------------------
# the paper's equations, written independently of pgs (x, y and z all kept)


def _paper(grad, theta0, lrs, beta, power, direction):
    """y_t = (1−β) z_t + β x_t ; z_{t+1} = z_t − γ_t d(y_t) ; x_{t+1} = (1−c) x_t + c z_{t+1} ;
    c_{t+1} = w_t / Σ_{i≤t} w_i , w_t = (max_{i≤t} γ_i)^p."""
    z, x = theta0.clone(), theta0.clone()
    lr_max, wsum, ys, xs = 0.0, 0.0, [], []
    d_state: dict = {}
    for t, lr in enumerate(lrs):
        y = (1 - beta) * z + beta * x
        z = z - lr * direction(grad(y), y, t, d_state)
        lr_max = max(lr_max, lr)
        w = lr_max ** power
        wsum += w
        c = w / wsum if wsum > 0 else 0.0
        x = (1 - c) * x + c * z
        ys.append((1 - beta) * z + beta * x)
        xs.append(x.clone())
    return ys, xs


def _sgd_direction(g, y, t, st):
    return g


def _adamw_direction(b2, eps, wd):
    def d(g, y, t, st):
        st["v"] = b2 * st.get("v", torch.zeros_like(g)) + (1 - b2) * g * g
        return g / (torch.sqrt(st["v"] / (1 - b2 ** (t + 1))) + eps) + wd * y
    return d


def _run_pgs(opt, grad, theta0, steps):
    params = {"w": theta0.clone()}
    state = opt.init(params)
    ys, xs = [], []
    for _ in range(steps):
        updates, state = opt.update({"w": grad(params["w"])}, state, params)
        params = pf.apply_updates(params, updates)
        ys.append(params["w"].clone())
        xs.append(pf.schedule_free_eval_params(params, state)["w"])
    return ys, xs, state


@pytest.mark.parametrize("beta", [0.9, 0.5, 1.0])
@pytest.mark.parametrize("power", [2.0, 0.0])
@pytest.mark.parametrize("warm", [1, 7])
def test_sgd_base_follows_the_paper(beta, power, warm):
    grad, theta0 = _problem(1)
    lr_fn = _warmup(0.3, warm)
    steps = 25
    want_y, want_x = _paper(grad, theta0, [lr_fn(t) for t in range(steps)], beta, power, _sgd_direction)
    sched = _torch_schedule(lr_fn)
    opt = pf.schedule_free(pf.scale_by_learning_rate(sched), sched, b1=beta, weight_lr_power=power)
    got_y, got_x, _ = _run_pgs(opt, grad, theta0, steps)
    for t in range(steps):
        torch.testing.assert_close(got_y[t], want_y[t], rtol=1e-11, atol=1e-12, msg=f"y at step {t}")
        torch.testing.assert_close(got_x[t], want_x[t], rtol=1e-11, atol=1e-12, msg=f"x at step {t}")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(beta=st.floats(0.05, 1.0), power=st.floats(0.0, 3.0),
       lrs=st.lists(st.one_of(st.just(0.0), st.floats(1e-4, 0.5)), min_size=1, max_size=12),
       seed=st.integers(0, 50))
def test_any_learning_rates_follow_the_paper(beta, power, lrs, seed):
    """Arbitrary β, p and per-step learning rates (zeros, rises and falls included)."""
    grad, theta0 = _problem(seed, n=3)
    want_y, want_x = _paper(grad, theta0, lrs, beta, power, _sgd_direction)
    table = torch.tensor(lrs, dtype=F64)
    sched = lambda count: table[int(count)]  # noqa: E731
    opt = pf.schedule_free(pf.scale_by_learning_rate(sched), sched, b1=beta, weight_lr_power=power)
    got_y, got_x, _ = _run_pgs(opt, grad, theta0, len(lrs))
    for t in range(len(lrs)):
        torch.testing.assert_close(got_y[t], want_y[t], rtol=1e-10, atol=1e-12, msg=f"y at step {t}")
        torch.testing.assert_close(got_x[t], want_x[t], rtol=1e-9, atol=1e-10, msg=f"x at step {t}")


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adamw_follows_the_paper(wd):
    grad, theta0 = _problem(2)
    lr_fn = _warmup(0.05, 5)
    steps = 30
    want_y, want_x = _paper(grad, theta0, [lr_fn(t) for t in range(steps)], 0.9, 2.0,
                            _adamw_direction(0.99, 1e-8, wd))
    opt = pf.schedule_free_adamw(_torch_schedule(lr_fn), b1=0.9, b2=0.99, eps=1e-8, weight_decay=wd)
    got_y, got_x, _ = _run_pgs(opt, grad, theta0, steps)
    for t in range(steps):
        torch.testing.assert_close(got_y[t], want_y[t], rtol=1e-10, atol=1e-12, msg=f"y at step {t}")
        torch.testing.assert_close(got_x[t], want_x[t], rtol=1e-10, atol=1e-12, msg=f"x at step {t}")


def test_adamw_follows_the_reference_y_only_form():
    """The reference implementation's update of y without x: y ← lerp(y, z, c) + γ(β(1−c) − 1) d ;
    z ← z − γ d, with the weight decay at y."""
    grad, theta0 = _problem(3)
    lr_fn, beta, b2, eps, wd, steps = _warmup(0.02, 4), 0.9, 0.999, 1e-8, 0.1, 20
    y, z, v = theta0.clone(), theta0.clone(), torch.zeros_like(theta0)
    lr_max, wsum, want = 0.0, 0.0, []
    for k in range(steps):
        lr = lr_fn(k)
        g = grad(y)
        v = b2 * v + (1 - b2) * g * g
        d = g / ((v / (1 - b2 ** (k + 1))).sqrt() + eps) + wd * y
        lr_max = max(lr_max, lr)
        wsum += lr_max ** 2
        c = lr_max ** 2 / wsum
        y = y + c * (z - y) + lr * (beta * (1 - c) - 1) * d
        z = z - lr * d
        want.append(y.clone())
    opt = pf.schedule_free_adamw(_torch_schedule(lr_fn), b1=beta, b2=b2, eps=eps, weight_decay=wd)
    got, _, _ = _run_pgs(opt, grad, theta0, steps)
    for t in range(steps):
        torch.testing.assert_close(got[t], want[t], rtol=1e-10, atol=1e-12, msg=f"y at step {t}")


# ---------------------------------------------------------------------------------------
# optax (a trusted implementation), in float64


def _optax():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    pytest.importorskip("optax.contrib")
    jax.config.update("jax_enable_x64", True)
    return jax, optax


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_adamw_matches_optax_at_a_constant_learning_rate(wd):
    jax, optax = _optax()
    import jax.numpy as jnp
    import numpy as np

    grad, theta0 = _problem(4)
    steps, lr = 40, 0.01
    ref = optax.contrib.schedule_free_adamw(lr, b1=0.9, b2=0.995, eps=1e-8, weight_decay=wd)
    p = jnp.asarray(theta0.numpy())
    s = ref.init(p)
    want_y, want_x = [], []
    for _ in range(steps):
        g = jnp.asarray(grad(torch.from_numpy(np.asarray(p))).numpy())
        u, s = ref.update(g, s, p)
        p = optax.apply_updates(p, u)
        want_y.append(torch.from_numpy(np.asarray(p)))
        want_x.append(torch.from_numpy(np.asarray(optax.contrib.schedule_free_eval_params(s, p))))
    opt = pf.schedule_free_adamw(lr, b1=0.9, b2=0.995, eps=1e-8, weight_decay=wd)
    got_y, got_x, _ = _run_pgs(opt, grad, theta0, steps)
    assert want_y[0].dtype == F64
    for t in range(steps):
        torch.testing.assert_close(got_y[t], want_y[t], rtol=1e-9, atol=1e-12, msg=f"y at step {t}")
        torch.testing.assert_close(got_x[t], want_x[t], rtol=1e-9, atol=1e-12, msg=f"x at step {t}")


def test_warmup_matches_optax_with_its_count_aligned():
    """optax evaluates the averaging weight's schedule at a count that starts at 1 and the
    base's at a count that starts at 0; pgs evaluates both at the step being taken (as the
    paper and its reference do).  Given the same learning rate per step, they agree."""
    jax, optax = _optax()
    import jax.numpy as jnp
    import numpy as np

    grad, theta0 = _problem(5)
    steps, peak, warm = 30, 0.02, 6
    lr_fn = _warmup(peak, warm)
    base_sched = lambda n: peak * jnp.minimum(1.0, (jnp.asarray(n, jnp.float64) + 1) / warm)  # noqa: E731
    base = optax.chain(optax.scale_by_adam(b1=0.0, b2=0.99, eps=1e-8), optax.add_decayed_weights(0.02),
                       optax.scale_by_learning_rate(base_sched))
    ref = optax.contrib.schedule_free(base, lambda n: base_sched(n - 1), b1=0.9)
    p = jnp.asarray(theta0.numpy())
    s = ref.init(p)
    want = []
    for _ in range(steps):
        g = jnp.asarray(grad(torch.from_numpy(np.asarray(p))).numpy())
        u, s = ref.update(g, s, p)
        p = optax.apply_updates(p, u)
        want.append(torch.from_numpy(np.asarray(optax.contrib.schedule_free_eval_params(s, p))))
    opt = pf.schedule_free_adamw(_torch_schedule(lr_fn), b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.02)
    _, got, _ = _run_pgs(opt, grad, theta0, steps)
    for t in range(steps):
        torch.testing.assert_close(got[t], want[t], rtol=1e-9, atol=1e-12, msg=f"x at step {t}")


# ---------------------------------------------------------------------------------------
# the contract


def _tree(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(5, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype)}


def test_pure_state_scalars_and_eval_point_before_any_step():
    params = _tree()
    opt = pf.schedule_free_adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    assert isinstance(state, pf.ScheduleFreeState)
    for name in ("count", "b1", "lr_max", "weight_sum", "c"):
        assert getattr(state, name).ndim == 0, name  # per-step hyperparameters: 0-d tensors
    x0 = pf.schedule_free_eval_params(params, state)
    assert all(torch.equal(x0[k], params[k]) for k in params)  # x_0 = y_0 = z_0
    p0 = {k: v.clone() for k, v in params.items()}
    g = {k: torch.ones_like(v) for k, v in params.items()}
    g0 = {k: v.clone() for k, v in g.items()}
    s0 = pf.state_to_dict(state)
    updates, new = opt.update(g, state, params)
    assert all(torch.equal(params[k], p0[k]) and torch.equal(g[k], g0[k]) for k in params)
    assert all(torch.equal(v, pf.state_to_dict(state)[k]) for k, v in s0.items())  # inputs untouched
    assert int(new.count) == 1 and float(new.c) == 1.0  # the first step: x_1 = z_1
    # after one step y_1 = x_1 = z_1 = y_0 + u_0
    stepped = pf.apply_updates(params, updates)
    x1 = pf.schedule_free_eval_params(stepped, new)
    assert all(torch.allclose(x1[k], stepped[k], atol=1e-7) and torch.allclose(new.z[k], stepped[k], atol=1e-7)
               for k in params)


def test_zero_learning_rate_steps_leave_everything_in_place():
    params = _tree(F64)
    sched = _torch_schedule(lambda t: 0.0 if t < 3 else 0.1)
    opt = pf.schedule_free(pf.scale_by_learning_rate(sched), sched)
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
        assert all(torch.count_nonzero(u) == 0 for u in updates.values())
        assert float(state.c) == 0.0
    updates, state = opt.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
    assert float(state.c) == 1.0 and all(torch.allclose(u, torch.full_like(u, -0.1)) for u in updates.values())


def test_bf16_parameters_with_an_fp32_z():
    params = _tree(torch.bfloat16)
    opt = pf.schedule_free_adamw(1e-3, z_dtype=torch.float32, nu_dtype=torch.float32)
    state = opt.init(params)
    assert state.z["w"].dtype == torch.float32
    for _ in range(3):
        updates, state = opt.update({k: torch.randn_like(v.float()).bfloat16() for k, v in params.items()},
                                    state, params)
        assert updates["w"].dtype == torch.bfloat16
        params = pf.apply_updates(params, updates)
    x = pf.schedule_free_eval_params(params, state)
    assert x["w"].dtype == torch.bfloat16 and all(torch.isfinite(v.float()).all() for v in x.values())


def test_runs_on_the_flat_layout_and_injected():
    params = _tree(F64)
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(4)]

    def run(opt):
        p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
        for g in grads:
            u, s = opt.update(g, s, p)
            p = pf.apply_updates(p, u)
        return p

    plain = run(pf.schedule_free_adamw(1e-2, weight_decay=0.1))
    flat = run(pf.compile(pf.schedule_free_adamw(1e-2, weight_decay=0.1), jit=False))
    injected = run(pf.inject_hyperparams(pf.schedule_free_adamw)(learning_rate=1e-2, weight_decay=0.1))
    for k in params:
        torch.testing.assert_close(flat[k], plain[k], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(injected[k], plain[k], rtol=1e-12, atol=1e-14)


def test_refusals_name_the_argument():
    with pytest.raises(InvalidArgument, match="b1"):
        pf.schedule_free_adamw(1e-3, b1=0.0)
    with pytest.raises(InvalidArgument, match="weight_lr_power"):
        pf.schedule_free(pf.sgd(1e-3), 1e-3, weight_lr_power=-1.0)
    with pytest.raises(InvalidArgument, match="veto"):
        pf.schedule_free(pf.chain(pf.zclip(mode="skip"), pf.sgd(1e-3)), 1e-3)
    opt = pf.schedule_free_adamw(1e-3)
    params = _tree()
    with pytest.raises(InvalidArgument, match="needs params"):
        opt.update(params, opt.init(params), None)
    with pytest.raises(InvalidArgument, match="0 schedule-free states"):
        pf.schedule_free_eval_params(params, pf.adamw(1e-3).init(params))
    from pgs.func.base import no_step_stage

    assert no_step_stage(pf.schedule_free(pf.scale_by_adam(b1=0.0), 1e-3)) is not None  # no learning rate: refused
    assert no_step_stage(pf.schedule_free_adamw(1e-3)) is None


def test_eval_point_found_inside_a_chain():
    params = _tree(F64)
    opt = pf.chain(pf.clip_by_global_norm(1.0), pf.schedule_free_adamw(1e-2))
    state = opt.init(params)
    for _ in range(3):
        u, state = opt.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
        params = pf.apply_updates(params, u)
    sf = state["1_schedule_free"]
    x = pf.schedule_free_eval_params(params, state)
    beta = float(sf.b1)
    for k in params:
        torch.testing.assert_close(x[k], (params[k] - (1 - beta) * sf.z[k]) / beta)


def test_schedule_free_learns_a_quadratic_at_x():
    grad, theta0 = _problem(6)
    a = torch.func.jacrev(grad)(theta0)  # the quadratic's matrix
    opt = pf.schedule_free_adamw(_torch_schedule(_warmup(0.05, 10)))
    _, xs, _ = _run_pgs(opt, grad, theta0, 300)
    star = theta0 - torch.linalg.solve(a, grad(theta0))

    def gap(th):  # f(θ) − f(θ*) = ½ (θ−θ*)ᵀ A (θ−θ*)
        return float(0.5 * (th - star) @ a @ (th - star))

    assert gap(xs[-1]) < 0.05 * gap(theta0)


# ---------------------------------------------------------------------------------------
# from a spec: the alias, evaluation and export at x, the refusals


def _spec_text(tmp_path, **changes):
    from helpers import tiny_spec

    path = tiny_spec(tmp_path, "run", **changes)
    text = path.read_text().replace('alias = "adamw"', 'alias = "schedule_free_adamw"')
    text = text.replace('name = "cosine"\npeak = 3e-3\nwarmup = 3', 'name = "linear_warmup"\npeak = 3e-3\nwarmup = 2')
    assert "schedule_free_adamw" in text and "linear_warmup" in text
    path.write_text(text)
    return path


def test_spec_alias_builds_and_offloaded_state_is_refused_in_one_line(tmp_path):
    from pgs.errors import SpecError
    from pgs.func.schedule_free_iterates import wraps_schedule_free
    from pgs.runtime.spec.chain import alias_names, check_spec
    from pgs.runtime.spec.load import load_spec

    assert "schedule_free_adamw" in alias_names()
    spec = load_spec(_spec_text(tmp_path))
    check_spec(spec)
    assert wraps_schedule_free(spec.build_chain()) and not wraps_schedule_free(pf.adamw(1e-3))
    released = ["memory.gradient_release=true", "train.grad_accum=1", "optimizer.clip=0"]
    check_spec(load_spec(_spec_text(tmp_path), released))
    with pytest.raises(SpecError, match=r"^memory.offload_optimizer: a schedule-free optimizer .*"
                                        r"set memory.offload_optimizer = false$"):
        load_spec(_spec_text(tmp_path), [*released, "memory.offload_optimizer=true"])


@pytest.mark.parametrize("release", [False, True])
def test_a_run_evaluates_and_exports_the_averaged_point(tmp_path, release):
    from safetensors.torch import load_file

    from helpers import records
    from pgs.runtime.loop.train import run
    from pgs.runtime.spec.load import load_spec

    overrides = ["memory.gradient_release=true", "train.grad_accum=1", "optimizer.clip=0"] if release else []
    assert run(load_spec(_spec_text(tmp_path, steps=3, every=3, export="true", eval_every=3), overrides)) == 0
    run_dir = tmp_path / "run"
    y = load_file(run_dir / "step_3" / "model.safetensors")  # the stepped weights (y) and the state (z)
    state = load_file(run_dir / "step_3" / "optimizer.safetensors")
    exported = load_file(run_dir / "final" / "model.safetensors")
    z_of, beta_of = {}, {}  # one schedule-free state, or one per release group
    for b1_key in [k for k in state if k == "b1" or k.endswith(".b1")]:  # the wrapper's β
        prefix = b1_key[: -len("b1")] + "z."
        for k in state:
            if k.startswith(prefix):
                z_of[k[len(prefix):]], beta_of[k[len(prefix):]] = state[k], float(state[b1_key])
    assert set(z_of) >= set(exported) and all(b == pytest.approx(0.9) for b in beta_of.values())
    moved = 0
    for name, w in exported.items():
        z, beta = z_of[name], beta_of[name]
        x = (y[name].float() + (y[name].float() - z.float()) * ((1 - beta) / beta)).to(w.dtype)
        torch.testing.assert_close(w, x, rtol=1e-6, atol=1e-7, msg=name)
        moved += int(not torch.equal(w, y[name]))
    assert moved > 0  # x is not y after three steps
    evals = [r for r in records(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]


@pytest.mark.parametrize("compiled", [False, True])
def test_bound_optimizer_holds_x_inside_eval_weights_and_y_after(compiled, monkeypatch):
    import pgs.runtime.optim.bound as bound

    monkeypatch.setattr(bound, "_EVAL_SLICE", 5)  # several slices per tensor
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    plain = bound.bind(pf.adamw(1e-2), torch.nn.Linear(2, 2))
    with plain.eval_weights():  # a chain that evaluates where it steps: nothing moves
        pass
    assert not plain.evaluates_elsewhere
    opt = bound.bind(pf.schedule_free_adamw(1e-2, weight_decay=0.1), model, compile=compiled)
    assert opt.evaluates_elsewhere
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    y = {n: p.detach().clone() for n, p in model.named_parameters()}
    if not compiled:
        want = pf.schedule_free_eval_params(y, opt.state)
    else:  # the flat state: x from z read back per parameter
        z = opt.flat.unflatten(opt.state.z)
        want = {n: y[n] + (y[n] - z[n]) * ((1 - 0.9) / 0.9) for n in y}
    with opt.eval_weights():
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n in y:
        torch.testing.assert_close(inside[n], want[n], rtol=1e-6, atol=1e-7)
        assert not torch.equal(inside[n], y[n])
        assert torch.equal(dict(model.named_parameters())[n].detach(), y[n])  # back to y, bit for bit


def _release_model(dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=96, tie_word_embeddings=True,
                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).train()


def _release_data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (2, 12), generator=g) for _ in range(3)]


def test_gradient_release_steps_as_bind_and_holds_x_inside_eval_weights():
    from pgs.runtime.optim.bound import bind
    from pgs.runtime.optim.release import GradientRelease

    a, b = _release_model(), _release_model()
    ref = bind(pf.schedule_free_adamw(1e-2, weight_decay=0.1), a)
    rel = GradientRelease(pf.schedule_free_adamw(1e-2, weight_decay=0.1), b)
    for ids in _release_data():
        a(input_ids=ids, labels=ids).loss.backward()
        ref.step()
        ref.zero_grad()
        b(input_ids=ids, labels=ids).loss.backward()
    assert rel.evaluates_elsewhere
    y = {n: p.detach().clone() for n, p in b.named_parameters()}
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=n)  # y: the release steps as bind does
    with ref.eval_weights(), rel.eval_weights():
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)  # x: the same point
            assert not torch.equal(q, y[n])
    assert all(torch.equal(p, y[n]) for n, p in b.named_parameters())  # y again, bit for bit


def test_gradient_release_with_fp32_masters_evaluates_x_of_the_masters():
    from pgs.runtime.optim.release import GradientRelease

    b = _release_model(torch.bfloat16)
    rel = GradientRelease(pf.schedule_free_adamw(1e-2), b, master_weights="fp32")
    for ids in _release_data():
        b(input_ids=ids, labels=ids).loss.backward()
    assert rel.masters
    y = {n: p.detach().clone() for n, p in b.named_parameters()}
    want = {}
    for group, names in rel.groups.items():
        sf = rel.states[group]
        for n in names:
            m, z = rel.masters[n], sf.z[n]
            assert m.dtype == torch.float32
            want[n] = (m + (m - z.float()) * float((1 - sf.b1) / sf.b1)).to(torch.bfloat16)
    with rel.eval_weights():
        for n, p in b.named_parameters():
            torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0, msg=n)
    assert all(torch.equal(p, y[n]) for n, p in b.named_parameters())
