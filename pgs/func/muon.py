"""Muon: momentum orthogonalized by Newton–Schulz (EQUATIONS.md A3).

Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024);
Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982 (RMS matching);
semantics of ``torch.optim.Muon``.

Matrices of one shape are orthogonalized together: one batched Newton–Schulz per shape
(``bmm`` over a ``[B, m, n]`` stack) instead of one small launch per matrix.  A matrix with
more rows than columns is transposed first (as every reference does), so ``6144×2048`` and
``2048×6144`` land in the same batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pgs.errors import InvalidArgument, TreeMismatch
from pgs.func import tree as T
from pgs.func._common import compute_dtype, increment, zero_count, zeros_state
from pgs.func.base import MATRIX, Transform, chain, check_range, hp_in
from pgs.func.combine import partition
from pgs.func.learning_rate import scale_by_learning_rate
from pgs.func.weight_decay import add_decayed_weights

#: Path fragments that mark an embedding or an output head: those go to the fallback.
EMBED_OR_HEAD = ("embed", "lm_head", "wte", "wpe")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw", "none")


def is_embedding_or_head(path: str) -> bool:
    low = path.lower()
    return any(s in low for s in EMBED_OR_HEAD)


def is_hidden_matrix(path: str, param) -> bool:
    """A hidden weight matrix (ndim ≥ 2, not an embedding or output head)."""
    return param.ndim >= 2 and not is_embedding_or_head(path)


def muon_route(path: str, param) -> str:
    """The default routing of ``pf.muon``: ``"muon"`` for hidden matrices, else ``"fallback"``.

    Embeddings and the output head (paths containing embed / lm_head / wte / wpe), norm
    gains and biases (ndim < 2) go to the fallback optimizer.  Pass your own
    ``route(path, param) -> "muon" | "fallback"`` to ``pf.muon`` to change it.
    """
    return "muon" if is_hidden_matrix(path, param) else "fallback"


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """An n-D tensor as a matrix (first dim × rest); a vector as one row; a scalar as 1×1."""
    if x.ndim == 0:
        return x.reshape(1, 1)
    if x.ndim == 1:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], -1)


def adjust_ratio(rows: int, cols: int, adjust_lr: str) -> float:
    """r(A, B): 'original' sqrt(max(1, A/B)) (Keller); 'match_rms_adamw' 0.2·sqrt(max(A, B)) (Moonshot)."""
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def newton_schulz(x: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps=1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NS_k(X): the quintic Newton–Schulz iteration on a matrix or a batch ``[..., m, n]``.

    X_0 = X/max(‖X‖_F, ε) (per matrix) ; A = X Xᵀ ; B = bA + cA² ; X ← aX + BX, k times,
    on the wide orientation (transposed when m > n).  Returns ``dtype`` (bf16 like the
    references; pass torch.float32 for an fp32 iteration).  Singular values of the result
    lie in (0, 1.2025] for any input (EQUATIONS.md A3).
    """
    a, b, c = coefficients
    tall = x.shape[-2] > x.shape[-1]
    X = x.to(dtype)
    if tall:
        X = X.mT
    squeeze = X.ndim == 2
    if squeeze:
        X = X.unsqueeze(0)
    X = X.reshape(-1, *X.shape[-2:])
    eps_t = eps.to(device=X.device, dtype=X.dtype) if isinstance(eps, torch.Tensor) else eps
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps_t)
    for _ in range(steps):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    X = X.reshape(*x.shape[:-2], *X.shape[-2:]) if not squeeze else X[0]
    return X.mT if tall else X


