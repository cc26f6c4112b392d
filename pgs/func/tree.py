"""Pytree helpers with readable leaf paths.

pgs trees are any nesting of dicts, lists, tuples and NamedTuples with ``torch.Tensor``
leaves (``None`` marks an absent leaf).  Every leaf has a *path*: the keys from the root
joined by ``.`` (``"model.layers.0.weight"`` for ``dict(model.named_parameters())``).  Paths
are what masks and partition labels see, what errors name, and what state checkpoints use as
keys.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as _pt

from pgs.errors import InvalidArgument, TreeMismatch

Tree = Any


def _key_name(k) -> str:
    if isinstance(k, _pt.MappingKey):
        return str(k.key)
    if isinstance(k, _pt.SequenceKey):
        return str(k.idx)
    if isinstance(k, _pt.GetAttrKey):
        return str(k.name)
    return str(k)


def path_str(keypath) -> str:
    return ".".join(_key_name(k) for k in keypath)


def leaves_with_paths(tree: Tree) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` in flattening order."""
    flat, _ = _pt.tree_flatten_with_path(tree)
    return [(path_str(kp), leaf) for kp, leaf in flat]


def flatten(tree: Tree):
    return _pt.tree_flatten(tree)


def unflatten(leaves, spec):
    return _pt.tree_unflatten(leaves, spec)


class Structure:
    """One tree structure, its walks compiled once: ``build(leaves)`` is ``unflatten(leaves,
    spec)`` and ``read(tree)`` is ``flatten(tree)[0]`` for a tree of that structure (anything
    else: ``TreeMismatch``), several times faster than torch's generic pytree walk, which
    looks every node's type up in its registry on every call.  For code that rebuilds the same
    structure many times per step (gradient release's offloaded states: two walks per release
    group per step, inside backward).  dicts, lists, tuples, NamedTuples and None are walked
    directly; any other registered node type falls back to torch's walk for its subtree.
    """

    def __init__(self, spec):
        self.spec = spec
        self.num_leaves = spec.num_leaves
        self._build = _builder(spec)
        self._read = _reader(spec)

    def build(self, leaves: list) -> Tree:
        if len(leaves) != self.num_leaves:
            raise TreeMismatch(f"{len(leaves)} leaves for a structure of {self.num_leaves}")
        return self._build(iter(leaves))

    def read(self, tree: Tree) -> list:
        out: list = []
        self._read(tree, out)
        return out


def _children(spec) -> list:
    children = getattr(spec, "children", None)  # a method since torch 2.13, children_specs before
    return list(children()) if callable(children) else list(spec.children_specs)


def _node_kind(spec):
    """(kind, detail) of a pytree node: "leaf", "dict" (keys), "list"/"tuple", "namedtuple"
    (class), "none", or "other" (torch's walk)."""
    if spec.is_leaf():
        return "leaf", None
    t = spec.type
    if t is dict:
        return "dict", list(spec.context)
    if t is list or t is tuple:
        return t.__name__, None
    if t is type(None):
        return "none", None
    for cls in (spec.context, t):  # the class is the context (torch >= 2.5) or the node type
        if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
            return "namedtuple", cls
    return "other", None


def _builder(spec) -> Callable:
    kind, detail = _node_kind(spec)
    if kind == "leaf":
        return next
    if kind == "none":
        return lambda it: None
    if kind == "other":
        n = spec.num_leaves
        return lambda it: _pt.tree_unflatten([next(it) for _ in range(n)], spec)
    subs = [_builder(c) for c in _children(spec)]
    if kind == "dict":
        pairs = list(zip(detail, subs))
        return lambda it: {k: b(it) for k, b in pairs}
    if kind == "list":
        return lambda it: [b(it) for b in subs]
    if kind == "tuple":
        return lambda it: tuple([b(it) for b in subs])
    cls = detail
    return lambda it: cls(*[b(it) for b in subs])


