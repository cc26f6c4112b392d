"""Routing parts of a tree to different transforms: ``partition`` and ``masked``."""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func.base import BRANCHES, SOME_PARAMS, Transform, identity, widest_locality
from pgs.func.layout import call_init, call_update, group_label
from pgs.func.step import NO_CONTEXT, StepContext


def labels_fn(labels, who: str) -> Callable[[str, torch.Tensor], Hashable]:
    """Labels given as ``(path, param) -> label`` or as a pytree of labels, as a function."""
    if callable(labels):
        return labels
    table = {p: v for p, v in T.leaves_with_paths(labels)}

    def fn(path, p):
        if path not in table:
            raise InvalidArgument(f"{who}: the labels have no entry for parameter {path!r}")
        return table[path]

    return fn


def _select(tree, labels: dict, want, layout):
    """The subtree whose leaves carry label ``want``; other leaves become None (or are dropped)."""
    if layout is not None:
        return {k: v for k, v in tree.items() if k in labels and labels[k] == want}
    return T.tree_map_with_path(lambda p, x: x if labels[p] == want else None, tree)


def _merge(tree, parts: dict, labels: dict, layout):
    if layout is not None:
        out = {}
        for part in parts.values():
            out.update(part)
        return {k: out.get(k) for k in tree}
    flat = {lab: dict(T.leaves_with_paths(part)) for lab, part in parts.items()}
    return T.tree_map_with_path(lambda p, x: flat[labels[p]][p], tree)


def partition(transforms: dict, labels) -> Transform:
    """Route each parameter to ``transforms[label]``; ``label = labels(path, param)``.

    Each transform sees only its own parameters and keeps its own state under its label
    (``state[label]``).  Global reductions (a global-norm clip) inside one branch are over that
    branch's parameters.

    Example::

        opt = pf.partition(
            {"decay": pf.adamw(1e-3, weight_decay=0.1), "no_decay": pf.adamw(1e-3, weight_decay=0.0)},
            lambda path, p: "decay" if p.ndim >= 2 else "no_decay",
        )
    """
    who = "partition"
    if not isinstance(transforms, dict) or not transforms:
        raise InvalidArgument(f"{who}: transforms must be a non-empty dict label -> Transform")
    for k, t in transforms.items():
        if not isinstance(t, Transform):
            raise InvalidArgument(f"{who}: transforms[{k!r}] is a {type(t).__name__}, expected a Transform")
    fn = labels_fn(labels, who)

    def checked_labels(tree, layout):
        labs = group_label(layout, tree, fn)
        for p, lab in labs.items():
            if lab not in transforms:
                raise InvalidArgument(
                    f"{who}: parameter {p!r} got label {lab!r}, which is not one of {sorted(map(str, transforms))}"
                )
        return labs

    def init(params, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        labs = checked_labels(params, layout)
        extra = {**extra, "ctx": ctx}
        return {str(k): call_init(t, _select(params, labs, k, layout), extra) for k, t in transforms.items()}

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
        layout = ctx.layout
        extra = {**extra, "ctx": ctx}
        if params is not None and layout is None:
            T.check_like(updates, params, "updates", "params")  # name a mismatched leaf up front
        labs = checked_labels(updates, layout)
        parts, new_state = {}, {}
        for k, t in transforms.items():
            sub_u = _select(updates, labs, k, layout)
            if sub_u is None:
                # a bare-tensor tree labelled for another branch: this one owns nothing (and
                # its params would be None, which a transform needing params would reject)
                parts[k], new_state[str(k)] = None, state[str(k)]
                continue
            sub_p = None if params is None else _select(params, labs, k, layout)
            parts[k], new_state[str(k)] = call_update(t, sub_u, state[str(k)], sub_p, extra)
        return _merge(updates, parts, labs, layout), new_state

    return Transform(
        init,
        update,
        name="partition",
        stage=BRANCHES,
        locality=widest_locality(*(t.locality for t in transforms.values())),
        group_by=(fn,),
        children=tuple(transforms.values()),
    )


class MaskedState(NamedTuple):
    inner: Any


def masked(inner: Transform, mask) -> Transform:
    """Apply ``inner`` where ``mask(path, param)`` is true; pass other updates through unchanged."""

    p = partition({True: inner, False: identity()}, mask)

    def init(params, **extra):
        return MaskedState(p.init(params, **extra)["True"])

    def update(updates, state, params=None, **extra):
        u, s = p.update(updates, {"True": state.inner, "False": ()}, params, **extra)
        return u, MaskedState(s["True"])

    return Transform(init, update, name="masked", locality=inner.locality, group_by=p.group_by, children=(inner,),
                     stage=SOME_PARAMS)