def orthogonalize(mats: list[torch.Tensor], steps: int, coefficients, eps, dtype) -> list[torch.Tensor]:
    """NS_k of every matrix in ``mats``, one batched iteration per (oriented shape, device)."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(mats):
        r, c = m.shape
        groups.setdefault((min(r, c), max(r, c), str(m.device)), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(mats)
    for idx in groups.values():
        wide = [mats[i].mT if mats[i].shape[0] > mats[i].shape[1] else mats[i] for i in idx]
        res = newton_schulz(torch.stack([w.to(dtype) for w in wide]), steps, coefficients, eps, dtype)
        for j, i in enumerate(idx):
            o = res[j]
            out[i] = o.mT if mats[i].shape[0] > mats[i].shape[1] else o
    return out


class ScaleByMuonState(NamedTuple):
    count: torch.Tensor  # int32
    mu: object  # momentum buffer B_t, mu_dtype


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: str = "original",
    ns_dtype: torch.dtype = torch.bfloat16,
    mu_dtype: torch.dtype | None = None,
) -> Transform:
    """Muon's direction, without the learning rate (EQUATIONS.md A3, torch.optim.Muon).

    B_t = μ B_{t−1} + (1−μ) g_t            (lerp form, as torch computes it)
    U_t = (1−μ) g_t + μ B_t  if nesterov else B_t
    u_t = r(A, B) · NS_k(U_t)

    r is the shape factor ("original": sqrt(max(1, A/B)); "match_rms_adamw":
    0.2·sqrt(max(A, B)); "none": 1), A×B the matrix shape.  Follow it with
    ``add_decayed_weights(λ)`` and ``scale_by_learning_rate(η)`` to get torch's
    θ ← θ(1 − ηλ) − η r O_t: the decay uses the unadjusted η.

    n-D tensors are reshaped to (first dim × rest); vectors are treated as one row (their
    polar factor is g/‖g‖) — route them to AdamW instead, as ``pf.muon`` does.  Same-shape
    matrices are orthogonalized in one batched Newton–Schulz.

    Args:
        momentum: μ in [0, 1).
        nesterov: Nesterov look-ahead.
        ns_steps: Newton–Schulz iterations (a static int).
        ns_coefficients: (a, b, c) of the quintic.
        eps: ε of the normalization X/max(‖X‖_F, ε).
        adjust_lr: "original" | "match_rms_adamw" | "none".
        ns_dtype: dtype of the iteration (bf16 as the references; torch.float32 for fp32).
        mu_dtype: storage dtype of B (default: the parameter's).

    Example::

        opt = pf.chain(pf.scale_by_muon(), pf.add_decayed_weights(0.1), pf.scale_by_learning_rate(0.02))

    Paper: Jordan et al. 2024 (blog); arXiv 2502.16982 (match_rms_adamw).
    """
    who = "scale_by_muon"
    check_range("momentum", momentum, 0.0, 1.0, hi_open=True, who=who)
    check_range("eps", eps, 0.0, None, who=who)
    if isinstance(ns_steps, torch.Tensor) or not isinstance(ns_steps, int) or ns_steps < 0 or ns_steps >= 100:
        raise InvalidArgument(f"{who}: ns_steps must be a Python int in [0, 100), got {ns_steps!r} "
                              "(with inject_hyperparams, list it in static_args)")
    if len(ns_coefficients) != 3:
        raise InvalidArgument(f"{who}: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    if adjust_lr not in ADJUST_LR:
        raise InvalidArgument(f"{who}: adjust_lr={adjust_lr!r}, expected one of {ADJUST_LR}")
    if ns_dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise InvalidArgument(f"{who}: ns_dtype must be torch.bfloat16, float32 or float64, got {ns_dtype}")

    def init(params, **extra):
        return ScaleByMuonState(zero_count(params), zeros_state(params, mu_dtype))

    def update(updates, state, params=None, **extra):
        g_leaves, spec = T.flatten(updates)  # absent (None) leaves are not listed
        m_leaves = T.leaves(state.mu)
        if len(m_leaves) != len(g_leaves):
            raise TreeMismatch(f"scale_by_muon: {len(g_leaves)} updates but {len(m_leaves)} momentum buffers")
        paths = T.paths(updates)
        new_m, mats, where = [], [], []
        for g, m in zip(g_leaves, m_leaves):
            if g is None:
                new_m.append(None)
                continue
            cd = compute_dtype(g)
            mom, one_minus = (hp_in(x, cd, g.device) for x in (momentum, 1.0 - momentum))
            g32 = g.to(cd)
            m32 = m.to(cd).lerp(g32, one_minus)
            u = g32.lerp(m32, mom) if nesterov else m32
            new_m.append(m32.to(m.dtype))
            mats.append(u)
            where.append(len(new_m) - 1)

        def op(whole: list[torch.Tensor]) -> list[torch.Tensor]:
            # r(A, B)·NS(U) of whole tensors: under FSDP2 the shape factor is the full matrix's
            as_mats = [as_matrix(t) for t in whole]
            orth = orthogonalize(as_mats, ns_steps, ns_coefficients, eps, ns_dtype)
            return [(o.to(t.dtype) * adjust_ratio(a.shape[0], a.shape[1], adjust_lr)).reshape(t.shape)
                    for o, a, t in zip(orth, as_mats, whole)]

        # sharded: each matrix is gathered to an owner rank, orthogonalized, re-sharded
        hook = extra.get("whole_tensors")
        done = op(mats) if hook is None else hook(op, [paths[i] for i in where], mats)
        out = [None] * len(g_leaves)
        for k, i in enumerate(where):
            out[i] = done[k].to(g_leaves[i].dtype)
        mu_tree = T.unflatten(new_m, spec)
        return T.unflatten(out, spec), ScaleByMuonState(increment(state.count), mu_tree)

    return Transform(init, update, name="scale_by_muon", locality=MATRIX, flat_ok=False)


def muon(
    learning_rate=1e-3,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: str = "original",
    weight_decay: float = 0.1,
    adam_lr=3e-4,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    fallback: str = "adamw",
    route=None,
    ns_dtype: torch.dtype = torch.bfloat16,
    mu_dtype: torch.dtype | None = None,
) -> Transform:
    """Muon for hidden matrices, AdamW (or Lion) for everything else: a ``pf.partition``.

    "muon":     chain(scale_by_muon(...), add_decayed_weights(λ), scale_by_learning_rate(η))
                = θ ← θ(1 − ηλ) − η r(A,B) NS5(U_t)   (torch.optim.Muon; decay uses the unadjusted η)
    "fallback": adamw(adam_lr, adam_b1, adam_b2, adam_eps, adam_weight_decay) or
                lion(adam_lr, adam_b1, adam_b2, adam_weight_decay)

    ``route(path, param) -> "muon" | "fallback"`` decides; the default, ``muon_route``,
    sends 2-D+ hidden matrices to Muon and embeddings, the output head, norms and biases to
    the fallback.  Defaults follow torch.optim.Muon (lr 1e-3, weight decay 0.1); Keller's
    reference uses lr 0.02 with "original".  With ``adjust_lr="match_rms_adamw"`` an AdamW
    learning rate and weight decay can be reused directly (arXiv 2502.16982).

    Example::

        opt = pf.muon(0.02, weight_decay=0.0, adam_lr=3e-4)

    Paper: Jordan et al. 2024 (blog); arXiv 2502.16982.
    """
    from pgs.func.alias import adamw, lion

    if fallback not in ("adamw", "lion"):
        raise InvalidArgument(f"muon: fallback={fallback!r}, expected 'adamw' or 'lion'")
    inner = scale_by_muon(momentum, nesterov, ns_steps, ns_coefficients, eps, adjust_lr, ns_dtype, mu_dtype)
    check_range("weight_decay", weight_decay, 0.0, None, who="muon")
    decay = [add_decayed_weights(weight_decay)] if _nonzero(weight_decay) else []
    branch = chain(inner, *decay, scale_by_learning_rate(learning_rate))
    if fallback == "adamw":
        other = adamw(adam_lr, adam_b1, adam_b2, adam_eps, adam_weight_decay)
    else:
        other = lion(adam_lr, adam_b1, adam_b2, adam_weight_decay)
    return partition({"muon": branch, "fallback": other}, route or muon_route)


def _nonzero(x) -> bool:
    return isinstance(x, torch.Tensor) or x != 0
