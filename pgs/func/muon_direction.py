"""Muon: momentum orthogonalized by Newton–Schulz (docs/techniques/muon.md).

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
from pgs.func.kernels.kernel_config import interpret_requested
from pgs.func._common import compute_dtype, increment, nonzero, zero_count, zeros_state
from pgs.func.alias import adamw, lion
from pgs.func.apply import stochastic_round_to_bf16
from pgs.func.base import DIRECTION, EmptyState, MATRIX, Transform, chain, check_range, hp_in
from pgs.func.combine import partition
from pgs.func.layout import call_update, group_label
from pgs.func.learning_rate import ScaleByLearningRateState, lr_value, scale_by_learning_rate, takes_learning_rate
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions
from pgs.func.step import NO_CONTEXT, StepContext
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
    lie in (0, 1.2025] for any input (docs/techniques/muon.md).
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


def ns_kernels() -> tuple[str, ...]:
    from pgs.func.kernels import ns

    return ("cublas",) + tuple(ns.CONFIGS) if ns.HAVE_TRITON else ("cublas",)


def newton_schulz_batched(x: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS,
                          kernel: str = "cublas", fold: bool | None = None) -> torch.Tensor:
    """NS_k of an already normalised batch ``x`` = [B, m, n] (the fast path's iteration).

    Same maths as ``newton_schulz`` after its normalisation, with no copies: a tall batch
    (m > n) is iterated in place of its transpose (A = XᵀX, X ← aX + X·Bᵀ, the transposes
    of the wide products), and the buffers are reused.  ``kernel="cublas"`` uses
    bmm/baddbmm; a name from ``pgs.func.kernels.ns.CONFIGS`` computes A = X Xᵀ and
    B = bA + cA·A with the symmetric Triton kernel (upper tiles only, mirrored).

    ``fold=True`` writes aX + BX as (B + aI)·X: one plain product instead of a ``baddbmm``
    whose ``out=`` first receives a copy of X (a full pass over the batch per iteration).
    The symmetric kernel rounds B + aI to bf16 once, from fp32, in its epilogue; cuBLAS
    rounds B and then B_ii + a again.  Default (None): fold with the symmetric kernel only.
    Against an fp64 iteration of the same input the single-rounding fold is as accurate as
    the reference (tests/unit/test_muon_fast.py, docs/techniques/muon.md); ``fold=False`` keeps the
    reference's products exactly.  ``x`` may be overwritten; returns the result (``x`` or a
    buffer of the same shape).
    """
    a, b, c = (float(v) for v in coefficients)
    if fold is None:
        fold = kernel != "cublas"
    if steps == 0:
        return x
    tall = x.shape[-2] > x.shape[-1]
    nb, k = x.shape[0], min(x.shape[-2], x.shape[-1])
    A = torch.empty((nb, k, k), dtype=x.dtype, device=x.device)
    Bm = torch.empty_like(A)
    y = torch.empty_like(x)
    sym = kernel != "cublas"
    if sym:
        from pgs.func.kernels import ns
    for _ in range(steps):
        w = x.mT if tall else x  # the wide orientation (a view)
        if sym:
            ns.sym_mm(w, out=A, config=kernel)
            ns.sym_mm(A, A, alpha=c, beta=b, out=Bm, config=kernel, diag=a if fold else 0.0)
        else:
            torch.bmm(w, w.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=Bm)
            if fold:  # in fp32: a bf16 add_ may round the scalar a itself to bf16 (CPU does)
                d = Bm.diagonal(dim1=-2, dim2=-1)
                d.copy_(d.float() + a)
        if fold:
            torch.bmm(x, Bm.mT, out=y) if tall else torch.bmm(Bm, x, out=y)
        elif tall:
            torch.baddbmm(x, x, Bm.mT, beta=a, out=y)  # (aW + BW)ᵀ = aX + X Bᵀ
        else:
            torch.baddbmm(x, Bm, x, beta=a, out=y)
        x, y = y, x
    return x


def _use_triton(elementwise: str, tensors) -> bool:
    from pgs.func.kernels import ns

    if elementwise == "torch":
        return False
    ok = ns.HAVE_TRITON and all(t.is_contiguous() for t in tensors)
    if elementwise == "triton":
        if not ok:
            raise InvalidArgument("muon_fused_step: elementwise='triton' needs triton and contiguous tensors")
        return True
    return ok and all(t.is_cuda for t in tensors)


def _pick_kernel(ns_kernel: str, x: torch.Tensor) -> str:
    """The NS product kernel for batch ``x``: ``ns_kernel``, or for "auto"
    the measured choice (the symmetric kernel, tuned config per shape, for a bf16 iteration on
    sm_90; cuBLAS otherwise).  A symmetric config asked for an fp32/fp64 iteration, or on a
    CPU outside Triton's interpreter, falls back to cuBLAS."""
    from pgs.func.kernels import ns

    kernel = ns_kernel
    if kernel == "auto":
        sym = x.dtype == torch.bfloat16 and ns.auto_symmetric(x.device)
        return ns.tuned_config(x.shape[-2], x.shape[-1]) if sym else "cublas"
    if kernel not in ns_kernels():
        raise InvalidArgument(f"muon: ns_kernel={kernel!r}, expected 'auto' or one of {ns_kernels()}")
    if kernel != "cublas" and (x.dtype != torch.bfloat16 or not (x.is_cuda or _interpreting())):
        return "cublas"  # tf32 would change fp32 maths; on CPU only the interpreter runs Triton
    return kernel


