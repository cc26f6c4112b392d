"""Schedule-free optimization: interpolation and averaging in place of a decaying schedule.

Defazio, Yang, Mehta, Mishchenko, Khaled, Cutkosky, "The Road Less Scheduled", arXiv 2405.15682.

Three sequences replace momentum and the schedule's decay.  With a base step
``u_t = −γ_t d_t`` (``d_t`` the base direction at ``y_t``: SGD's gradient, Adam's
normalised gradient, plus weight decay at ``y_t``):

    y_t     = (1 − β) z_t + β x_t                     the point the gradient is taken at
    z_{t+1} = z_t + u_t                               the base optimizer's own iterate
    x_{t+1} = (1 − c_{t+1}) x_t + c_{t+1} z_{t+1}      a weighted average of the z's
    c_{t+1} = w_t / Σ_{i≤t} w_i,  w_t = (max_{i≤t} γ_i)^p

``x`` is where the model is evaluated and what is exported; ``p`` (``weight_lr_power``) = 2 is
the paper's warm-up-aware weighting: steps taken at a small learning rate during warm-up
count little in the average.  ``c`` is 0 while every learning rate so far is 0.

How it fits pgs's chain model (updates are *added* to the parameters the runtime holds): the
parameters hold ``y`` (the gradient is computed there, as for any optimizer), the state holds
``z``, and ``x`` is recovered from both, ``x_t = (y_t − (1 − β) z_t) / β``
(:func:`schedule_free_eval_params`).  The update that moves ``y_t`` to ``y_{t+1}`` is, by
substituting the three lines above,

    y_{t+1} − y_t = c_{t+1} (z_t − y_t) + (1 − β (1 − c_{t+1})) u_t

computed from ``y_t``, ``z_t`` and ``u_t`` only (no division by β on the training path).  The
memory is the base optimizer's plus one buffer (``z``); ``schedule_free_adamw``'s base keeps
no first moment, so it holds as many buffers as AdamW.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, realize_scalar, zero_count, zeros_state
from pgs.func.base import DIRECTION, ELEMENTWISE, Transform, chain, check_range, hp_cache, identity
from pgs.func.layout import call_init, call_update
from pgs.func.learning_rate import lr_value, scale_by_learning_rate, takes_learning_rate
from pgs.func.weight_decay import add_decayed_weights


class ScheduleFreeState(NamedTuple):
    count: torch.Tensor  # int32: updates taken so far (the schedule's step)
    b1: torch.Tensor  # float64 0-d: the β of the last update (y = (1−β) z + β x)
    lr_max: torch.Tensor  # float64 0-d: max_{i≤t} γ_i
    weight_sum: torch.Tensor  # float64 0-d: Σ_{i≤t} w_i
    c: torch.Tensor  # float64 0-d: the averaging weight c of the last update
    z: Any  # the base optimizer's iterate, z_dtype
    inner: Any  # the base optimizer's state

    reports = (("schedule_free_c", "c"),)  # pgs.func.reported


@takes_learning_rate
def schedule_free(opt: Transform, learning_rate, b1: float = 0.9, weight_lr_power: float = 2.0,
                  z_dtype: torch.dtype | None = None) -> Transform:
    """Make ``opt`` schedule-free (arXiv 2405.15682; equations in the module docstring).

    y_t = (1−β) z_t + β x_t ;  z_{t+1} = z_t + u_t ;  x_{t+1} = (1−c_{t+1}) x_t + c_{t+1} z_{t+1}
    c_{t+1} = w_t / Σ_{i≤t} w_i ,  w_t = (max_{i≤t} γ_i)^p

    ``opt`` produces the base step ``u_t`` (it must contain its learning-rate stage, e.g.
    ``chain(scale_by_adam(b1=0), scale_by_learning_rate(lr))``: momentum belongs to the
    interpolation, so the base should have none).  The parameters the chain is applied to
    are ``y``; read the evaluation and export point ``x`` with
    ``schedule_free_eval_params(params, state)``.

    Args:
        opt: the base optimizer (its updates are the step u_t = −γ_t d_t).
        learning_rate: γ_t as ``opt`` uses it (a number, a 0-d tensor or a schedule evaluated
            at this transform's own count), for the averaging weights only.  Warm up, do not
            decay: the averaging does what a decay would.
        b1: β in (0, 1]: how close to x the gradient is taken (1: at x, primal averaging).
        weight_lr_power: p ≥ 0 of w_t = (max γ)^p (0: the uniform average c = 1/(t+1)).
        z_dtype: storage dtype of z (default: the parameter's); fp32 for bf16 parameters keeps
            small steps that bf16 would round away.

    Example::

        opt = pf.schedule_free(pf.chain(pf.scale_by_adam(b1=0.0), pf.scale_by_learning_rate(lr)), lr)
        state = opt.init(params)
        updates, state = opt.update(grads, state, params)   # grads taken at params (= y)
        params = pf.apply_updates(params, updates)
        eval_params = pf.schedule_free_eval_params(params, state)   # x
    """
    who = "schedule_free"
    if not isinstance(opt, Transform):
        raise InvalidArgument(f"{who}: opt must be a pgs.func.Transform, got {type(opt).__name__}")
    if opt.skip_of is not None:
        raise InvalidArgument(f"{who}: the wrapped chain can veto a step (zclip(mode=\"skip\")); put the vetoing "
                              "stage before the wrapper: chain(zclip(mode=\"skip\"), schedule_free(...))")
    check_range("learning_rate", learning_rate, 0.0, None, who=who)
    check_range("b1", b1, 0.0, 1.0, lo_open=True, who=who)
    check_range("weight_lr_power", weight_lr_power, 0.0, None, who=who)

    def init(params, **extra):
        count = zero_count(params)
        zero = torch.zeros((), dtype=torch.float64, device=count.device)
        beta = torch.as_tensor(b1, dtype=torch.float64).to(count.device).reshape(())
        z = T.tree_map(lambda p: p.detach().to(dtype=z_dtype or p.dtype, copy=True), params)
        return ScheduleFreeState(count, beta, zero, zero.clone(), zero.clone(), z, call_init(opt, params, extra))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise InvalidArgument(f"{who}: update needs params (the point y the gradients were taken at)")
        lr = lr_value(learning_rate, state.count)
        lr_max = torch.maximum(state.lr_max, lr)
        w = lr_max ** (weight_lr_power.to(lr_max) if isinstance(weight_lr_power, torch.Tensor) else weight_lr_power)
        weight_sum = state.weight_sum + w
        c = realize_scalar(torch.where(weight_sum > 0, w / torch.where(weight_sum > 0, weight_sum, 1.0), 0.0))
        beta = torch.as_tensor(b1, dtype=torch.float64).to(c.device).reshape(())
        keep = realize_scalar(1.0 - beta * (1.0 - c))  # the base step's share of the move of y
        steps, inner = call_update(opt, updates, state.inner, params, extra)

        def one(u, y, z):
            cd = compute_dtype(y)
            u32, z32 = u.to(cd), z.to(cd)
            move = (z32 - y.to(cd)) * c.to(device=u.device, dtype=cd) + u32 * keep.to(device=u.device, dtype=cd)
            return move.to(u.dtype), (z32 + u32).to(z.dtype)

        moves, z = T.tree_map_n(one, 2, steps, params, state.z)
        return moves, ScheduleFreeState(increment(state.count), beta, lr_max, weight_sum, c, z, inner)

    return Transform(init, update, name="schedule_free", locality=opt.locality, group_by=opt.all_group_by(),
                     align=opt.max_align(), children=(opt,), shard_aware=opt.shard_aware)


def _scale_by_rms(b2: float, eps: float, nu_dtype: torch.dtype | None) -> Transform:
    """Adam's direction with β1 = 0 and no first-moment buffer: u = g / (sqrt(v_t/(1−β2^t)) + ε)."""

    def init(params, **extra):
        return (zero_count(params), zeros_state(params, nu_dtype))

    def update(updates, state, params=None, **extra):
        count, nu = state
        count = increment(count)
        bc2 = realize_scalar(1.0 - b2 ** count.to(torch.float64))
        hps = hp_cache(1.0 - b2, b2, eps)

        def one(g, v):
            cd = compute_dtype(g)
            w2, d2, ep = hps(cd, g.device)
            g32 = g.to(cd)
            v_new = v.to(cd).mul(d2)
            v_new = v_new.addcmul(g32 * w2, g32) if isinstance(w2, torch.Tensor) else v_new.addcmul(g32, g32, value=w2)
            return (g32 / ((v_new / bc2.to(cd)).sqrt() + ep)).to(g.dtype), v_new.to(v.dtype)

        u, nu = T.tree_map_n(one, 2, updates, nu)
        return u, (count, nu)

    return Transform(init, update, name="scale_by_rms", locality=ELEMENTWISE, stage=DIRECTION)


@takes_learning_rate
def schedule_free_adamw(
    learning_rate=2.5e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask=None,
    weight_lr_power: float = 2.0,
    z_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> Transform:
    """Schedule-free AdamW (arXiv 2405.15682, its Algorithm 1): ``schedule_free`` over
    ``chain(Adam's direction with β1 = 0, add_decayed_weights, scale_by_learning_rate)``.

    d_t = g_t / (sqrt(v_t / (1−β2^t)) + ε) + λ y_t ;  u_t = −γ_t d_t ;  then the y/z/x
    sequences of ``schedule_free`` (β = ``b1``; the gradient and the decay at y).

    ``learning_rate`` is γ_t: a number or a schedule that warms up and stays (a spec's
    ``[schedule] name = "linear_warmup"``), never decays.  Evaluate and export
    ``schedule_free_eval_params(params, state)``.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="schedule_free_adamw")
    check_range("b2", b2, 0.0, 1.0, hi_open=True, who="schedule_free_adamw")
    check_range("eps", eps, 0.0, None, who="schedule_free_adamw")
    base = chain(
        _scale_by_rms(b2, eps, nu_dtype),
        add_decayed_weights(weight_decay, mask) if _nonzero(weight_decay) else identity(),
        scale_by_learning_rate(learning_rate),
    )
    return schedule_free(base, learning_rate, b1=b1, weight_lr_power=weight_lr_power, z_dtype=z_dtype)


def _nonzero(x) -> bool:
    return isinstance(x, torch.Tensor) or x != 0


def _find(state, found: list) -> None:
    if isinstance(state, ScheduleFreeState):
        found.append(state)
        return
    if isinstance(state, dict):
        for v in state.values():
            _find(v, found)
    elif isinstance(state, (tuple, list)):
        for v in state:
            _find(v, found)


def wraps_schedule_free(t: Transform) -> bool:
    """Whether ``t`` is, or contains, a ``schedule_free`` wrapper."""
    return t.name == "schedule_free" or any(wraps_schedule_free(c) for c in t.children)


def has_schedule_free(state) -> bool:
    """Whether a chain's state (any nesting) holds a schedule-free wrapper's state."""
    found: list = []
    _find(state, found)
    return bool(found)


def schedule_free_state(state) -> ScheduleFreeState:
    """The one schedule-free state inside a chain's state (any nesting); refused otherwise."""
    found: list = []
    _find(state, found)
    if len(found) != 1:
        raise InvalidArgument(f"schedule_free_eval_params: the state holds {len(found)} schedule-free states; "
                              "expected exactly one (a schedule_free wrapper over every parameter)")
    return found[0]


def eval_point(y: torch.Tensor, z: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    """x = y + ((1−β)/β)(y − z) for one tensor (or a slice of one), in y's dtype: the small
    difference y − z first, so that x = y exactly where y = z.  Computed in fp32 (fp64 for fp64)."""
    cd = compute_dtype(y)
    y32 = y.to(cd)
    ratio = ((1.0 - b1) / b1).to(device=y.device, dtype=cd)
    return (y32 + (y32 - z.to(cd)) * ratio).to(y.dtype)


def schedule_free_eval_params(params, state):
    """The evaluation and export point x_t = (y_t − (1−β) z_t) / β, in the parameters' dtypes.

    ``params`` are the parameters the chain updates (y_t), ``state`` the chain's state (a
    schedule-free wrapper anywhere in it, wrapping every parameter).  Before the first update
    x = y.  Computed in fp32 (fp64 for fp64 parameters); ``params`` and ``state`` are untouched.
    """
    sf = schedule_free_state(state)
    T.check_same_structure(params, sf.z, "params", "schedule-free z")
    return T.tree_map(lambda y, z: eval_point(y, z, sf.b1), params, sf.z)