def _reader(spec) -> Callable:
    kind, detail = _node_kind(spec)
    if kind == "leaf":
        return lambda x, out: out.append(x)
    if kind == "none":
        def none(x, out):
            if x is not None:
                raise TreeMismatch(f"expected None, got a {type(x).__name__}")
        return none
    if kind == "other":
        def other(x, out):
            leaves, got = _pt.tree_flatten(x)
            if got != spec:
                raise TreeMismatch(f"a {type(x).__name__} node of another structure")
            out.extend(leaves)
        return other
    subs = [_reader(c) for c in _children(spec)]
    if kind == "dict":
        keys = detail
        pairs = list(zip(keys, subs))

        def read_dict(x, out):
            if type(x) is not dict or len(x) != len(keys):
                raise TreeMismatch(f"expected a dict of keys {keys}, got {_describe(x)}")
            try:
                for k, r in pairs:
                    r(x[k], out)
            except KeyError as missing:
                raise TreeMismatch(f"dict lacks key {missing}") from None
        return read_dict
    want = {"list": list, "tuple": tuple}.get(kind, detail)
    n = len(subs)

    def read_seq(x, out):
        if type(x) is not want or len(x) != n:
            raise TreeMismatch(f"expected a {want.__name__} of {n}, got {_describe(x)}")
        for v, r in zip(x, subs):
            r(v, out)
    return read_seq


def _describe(x) -> str:
    return f"a {type(x).__name__} of {len(x)}" if hasattr(x, "__len__") else f"a {type(x).__name__}"


def leaves(tree: Tree) -> list:
    return _pt.tree_leaves(tree)


def paths(tree: Tree) -> list[str]:
    return [p for p, _ in leaves_with_paths(tree)]


def check_tensor_leaves(tree: Tree, what: str = "tree") -> None:
    """Every leaf is a tensor or None; otherwise name the first offending path."""
    for path, leaf in leaves_with_paths(tree):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise InvalidArgument(
                f"{what} leaf {path or '<root>'!r} is a {type(leaf).__name__}, expected a torch.Tensor"
            )


def check_same_structure(a: Tree, b: Tree, a_name: str, b_name: str, *, shapes: bool = True) -> None:
    """Raise one clear ``TreeMismatch`` naming the first leaf path where ``a`` and ``b`` differ."""
    la = leaves_with_paths(a)
    lb = leaves_with_paths(b)
    pa = [p for p, _ in la]
    pb = [p for p, _ in lb]
    if pa != pb:
        sa, sb = set(pa), set(pb)
        only_a = [p for p in pa if p not in sb]
        only_b = [p for p in pb if p not in sa]
        if only_a:
            raise TreeMismatch(f"{a_name} has leaf {only_a[0]!r} that {b_name} lacks")
        if only_b:
            raise TreeMismatch(f"{b_name} has leaf {only_b[0]!r} that {a_name} lacks")
        raise TreeMismatch(f"{a_name} and {b_name} list the same leaves in a different order")
    if shapes:
        for (path, x), (_, y) in zip(la, lb):
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape != y.shape:
                raise TreeMismatch(
                    f"leaf {path!r}: {a_name} has shape {tuple(x.shape)} but {b_name} has {tuple(y.shape)}"
                )
            if (x is None) != (y is None):
                raise TreeMismatch(f"leaf {path!r}: present in one of {a_name}/{b_name} only")
            if x is not None and not isinstance(x, torch.Tensor):
                raise InvalidArgument(f"{a_name} leaf {path!r} is a {type(x).__name__}, expected a torch.Tensor")
            if y is not None and not isinstance(y, torch.Tensor):
                raise InvalidArgument(f"{b_name} leaf {path!r} is a {type(y).__name__}, expected a torch.Tensor")


def check_like(tree: Tree, ref: Tree, what: str = "updates", ref_what: str = "params") -> None:
    """Cheap check that ``tree`` has ``ref``'s structure, tensor leaves and leaf shapes.

    One flatten of each tree and a shape comparison per leaf; the slow path that finds the
    offending leaf path only runs when something differs.
    """
    la, sa = _pt.tree_flatten(tree)
    lb, sb = _pt.tree_flatten(ref)
    ok = sa == sb
    if ok:
        for x, y in zip(la, lb):
            if x is None and y is None:
                continue
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape):
                ok = False
                break
    if not ok:
        check_tensor_leaves(tree, what)
        check_tensor_leaves(ref, ref_what)
        check_same_structure(tree, ref, what, ref_what)
        raise TreeMismatch(f"{what} does not have the tree structure of {ref_what}")