def _interpreting() -> bool:
    return interpret_requested()


def muon_fused_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    mus: list[torch.Tensor],
    *,
    learning_rate,
    weight_decay=0.0,
    momentum=0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients=NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: str = "original",
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_kernel: str = "auto",
    fold: bool | None = None,
    elementwise: str = "auto",
    memory: MemoryOptions = NO_MEMORY_OPTIONS,
    step: torch.Tensor | None = None,
    out: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One Muon step, update and apply, in three passes per same-shape group (the fast path).

    The maths of ``chain(scale_by_muon(...), add_decayed_weights(λ), scale_by_learning_rate(η))``
    followed by ``apply_updates``:

        B ← lerp(B, g, 1−μ) ;  U = lerp(g, B, μ) (nesterov) or B
        θ ← θ + (r·NS_k(U) + λθ)·(−η)

    1. one elementwise pass per tensor updates B in place and writes U, in ``ns_dtype``,
       straight into its slot of the group's [B, m, n] batch, with per-block sums of squares
       (the Frobenius norm needs no second read);
    2. the batch is normalised and iterated (``newton_schulz_batched``: cuBLAS or the
       symmetric Triton kernel, ``ns_kernel``;
       ``fold`` (default: on with the symmetric kernel only) writes aX + BX as (B + aI)X);
    3. one elementwise pass per tensor writes θ (into ``out[i]``, default ``params[i]``, in
       place), in fp32 arithmetic, cast or stochastically rounded (bf16 parameters; the Triton
       pass seeds Philox from ``step``, the step counter, and the group's index; the torch pass
       rounds with that seed through ``round_to_bf16``).

    ``mus`` are updated in place.  Hyperparameters may be numbers or 0-d tensors (the
    learning rate of a schedule): they are read from a device tensor, so nothing recompiles and
    the host never waits.  ``elementwise``: "triton" (CUDA default), "torch" (elsewhere).
    Differences from the reference are rounding only: the direction is never rounded to the
    gradient's dtype, and ‖U‖ sums in another order.
    """
    from pgs.func.kernels import ns
    from pgs.func.kernels.fused_transform import hp_tensor, one_minus, sr_seed

    out = params if out is None else out
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        mat = as_matrix(g)
        groups.setdefault((tuple(mat.shape), str(g.device)), []).append(i)
    for gi, ((shape, _), idx) in enumerate(groups.items()):
        dev = grads[idx[0]].device
        members = [t for i in idx for t in (grads[i], mus[i], params[i], out[i])]
        tri = _use_triton(elementwise, members)
        hp = hp_tensor(dev, momentum, one_minus(momentum), learning_rate, weight_decay)
        x = torch.empty((len(idx), *shape), dtype=ns_dtype, device=dev)
        numel = x[0].numel()
        sq = torch.empty((len(idx), ns.num_blocks(numel) if tri else 1), dtype=torch.float32, device=dev)
        for j, i in enumerate(idx):
            g, m = grads[i], mus[i]
            if tri:
                ns.muon_pre(g, m, x[j], sq[j], hp, nesterov)
                continue
            cd = compute_dtype(g)
            w_mom, w_one = (hp_in(v, cd, dev) for v in (momentum, one_minus(momentum)))
            g32 = g.to(cd)
            m32 = m.to(cd).lerp(g32, w_one)
            m.copy_(m32)
            u = g32.lerp(m32, w_mom) if nesterov else m32
            x[j].copy_(as_matrix(u))
            sq[j, 0] = x[j].to(torch.float32).square().sum()
        eps_t = eps.to(device=dev, dtype=torch.float32) if isinstance(eps, torch.Tensor) else eps
        norm = sq.sum(dim=1).sqrt().clamp(min=eps_t).to(ns_dtype)
        x.div_(norm[:, None, None])
        kernel = _pick_kernel(ns_kernel, x)
        # fold by default only where B + aI is rounded once from fp32 (the symmetric kernel's
        # epilogue): as accurate as the reference against fp64; cuBLAS keeps the reference's products
        o = newton_schulz_batched(x, ns_steps, ns_coefficients, kernel,
                                  fold=(kernel != "cublas") if fold is None else fold)
        ratio = adjust_ratio(shape[0], shape[1], adjust_lr)
        seed = None
        for j, i in enumerate(idx):
            p, dst = params[i], out[i]
            sr = memory.stochastic_rounding and p.dtype == torch.bfloat16
            if sr and seed is None:
                seed = sr_seed(step if step is not None else torch.zeros((), device=dev), gi)
            if tri:
                ns.muon_post(p, o[j], dst, hp, ratio, seed, salt=j)
                continue
            cd = compute_dtype(p)
            lr_c = learning_rate.to(device=dev, dtype=cd) if isinstance(learning_rate, torch.Tensor) else learning_rate
            wd_c = weight_decay.to(device=dev, dtype=cd) if isinstance(weight_decay, torch.Tensor) else weight_decay
            p32 = p.to(cd)
            v = o[j].to(cd).reshape(p.shape) * ratio + wd_c * p32
            new = p32 + v * (-lr_c)
            dst.copy_(round_to_bf16(new, seed, j) if sr else new)
    return out


def round_to_bf16(x: torch.Tensor, seed: torch.Tensor, leaf: int = 0) -> torch.Tensor:
    """``x`` (a temporary fp32 result; rounded in place) stochastically rounded into bf16
    (unbiased; arXiv 1502.02551) with the noise of ``seed``, a seed made of the optimizer
    state's step count, and ``leaf`` (``kernels/small.py``'s ``stochastic_round_``: the 8-bit
    chains' small-leaf noise), so the step is a function of its inputs and state.  Where no
    Triton runs (the CPU without ``TRITON_INTERPRET=1``) the same noise comes from torch ops
    (``pgs.func.apply.sr_noise``): the same bits on every route."""
    from pgs.func.kernels import small as KS

    if not KS.usable_for(x):
        return stochastic_round_to_bf16(x, seed=seed, leaf=leaf)
    x = x.float().contiguous()
    KS.stochastic_round_([x], seed, first=leaf)
    return x.to(torch.bfloat16)


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
    """Muon's direction, without the learning rate (docs/techniques/muon.md; torch.optim.Muon).

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

    def update(updates, state, params=None, *, ctx: StepContext = NO_CONTEXT, **extra):
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
        hook = ctx.whole_tensors
        done = op(mats) if hook is None else hook(op, [paths[i] for i in where], mats)
        out = [None] * len(g_leaves)
        for k, i in enumerate(where):
            out[i] = done[k].to(g_leaves[i].dtype)
        mu_tree = T.unflatten(new_m, spec)
        return T.unflatten(out, spec), ScaleByMuonState(increment(state.count), mu_tree)

    return Transform(init, update, name="scale_by_muon", locality=MATRIX, flat_ok=False, shard_aware=True,
                     stage=DIRECTION)


