"""Merge-back toward a base model: SFA (linear) and a per-tensor SLERP (docs/techniques/merge.md).

Kleiman, Dziugaite, Frankle, Kakade, Paul, "Soup to go: mitigating forgetting during
continual learning with model averaging", arXiv 2501.05559.
"""

from __future__ import annotations

import torch

from pgs.errors import InvalidArgument
from pgs.func import tree as T
from pgs.func.base import check_range

METHODS = ("linear", "slerp")
#: |cos Ω| above which SLERP falls back to a lerp (mergekit's DOT_THRESHOLD)
DOT_THRESHOLD = 0.9995
#: norms at or below this are not normalized when computing cos Ω (mergekit's eps)
NORM_EPS = 1e-8


def lerp(t, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1 − t) a + t b, in fp32 (fp64 for fp64 inputs), cast back to ``a``'s dtype."""
    cd = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return ((1.0 - t) * a.to(cd) + t * b.to(cd)).to(a.dtype)


def slerp(t, a: torch.Tensor, b: torch.Tensor, dot_threshold: float = DOT_THRESHOLD) -> torch.Tensor:
    """Spherical interpolation of two tensors (flattened), mergekit semantics.

    â = a/‖a‖, b̂ = b/‖b‖ (only where the norm > 1e-8) ; d = Σ â⊙b̂ ; Ω = arccos d
    result = sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b    (coefficients applied to the RAW a, b)
    result = (1−t) a + t b                                 when |d| > 0.9995 (near colinear)

    Computed in fp32 (fp64 for fp64 inputs) and cast back to ``a``'s dtype.  No host sync:
    both branches are computed and one is selected with ``torch.where``.
    """
    cd = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    x, y = a.to(cd).reshape(-1), b.to(cd).reshape(-1)
    nx, ny = torch.linalg.vector_norm(x), torch.linalg.vector_norm(y)
    xh = torch.where(nx > NORM_EPS, x / torch.where(nx > NORM_EPS, nx, 1.0), x)
    yh = torch.where(ny > NORM_EPS, y / torch.where(ny > NORM_EPS, ny, 1.0), y)
    d = (xh * yh).sum()
    colinear = d.abs() > dot_threshold
    omega = torch.arccos(torch.where(colinear, torch.zeros_like(d), d.clamp(-1.0, 1.0)))
    sin_o = torch.where(colinear, torch.ones_like(omega), torch.sin(omega))
    t_ = torch.as_tensor(t, dtype=cd, device=x.device)
    s0 = torch.sin((1.0 - t_) * omega) / sin_o
    s1 = torch.sin(t_ * omega) / sin_o
    spherical = s0 * x + s1 * y
    linear = (1.0 - t_) * x + t_ * y
    return torch.where(colinear, linear, spherical).reshape(a.shape).to(a.dtype)


def merge_back(params, base, weight, method: str = "linear"):
    """Pull ``params`` toward ``base`` with weight β: a pure function returning new params.

    linear (SFA, the paper):   θ ← (1 − β) θ + β θ_o
    slerp (a pgs extension):    θ ← slerp(1 − β, θ_o, θ) per tensor (mergekit semantics)

    β = 0 is the identity, β = 1 resets to the base.  Computed per tensor in fp32 and cast
    back to each parameter's dtype; ``params`` and ``base`` are untouched.  SFA applies it
    every p·T steps (T = the task's steps, p ∈ (0, 1]) and at the end of the task; scheduling
    that is the runtime's job.  SLERP preserves the norm when ‖θ‖ = ‖θ_o‖; the paper itself
    is linear.

    Args:
        params: the current parameters θ (a tree of tensors).
        base: the base (earlier) parameters θ_o, same tree.
        weight: β in [0, 1] (a number or a 0-d tensor).
        method: "linear" | "slerp".

    Example::

        params = pf.merge_back(params, base_params, 0.25, method="slerp")

    Paper: arXiv 2501.05559 (SFA, linear); SLERP per mergekit ``merge_methods/slerp.py``.
    """
    who = "merge_back"
    check_range("weight", weight, 0.0, 1.0, who=who)
    if method not in METHODS:
        raise InvalidArgument(f"{who}: method={method!r}, expected one of {METHODS}")
    T.check_same_structure(params, base, "params", "base")
    if method == "linear":
        return T.tree_map(lambda p, o: lerp(1.0 - weight, o, p).to(p.dtype), params, base)
    return T.tree_map(lambda p, o: slerp(1.0 - weight, o, p).to(p.dtype), params, base)
