"""The transform: a pair of pure functions, and the ways to compose them.

A ``Transform`` is ``init(params, **extra) -> state`` and
``update(updates, state, params=None, **extra) -> (updates, state)``.  Neither mutates its
inputs.  ``extra`` carries the caller's keyword arguments (the loss, ``loss=...``, for
transforms that want it) and the runtime context ``ctx=`` (``pgs.func.step.StepContext``:
the flat layout, the sharding hooks, the stochastic-rounding offset).  A transform that
needs the context declares it, ``update(updates, state, params=None, *, ctx=NO_CONTEXT,
**extra)``; combinators forward ``extra`` whole.

What a transform needs from the tree is declared by its ``locality`` (elementwise,
per-tensor, matrix, global) and ``shard_aware``; what it does to the update by its ``stage``
(it shapes a direction, or it turns a direction into a step); how a chain may run fused is
decided by the plan registry (``pgs.func.plan``), never by the executors themselves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func.layout import call_init, call_update
from pgs.func.step import context_of

#: How far a transform looks across the tree; the runtime uses it to decide what may run
#: inside backward (gradient release) and what must be all-reduced under FSDP2.
ELEMENTWISE = "elementwise"  # each element depends only on itself
PER_TENSOR = "per_tensor"  # needs reductions over whole tensors (norms)
MATRIX = "matrix"  # needs whole matrices in their shape (Newton-Schulz, SAGE columns)
GLOBAL = "global"  # needs a reduction over the whole tree (global-norm clip)
_LOCALITY_ORDER = {ELEMENTWISE: 0, PER_TENSOR: 1, MATRIX: 2, GLOBAL: 3}


#: What a stage does to the update (``Transform.stage``).  The runtime *adds* a chain's updates
#: to the parameters, so a chain must contain a step stage; ``no_step_stage`` reads these.
DIRECTION = "direction"  # shapes a direction: the update keeps the gradient's sign (Adam, clipping, decay)
STEP = "step"  # turns a direction into a step: −η_t·u, or a step on a sphere
BRANCHES = "branches"  # a combinator sending each parameter through one child: every child must step
SOME_PARAMS = "some_params"  # a combinator whose children see some parameters; the others pass unchanged
STAGES = (DIRECTION, STEP, BRANCHES, SOME_PARAMS)


def widest_locality(*localities: str) -> str:
    if not localities:
        return ELEMENTWISE
    return max(localities, key=lambda s: _LOCALITY_ORDER[s])


# A frozen dataclass, not attrs: inject_hyperparams builds transforms inside the update that
# pf.compile traces, and dynamo cannot trace the cached ``object.__setattr__`` that attrs'
# frozen __init__ uses (a graph break, then a crash on resume).
@dataclasses.dataclass(frozen=True)
class Transform:
    """A pure gradient transformation.

    Attributes:
        init: ``init(params, **extra) -> state``.
        update: ``update(updates, state, params=None, **extra) -> (updates, state)``.
        name: a short name used as the key of its state inside a chain.
        locality: one of ``elementwise``, ``per_tensor``, ``matrix``, ``global``.
        flat_ok: True when ``update`` works on the flat layout (one buffer per group, with
            ``layout`` in ``extra``); False makes the flat executor hand it per-parameter
            views instead (zero-copy).
        group_by: functions ``(path, param) -> hashable`` whose values must be equal inside
            one flat group (masks, partition labels, 8-bit eligibility).
        align: element alignment this transform needs for each tensor's start in a flat
            buffer (block-wise quantization needs its block size).
        children: the transforms this one wraps (for introspection).
        fused: ``(kind, hyperparameters)`` for building blocks that a registered fused plan
            can recognise inside a chain (``pgs.func.plan``); None for the rest.
        shard_aware: True when a non-elementwise transform is correct on FSDP2 shards: it
            forwards ``ctx.reduce_sum`` to its reductions (or runs whole matrices through
            ``ctx.whole_tensors``).  The sharded binders refuse non-elementwise transforms
            without it.
        skip_of: ``skip_of(state) -> 0-d bool tensor`` for a transform that can veto a whole
            step (ZClip in mode "skip"): True in the state its last update returned means
            that step must not happen.  The chain holding it honours the veto
            (:func:`named_chain`); None for the rest.
        stage: what it does to the update: ``"direction"`` (shapes a direction, the update
            keeps the gradient's sign), ``"step"`` (turns a direction into a step, −η_t·u);
            for combinators, how their children decide: ``"branches"`` (each parameter goes
            through one child, so every child must step), ``"some_params"`` (parameters the
            children do not see pass through unchanged).  None: a wrapper whose children
            decide (any child that steps makes it step), or a transform that does not say
            (a user's own: trusted).  Read by :func:`no_step_stage`.
    """

    init: Callable[..., Any]
    update: Callable[..., tuple[Any, Any]]
    name: str = "transform"
    locality: str = ELEMENTWISE
    flat_ok: bool = True
    group_by: tuple = ()
    align: int = 1
    children: tuple = ()
    fused: Any = None
    shard_aware: bool = False
    skip_of: Callable[[Any], torch.Tensor] | None = None
    stage: str | None = None

    def __post_init__(self):
        if self.stage is not None and self.stage not in STAGES:
            raise InvalidArgument(f"Transform {self.name!r}: stage={self.stage!r} is not one of {', '.join(STAGES)}")

    def all_group_by(self) -> tuple:
        out = list(self.group_by)
        for c in self.children:
            out.extend(c.all_group_by())
        return tuple(out)

    def max_align(self) -> int:
        a = self.align
        for c in self.children:
            a = math.lcm(a, c.max_align())
        return a

    def all_flat_ok(self) -> bool:
        return self.flat_ok and all(c.all_flat_ok() for c in self.children)


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def identity() -> Transform:
    """The identity transform: ``u ← u``."""

    def init(params, **extra):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return updates, state

    return Transform(init, update, name="identity", fused=("identity", {}), stage=DIRECTION)


def _check_transforms(transforms, who: str):
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise InvalidArgument(f"{who}: argument {i} is a {type(t).__name__}, expected a pgs.func.Transform")


def skip_signal(t: Transform, state) -> torch.Tensor | None:
    """Whether ``t``'s last update (which returned ``state``) vetoed its step: a 0-d bool
    tensor on the state's device (no host read), or None when ``t`` can never veto."""
    return None if t.skip_of is None else t.skip_of(state)


def _vetoed(skip: torch.Tensor, old, new):
    """``old`` where ``skip`` else ``new``, leaf by leaf (state carried over unchanged)."""
    return T.tree_map(lambda o, n: torch.where(skip.to(n.device), o, n), old, new)


def _no_update(skip: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """−0.0 where ``skip`` (θ + (−0.0) = θ bit for bit, +0.0 would turn a −0.0 weight into
    +0.0), else ``u``."""
    return torch.where(skip.to(u.device), torch.full((), -0.0, dtype=u.dtype, device=u.device), u)


def named_chain(*named: tuple[str, Transform]) -> Transform:
    """Compose transforms in order; the state is a dict keyed by the given names.

    ``u ← t_k(…t_2(t_1(u)))``; each ``t_i`` keeps its own state under ``names[i]``.

    A step vetoed by a stage (``Transform.skip_of``, e.g. ``zclip(mode="skip")`` on a spike)
    is skipped by the whole chain: every other stage's state is carried over unchanged
    (``s_i ← s_i`` for each non-vetoing stage, so Adam's moments and count, a schedule's count
    stay as they were), the vetoing stage keeps the state it returned (its own record of the
    spike), and the chain emits −0.0 updates, so that applying them leaves every weight bit for
    bit as it was.  Selected on the device (``torch.where``), no host read; a chain with no
    vetoing stage pays nothing.  The chain itself then vetoes (``skip_of``), so that a chain
    nested in another skips the outer one's stages too.
    """
    names = [n for n, _ in named]
    transforms = [t for _, t in named]
    _check_transforms(transforms, "named_chain")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"named_chain: names must be unique, got {names}")

    def init(params, **extra):
        return {n: call_init(t, params, extra) for n, t in named}

    def update(updates, state, params=None, **extra):
        if not isinstance(state, dict) or list(state) != names:
            keys = list(state) if isinstance(state, dict) else type(state).__name__
            raise InvalidArgument(f"chain state keys {keys} "
                                  f"do not match the chain's transforms {names}")
        if params is not None and context_of(extra).layout is None:
            # once per call, so that a mismatch names its leaf instead of failing inside a
            # kernel (the flat path has checked against its layout already)
            T.check_like(updates, params, "updates", "params")
        new_state = {}
        for n, t in named:
            updates, new_state[n] = call_update(t, updates, state[n], params, extra)
        if vetoing:
            skip = skip_of(new_state)
            for n, t in named:
                if t.skip_of is None:
                    new_state[n] = _vetoed(skip, state[n], new_state[n])
            updates = T.tree_map(lambda u: _no_update(skip, u), updates)
        return updates, new_state

    vetoing = [(n, t) for n, t in named if t.skip_of is not None]

    def skip_of(state):
        flags = [t.skip_of(state[n]) for n, t in vetoing]
        out = flags[0]
        for f in flags[1:]:
            out = out | f.to(out.device)
        return out

    return Transform(
        init,
        update,
        name="chain",
        locality=widest_locality(*(t.locality for t in transforms)),
        children=tuple(transforms),
        skip_of=skip_of if vetoing else None,
    )


def chain(*transforms: Transform) -> Transform:
    """Compose transforms in order (optax's ``chain``); state keys are ``"{i}_{name}"``.

    Example::

        opt = pf.chain(pf.clip_by_global_norm(1.0), pf.scale_by_adam(), pf.scale_by_learning_rate(1e-3))
    """
    _check_transforms(transforms, "chain")
    return named_chain(*((f"{i}_{t.name}", t) for i, t in enumerate(transforms)))


# ----------------------------------------------------------------------------------------
# hyperparameter handling shared by the building blocks


def hp_value(x) -> float | None:
    """The Python value of a number hyperparameter; None for tensors and schedules.

    Tensor hyperparameters come from ``inject_hyperparams``, which validated the Python value
    they were made from; reading them back would synchronise the device every step.
    """
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    return None


def check_range(name: str, value, lo=None, hi=None, *, lo_open=False, hi_open=False, who: str = "") -> None:
    """Validate a numeric hyperparameter (floats or 0-d tensors); schedules are not checked here."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidArgument(f"{who}: {name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return
    v = hp_value(value)
    if v is None:
        if isinstance(value, str):
            raise InvalidArgument(f"{who}: {name} must be a number, got the string {value!r} "
                                  "(write the number without quotes)")
        raise InvalidArgument(f"{who}: {name} must be a number, got {type(value).__name__}")
    if math.isnan(v):
        raise InvalidArgument(f"{who}: {name} is NaN")
    bad = False
    if lo is not None and (v < lo or (lo_open and v == lo)):
        bad = True
    if hi is not None and (v > hi or (hi_open and v == hi)):
        bad = True
    if bad:
        lo_s = "-inf" if lo is None else repr(lo)
        hi_s = "inf" if hi is None else repr(hi)
        rng = ("(" if lo_open else "[") + f"{lo_s}, {hi_s}" + (")" if hi_open else "]")
        raise InvalidArgument(f"{who}: {name}={v!r} is outside {rng}")


def hp_in(x, dtype: torch.dtype, device: torch.device) -> Any:
    """A hyperparameter ready for arithmetic in ``dtype``: numbers pass through, tensors are cast.

    Injected hyperparameters are fp64 0-d tensors.  Used as they are, they would promote a
    0-d leaf's arithmetic to fp64 (0-d with 0-d follows the wider dtype) and, as the
    ``value=`` of ``addcmul``, force a host sync.  Cast derived quantities (``1 - b1``) in
    fp64 first and then cast, so that the injected path rounds exactly like a Python float.
    """
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    return x


def hp_cache(*hps) -> Callable[[torch.dtype, torch.device], tuple]:
    """``get(dtype, device)``: ``hp_in`` of every hyperparameter, cast once per dtype and device
    (call it inside one update, so that a tree of many leaves does not cast per leaf)."""
    cache: dict = {}

    def get(dtype, device):
        key = (dtype, device)
        if key not in cache:
            cache[key] = tuple(hp_in(h, dtype, device) for h in hps)
        return cache[key]

    return get


def as_tensor_like(x, ref: torch.Tensor) -> Any:
    """A hyperparameter ready to combine with ``ref``: tensors move to ref's device, floats stay."""
    if isinstance(x, torch.Tensor):
        return x.to(device=ref.device)
    return x


# ----------------------------------------------------------------------------------------
# a chain must end in a step: its updates are *added* to the parameters

def _has_step(t: Transform) -> bool | None:
    """True: every parameter's update goes through a step stage; False: some parameter's
    does not (the update is a raw direction); None: a transform that declares no stage decides.
    Each transform declares its own ``stage``; nothing here knows names."""
    if t.stage == STEP:
        return True
    if t.stage == BRANCHES:  # every branch must step
        found = [_has_step(c) for c in t.children]
        return False if False in found else (None if None in found else True)
    if t.stage == SOME_PARAMS:  # the parameters outside the children pass through unchanged
        return None if _has_step(t.children[0]) is None else False
    if t.children:  # chain, accumulate, inject_hyperparams, fused wrappers: any stage steps
        found = [_has_step(c) for c in t.children]
        return True if True in found else (None if None in found else False)
    return False if t.stage == DIRECTION else None


def _describe(t: Transform) -> str:
    if t.name == "chain" and t.children:
        return ", ".join(_describe(c) for c in t.children)
    return t.name


def no_step_stage(chain: Transform) -> str | None:
    """Why ``chain`` would climb the loss (a sentence), or None.

    The runtime adds a chain's updates to the parameters, so a chain of directions alone
    (``scale_by_adam()`` with no ``scale_by_learning_rate``) moves *up* the gradient with a
    step of 1.  Said only when every stage declares its ``stage``; a transform of the user's
    own that declares none is trusted.  ``scale_by_learning_rate(lr, flip_sign=False)`` ascends on purpose and passes.
    """
    if _has_step(chain) is not False:
        return None
    where = f"the chain ({_describe(chain)})"
    if chain.name == "partition":
        for c in chain.children:
            if _has_step(c) is False:
                where = f"a partition branch ({_describe(c)})"
                break
    return (f"{where} has no learning-rate stage: its updates would be added to the parameters as "
            "they are, climbing the loss; end it with scale_by_learning_rate(lr) (or hyperball(lr))")