@takes_learning_rate
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

    if fallback not in ("adamw", "lion"):
        raise InvalidArgument(f"muon: fallback={fallback!r}, expected 'adamw' or 'lion'")
    check_range("learning_rate", learning_rate, 0.0, None, who="muon")
    check_range("adam_lr", adam_lr, 0.0, None, who="muon")
    check_range("weight_decay", weight_decay, 0.0, None, who="muon")
    branch = muon_matrices(learning_rate, momentum, nesterov, ns_steps, ns_coefficients, eps, adjust_lr,
                           weight_decay, ns_dtype, mu_dtype)
    if fallback == "adamw":
        other = adamw(adam_lr, adam_b1, adam_b2, adam_eps, adam_weight_decay)
    else:
        other = lion(adam_lr, adam_b1, adam_b2, adam_weight_decay)
    route = route or muon_route
    part = partition({"muon": branch, "fallback": other}, route)
    # pf.compile(pf.muon(...)).step: Muon groups fused (muon_matrices), the fallback as usual
    return _with_fused_step(part, _muon_partition_step(branch, other, route))


def muon_matrices(
    learning_rate=1e-3,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr: str = "original",
    weight_decay: float = 0.1,
    ns_dtype: torch.dtype = torch.bfloat16,
    mu_dtype: torch.dtype | None = None,
    ns_kernel: str = "auto",
) -> Transform:
    """Muon for matrices: ``chain(scale_by_muon, add_decayed_weights(λ), scale_by_learning_rate(η))``.

    θ ← θ(1 − ηλ) − η r(A,B) NS5(U_t) (torch.optim.Muon), the branch ``pf.muon`` routes hidden
    matrices to (the decay stage is left out when λ = 0).  Its ``update`` is the chain's; under
    ``pf.compile(...).step`` it runs fused (``muon_fused_step``: one elementwise pass before
    and one after the batched Newton–Schulz per shape group, no stacking copy, no separate
    decay / lr / apply passes), except under FSDP2 (``whole_tensors``), where the chain's
    gather-to-owner path runs.

    Example::

        fast = pf.compile(muon_matrices(0.02, weight_decay=0.1), donate=True)
        state = fast.init(params)
        params, state = fast.step(grads, state, params)
    """

    inner = scale_by_muon(momentum, nesterov, ns_steps, ns_coefficients, eps, adjust_lr, ns_dtype, mu_dtype)
    check_range("weight_decay", weight_decay, 0.0, None, who="muon")
    decay = [add_decayed_weights(weight_decay)] if nonzero(weight_decay) else []
    base = chain(inner, *decay, scale_by_learning_rate(learning_rate))

    def fused_step(fg, state, fp, *, ctx: StepContext, donate, memory: MemoryOptions, extra=None):
        layout = ctx.layout
        if layout is None or ctx.whole_tensors is not None:
            return None
        names = list(state)
        s_dir, s_lr = state[names[0]], state[names[-1]]
        count = s_lr.count
        lr = lr_value(learning_rate, count)
        mu = s_dir.mu  # scale_by_muon is not flat: its momentum is a per-parameter tree
        keys = [k for k, g in fg.items() if g is not None]
        if not donate:
            fp = {k: v.clone() for k, v in fp.items()}
            mu = T.tree_map(lambda t: t.clone(), mu)
        g_map = dict(T.leaves_with_paths(layout.unflatten({k: fg[k] for k in keys})))
        p_map = dict(T.leaves_with_paths(layout.unflatten({k: fp[k] for k in keys})))
        m_map = dict(T.leaves_with_paths(mu))
        trip = [(p_map[path], g, m_map[path]) for path, g in g_map.items() if g is not None]
        if trip:
            ps, gs, ms = (list(z) for z in zip(*trip))
            muon_fused_step(ps, gs, ms, learning_rate=lr, weight_decay=weight_decay, momentum=momentum,
                            nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps,
                            adjust_lr=adjust_lr, ns_dtype=ns_dtype, ns_kernel=ns_kernel,
                            memory=memory, step=count)
        new_state = {names[0]: ScaleByMuonState(increment(s_dir.count), mu)}
        for n in names[1:-1]:
            new_state[n] = state[n] if isinstance(state[n], EmptyState) else EmptyState()
        new_state[names[-1]] = ScaleByLearningRateState(increment(count), lr)
        return fp, new_state

    return _with_fused_step(base, fused_step)