def _diagnose(tree: Tree, rest: tuple) -> None:
    """After a failed map: raise a clear error if the trees do not match (else return)."""
    check_tensor_leaves(tree, "pytree")
    for r in rest:
        check_tensor_leaves(r, "pytree")
        check_same_structure(tree, r, "first tree", "other tree")


def tree_map(fn: Callable, tree: Tree, *rest: Tree) -> Tree:
    """Map ``fn`` over tensor leaves; ``None`` leaves stay ``None``."""

    def f(x, *ys):
        if x is None:
            return None
        return fn(x, *ys)

    try:
        return _pt.tree_map(f, tree, *rest, is_leaf=lambda x: x is None)
    except (ValueError, TypeError, AttributeError, RuntimeError):
        _diagnose(tree, rest)  # zero cost on success; names the leaf when the trees differ
        raise


def tree_map_with_path(fn: Callable, tree: Tree, *rest: Tree) -> Tree:
    """Map ``fn(path, leaf, *other_leaves)`` over leaves; ``None`` leaves stay ``None``."""

    def f(kp, x, *ys):
        if x is None:
            return None
        return fn(path_str(kp), x, *ys)

    try:
        return _pt.tree_map_with_path(f, tree, *rest, is_leaf=lambda x: x is None)
    except (ValueError, TypeError, AttributeError, RuntimeError):
        _diagnose(tree, rest)
        raise


def zeros_like(tree: Tree, dtype: torch.dtype | None = None) -> Tree:
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype or x.dtype), tree)


def tree_sum(values) -> torch.Tensor:
    vals = [v for v in values if v is not None]
    if not vals:
        return torch.zeros(())
    out = vals[0]
    for v in vals[1:]:
        out = out + v
    return out


def tree_map_n(fn: Callable, n: int, tree: Tree, *rest: Tree) -> tuple:
    """Map ``fn`` returning an ``n``-tuple per leaf; returns ``n`` trees shaped like ``tree``.

    ``None`` leaves of ``tree`` stay ``None`` in every output.
    """
    leaves, spec = _pt.tree_flatten(tree)
    others = []
    for r in rest:
        o, r_spec = _pt.tree_flatten(r)
        if r_spec != spec:
            check_same_structure(tree, r, "updates", "state")
            raise TreeMismatch("updates do not have the tree structure of the optimizer state")
        others.append(o)
    outs: list[list] = [[] for _ in range(n)]
    for i, x in enumerate(leaves):
        if x is None:
            for o in outs:
                o.append(None)
            continue
        if not isinstance(x, torch.Tensor) or any(o[i] is not None and o[i].shape != x.shape for o in others):
            for r in rest:  # slow path, only on a mismatch: name the leaf
                check_same_structure(tree, r, "updates", "state")
            check_tensor_leaves(tree, "updates")
        res = fn(x, *(o[i] for o in others))
        for o, r in zip(outs, res):
            o.append(r)
    return tuple(_pt.tree_unflatten(o, spec) for o in outs)


def donate(old_state: Tree, new_state: Tree) -> Tree:
    """Write ``new_state`` into ``old_state``'s buffers (same shapes) and return the old ones.

    Only buffers (numel > 1) are donated: scalars (counters, the current lr) are returned as
    new tensors — donating 0-d inputs gains nothing and inductor mis-handles some of them.
    """
    olds, spec = flatten(old_state)
    news = leaves(new_state)
    out = []
    for o, n in zip(olds, news):
        if (isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o.numel() > 1
                and o.shape == n.shape and o.dtype == n.dtype and o is not n):
            o.copy_(n)
            out.append(o)
        else:
            out.append(n)
    return unflatten(out, spec)
