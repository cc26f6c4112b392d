"""Token objectives: how each valid token's loss depends on its target log-probability.

Every objective here has the form ℓ_i = ψ_i(log p_{i,y}) with per-token constants (gates)
that carry no gradient.  Each one gives

- ``loss``: ℓ_i, written as a differentiable function of ``log p_y`` (the dense backend
  differentiates it with autograd), and
- ``gate``: g_i = −∂ℓ_i/∂log p_{i,y}, detached, so that ∇_z ℓ_i = g_i · (p_i − e_y).

The chunked backend uses only ``gate`` (it never builds a graph over the logits); the
property tests check that ``gate`` equals autograd's derivative of ``loss``.

Notation (docs/techniques/deft.md): z the logits, p = softmax(z), y the target, M the
valid tokens, sg the stop-gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from pgs.errors import InvalidArgument

# A lazy source of the detached target log-probabilities log p_{i,y}, shape [N]; backends
# that already hold the logits return them, the chunked backend runs a no-grad pre-pass.
TargetLogprobs = Callable[[], Tensor]


@runtime_checkable
class TokenObjective(Protocol):
    """What a backend needs from an objective; new objectives implement this, nothing else.

    ``prepare`` resolves per-call data (it may call ``target_logprobs()`` once, a pre-pass);
    ``terms`` maps a chunk's ``log p_y`` [n] (and Σ_v p² [n] when ``needs_collision``) to
    ``(loss [n], gate [n])`` with gate = −∂loss/∂log p_y, detached.
    """

    name: str
    needs_collision: bool

    def prepare(self, target_logprobs: TargetLogprobs, valid: Tensor, **data) -> TokenInputs: ...

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs): ...


@attrs.frozen
class TokenInputs:
    """Per-call data an objective needs beyond the logits (all detached, shape [N] or 0-d)."""

    p_bar: Tensor | None = None  # Cayley: micro-batch mean target probability
    ref_logprobs: Tensor | None = None  # InfoSFT "reference": log q_i from a frozen model
    weight: Tensor | None = None  # CADFT: per-token copy of its sample's compatibility c

    def rows(self, index: Tensor) -> TokenInputs:
        """The same inputs restricted to the token rows ``index`` (for one chunk)."""

        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None or t.dim() == 0 else t.index_select(0, index)

        return TokenInputs(self.p_bar, take(self.ref_logprobs), take(self.weight))


@attrs.frozen
class CE:
    """Cross-entropy, ℓ_i = −log p_{i,y}; gate 1."""

    name = "ce"
    needs_collision = False

    def prepare(self, target_logprobs, valid, **_) -> TokenInputs:
        return TokenInputs()

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        return -logp_y, torch.ones_like(logp_y).detach()


def _deformed_log_terms(logp_y: Tensor, alpha: Tensor, eps: float):
    """ℓ = −(exp(α log p_y) − 1)/(α + eps) with α constant; gate = α p_y^α/(α + eps)."""
    alpha = alpha.detach()
    powered = torch.exp(alpha * logp_y)
    loss = -(powered - 1) / (alpha + eps)
    gate = (alpha * powered / (alpha + eps)).detach()
    return loss, gate


@attrs.frozen
class DEFT:
    """DEFT, arXiv 2602.11424 (C1): the deformed log with a parameter-free focus index.

    α_i = sg(Σ_v p_{i,v}²) (collision probability), ℓ_i = −(p_{i,y}^{α_i} − 1)/(α_i + 1e−6),
    so ∇_z ℓ_i = p_{i,y}^{α_i} · (p_i − e_y) up to the factor α/(α + 1e−6).
    """

    name = "deft"
    needs_collision = True

    def prepare(self, target_logprobs, valid, **_) -> TokenInputs:
        return TokenInputs()

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        return _deformed_log_terms(logp_y, collision, 1e-6)


@attrs.frozen
class DeformedLog:
    """The deformed-log family at a fixed focus index α ∈ (0, 1] (C1, "GeneralFamily-q").

    ℓ_i = −(p_{i,y}^α − 1)/α: α → 0 is the NLL, α = 1 is 1 − p_y (DFT's gradient).
    A baseline in DEFT's code, and the handle the property tests use for those limits.  No
    eps in the denominator: α is a fixed positive hyperparameter.  (DEFT keeps the official
    +1e−6, which scales its gradient by α/(α + 1e−6): ≈ 0.87 for a uniform p at V = 151,936,
    and makes the α → 0 limit 0, not the NLL; the NLL limit holds for α ≫ 1e−6.)
    """

    alpha: float = 1.0
    name = "deformed_log"
    needs_collision = False

    def __attrs_post_init__(self):
        if not 0.0 < self.alpha <= 1.0:
            raise InvalidArgument(f"deformed_log alpha must lie in (0, 1], got {self.alpha}")

    def prepare(self, target_logprobs, valid, **_) -> TokenInputs:
        return TokenInputs()

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        return _deformed_log_terms(logp_y, torch.full_like(logp_y, self.alpha), 0.0)


def cayley_alpha(p_y: Tensor, p_bar: Tensor) -> Tensor:
    """Cayley focus index (C1): α = clamp(0.5 p̄ + (1 − 0.5 p̄)·(1 − d)/(1 + d), 0.001, 1).

    d = 1 − p_y + 1e−8 is the distance to certainty; (1 − d)/(1 + d) ≈ p/(2 − p).
    """
    floor = 0.5 * p_bar
    d = 1 - p_y + 1e-8
    local = (1 - d) / (1 + d + 1e-8)
    return (floor + (1 - floor) * local).clamp(0.001, 1.0)


@attrs.frozen
class DEFTCayley:
    """DEFT's Cayley variant, arXiv 2602.11424 (C1).

    α_i = clamp(α_floor + (1 − α_floor)·α_loc,i, 0.001, 1) with α_floor = 0.5·p̄ and
    α_loc,i = (1 − d_i)/(1 + d_i), d_i = 1 − sg(p_{i,y}); ℓ_i = −(p_{i,y}^{α_i} − 1)/(α_i + 1e−8).

    p̄ = sg(mean_{i∈M} p_{i,y}) is the mean over the tokens of *this call*: with gradient
    accumulation that is the micro-batch, not the optimizer batch.  Pass ``p_bar`` to the
    loss to override it (for example a running mean kept by the runtime); otherwise the
    chunked backend computes it in a no-grad pre-pass (one extra head matmul, O(N) memory).
    """

    name = "deft_cayley"
    needs_collision = False

    def prepare(self, target_logprobs, valid, *, p_bar=None, **_) -> TokenInputs:
        if p_bar is None:
            logp = target_logprobs()
            count = valid.sum().clamp(min=1)
            p_bar = torch.where(valid, logp.exp(), 0).sum() / count
        return TokenInputs(p_bar=torch.as_tensor(p_bar).detach())

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        p_bar = inputs.p_bar.to(device=logp_y.device, dtype=logp_y.dtype)
        alpha = cayley_alpha(logp_y.detach().exp(), p_bar)
        return _deformed_log_terms(logp_y, alpha, 1e-8)


@attrs.frozen
class DFT:
    """DFT, arXiv 2508.05629 (C2): ℓ_i = −sg(p_{i,y}) · log p_{i,y}, so ∇ = −∇p_{i,y}."""

    name = "dft"
    needs_collision = False

    def prepare(self, target_logprobs, valid, **_) -> TokenInputs:
        return TokenInputs()

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        weight = logp_y.detach().exp()
        return -weight * logp_y, weight


def infosft_weight(log_q: Tensor, p_bar: float, eps: float = 1e-6) -> Tensor:
    """InfoSFT token weight (C3): w = q · [logit(p̄) − logit(q)]_+.

    Inside the logit q is clamped to [ε, 1 − ε] and logit(q) is taken in the log domain,
    log q − log1p(−q), so q = 1 gives 0 rather than inf·0 = NaN; the leading factor q is not
    clamped, so w → 0 as q → 0.
    """
    q = log_q.exp()
    qc = q.clamp(eps, 1 - eps)
    logit_q = qc.log() - torch.log1p(-qc)
    w = q * torch.relu(math.log(p_bar / (1 - p_bar)) - logit_q)
    # exactly 0 from p̄ up: at q = p̄ the two logits are computed differently and may differ by an ulp
    return torch.where(q >= p_bar, torch.zeros_like(w), w)


@attrs.frozen
class InfoSFT:
    """InfoSFT, arXiv 2605.14967 (C3): ℓ_i = −w_i log p_{i,y}, w_i = sg(q_i [C − logit q_i]_+).

    C = logit(p̄).  ``q_source="live"`` uses q_i = sg(p_{i,y}) from the model being trained
    (the default, a one-line change to SFT); ``"reference"`` takes log q_i per token from a
    frozen model through the loss's ``ref_logprobs`` argument.  w = 0 whenever q ≥ p̄.
    p̄ = 0.93 is pgs's default; the paper's own value was not confirmed (docs/techniques/infosft.md).
    """

    p_bar: float = 0.93
    q_source: str = "live"
    name = "infosft"
    needs_collision = False

    def __attrs_post_init__(self):
        if not 0.0 < self.p_bar < 1.0:
            raise InvalidArgument(f"infosft p_bar must lie in (0, 1), got {self.p_bar}")
        if self.q_source not in ("live", "reference"):
            raise InvalidArgument(
                f"infosft q_source must be 'live' or 'reference', got {self.q_source!r}"
            )

    def prepare(self, target_logprobs, valid, *, ref_logprobs=None, **_) -> TokenInputs:
        if self.q_source == "live":
            return TokenInputs()
        if ref_logprobs is None:
            raise InvalidArgument(
                "infosft with q_source='reference' needs ref_logprobs (log q per token, shape [N])"
            )
        if ref_logprobs.shape != valid.shape:
            raise InvalidArgument(
                f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, expected {tuple(valid.shape)}"
            )
        return TokenInputs(ref_logprobs=ref_logprobs.detach())

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        log_q = logp_y.detach() if inputs.ref_logprobs is None else inputs.ref_logprobs
        weight = infosft_weight(log_q.to(logp_y.dtype), self.p_bar).detach()
        return -weight * logp_y, weight


def cadft_compatibility(
    token_logprobs: Tensor,
    doc_ids: Tensor,
    valid: Tensor,
    *,
    temperature: float = 1.0,
    floor: float = 0.0,
) -> Tensor:
    """Per-token copy of its sample's compatibility c (C4, pgs's definition, see CADFT).

    c_s = max(floor, exp(ℓ̄_s / τ)), ℓ̄_s = mean_{i∈s∩M} log p_{i,y} (≤ 0), so c ∈ [0, 1] is
    non-decreasing in the sample's length-normalized log-likelihood (exp underflows to 0 for
    very unlikely samples at small τ); τ = inf gives c ≡ 1.

    Args:
        token_logprobs: [N] detached log p_{i,y}.
        doc_ids: [N] integer sample id of each token (any values; equal id = same sample).
        valid: [N] bool, the tokens in M.
    Returns:
        [N] weights, fp32 or fp64 as ``token_logprobs`` (detached); tokens of a sample with
        no valid token get 1.
    """
    _, inverse = torch.unique(doc_ids, return_inverse=True)
    n_docs = int(inverse.max()) + 1 if inverse.numel() else 0
    dtype = torch.promote_types(token_logprobs.dtype, torch.float32)
    logp = torch.where(valid, token_logprobs.detach().to(dtype), 0.0)
    logp = logp.clamp(min=torch.finfo(dtype).min)  # −inf / inf would give NaN
    totals = torch.zeros(n_docs, dtype=dtype, device=logp.device)
    totals.index_add_(0, inverse, logp)
    counts = torch.zeros_like(totals).index_add_(0, inverse, valid.to(dtype))
    mean = totals / counts.clamp(min=1)
    c = torch.exp(mean / temperature).clamp(min=floor, max=1.0)
    return c.index_select(0, inverse)


@attrs.frozen
class CADFT:
    """CADFT, arXiv 2606.11206 (docs/techniques/cadft.md), as pgs defines it.

    ℓ_i = −c_{s(i)} · sg(p_{i,y}) · log p_{i,y}, with c_s = sg(max(floor, exp(ℓ̄_s/τ))) and
    ℓ̄_s the model's own length-normalized log-likelihood of sample s (see
    ``cadft_compatibility``).  The paper's equations were not recovered: this is pgs's own
    definition (a stop-gradient, monotone function of ℓ̄_s times DFT's token
    weight), not a reproduction.  c ≡ 1 (``temperature=inf``, or ``compat`` of ones) is DFT
    exactly.  Needs ``doc_ids`` (a sample id per token) or an explicit ``compat`` [N].
    """

    temperature: float = 1.0
    floor: float = 0.0
    name = "cadft"
    needs_collision = False

    def __attrs_post_init__(self):
        if not self.temperature > 0:
            raise InvalidArgument(f"cadft temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.floor <= 1.0:
            raise InvalidArgument(f"cadft floor must lie in [0, 1], got {self.floor}")

    def prepare(self, target_logprobs, valid, *, doc_ids=None, compat=None, **_) -> TokenInputs:
        if compat is None:
            if doc_ids is None:
                raise InvalidArgument(
                    "objective 'cadft' needs doc_ids (sample id per token, shape [N]) or compat"
                )
            if doc_ids.shape != valid.shape:
                raise InvalidArgument(
                    f"doc_ids has shape {tuple(doc_ids.shape)}, expected {tuple(valid.shape)}"
                )
            compat = cadft_compatibility(
                target_logprobs(), doc_ids, valid, temperature=self.temperature, floor=self.floor
            )
        elif compat.shape != valid.shape:
            raise InvalidArgument(
                f"compat has shape {tuple(compat.shape)}, expected {tuple(valid.shape)}"
            )
        return TokenInputs(weight=compat.detach())

    def terms(self, logp_y: Tensor, collision: Tensor | None, inputs: TokenInputs):
        weight = (inputs.weight.to(logp_y.dtype) * logp_y.detach().exp()).detach()
        return -weight * logp_y, weight


Objective = CE | DEFT | DeformedLog | DEFTCayley | DFT | InfoSFT | CADFT

OBJECTIVES = {
    "ce": CE,
    "deft": DEFT,
    "deft_cayley": DEFTCayley,
    "deformed_log": DeformedLog,
    "dft": DFT,
    "infosft": InfoSFT,
    "cadft": CADFT,
}


def resolve_objective(objective: str | TokenObjective) -> TokenObjective:
    """An objective instance from its name (default settings) or an instance itself."""
    if isinstance(objective, str):
        if objective not in OBJECTIVES:
            raise InvalidArgument(
                f"unknown loss objective {objective!r}; expected one of {sorted(OBJECTIVES)}"
            )
        return OBJECTIVES[objective]()
    if not isinstance(objective, TokenObjective):
        raise InvalidArgument(
            f"objective must be one of {sorted(OBJECTIVES)} or implement TokenObjective, got {objective!r}"
        )
    return objective