def _with_fused_step(t: Transform, fused_step) -> Transform:
    """``t`` as a FusedTransform (every field kept) offering ``fused_step`` to ``pf.compile``."""
    import dataclasses

    from pgs.func.kernels.fused_transform import FusedTransform

    return FusedTransform(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Transform)},
                          fused_step=fused_step)


#: Sets the fallback tensors' stochastic-rounding seeds apart from the Muon groups' (``sr_seed``).
FALLBACK_SALT = 0xFA11


def _muon_partition_step(branch: Transform, other: Transform, route):
    """``fused_step`` of ``pf.muon``: its Muon groups fused, the fallback's through its update.

    On the flat layout the groups are split by label (partition groups by ``route``): the Muon
    groups go to ``muon_matrices``'s fused step, the fallback groups through the fallback
    chain's ``update`` and an fp32 apply (the generic flat step, eager), stochastically rounded
    (bf16) from a seed per fallback tensor made of Muon's step count (``round_to_bf16``).
    """
    from pgs.func.kernels.fused_transform import sr_seed

    def fused_step(fg, state, fp, *, ctx: StepContext, donate, memory: MemoryOptions, extra=None):
        layout = ctx.layout
        if layout is None or ctx.whole_tensors is not None:
            return None
        labs = group_label(layout, fp, route)

        def part(tree, want):
            return {k: v for k, v in tree.items() if labs.get(k) == want}

        got = branch.fused_step(part(fg, "muon"), state["muon"], part(fp, "muon"), ctx=ctx,
                                donate=donate, memory=memory, extra=extra)
        if got is None:
            return None
        new_p, s_muon = dict(got[0]), got[1]
        fg_f, fp_f = part(fg, "fallback"), part(fp, "fallback")
        s_fb = state["fallback"]
        if fp_f:
            u, s_new = call_update(other, fg_f, s_fb, fp_f, {**(extra or {}), "ctx": ctx})
            s_m = state["muon"]
            count = s_m[list(s_m)[-1]].count  # the step Muon's own rounding seeds from
            for j, (k, p) in enumerate(fp_f.items()):
                if u.get(k) is None:
                    new_p[k] = p
                    continue
                cd = torch.promote_types(p.dtype, torch.float32)
                x = p.to(cd) + u[k].to(cd)
                if memory.stochastic_rounding and p.dtype == torch.bfloat16:  # a seed per fallback tensor
                    x = round_to_bf16(x, sr_seed(count, ctx.sr_offset + j, salt=FALLBACK_SALT))
                else:
                    x = x.to(p.dtype)
                if donate:
                    p.copy_(x)
                    x = p
                new_p[k] = x
            s_fb = T.donate(s_fb, s_new) if donate else s_new
        for k, p in fp.items():
            new_p.setdefault(k, p)
        return new_p, {"muon": s_muon, "fallback": s_fb}

    return fused_step
