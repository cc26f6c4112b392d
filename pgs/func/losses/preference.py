"""Offline preference losses (DPO and its variants), per pair, from sequence log-probs.

Inputs are summed log-probabilities of each arm's completion tokens under the policy,
log π(y|x) (``sequence_logps`` computes them without [N, V] logits), and for the
reference-based kinds the same under a frozen reference model.  With

    h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))

the kinds are (σ the logistic function, β > 0):

======  ========================================================================  ============
kind    per-pair loss                                                             paper
======  ========================================================================  ============
dpo     −(1−ε)·log σ(βh) − ε·log σ(−βh)   (ε = ``label_smoothing``: cDPO)          2305.18290
ipo     (h − 1/(2β))²                                                             2310.12036
hinge   max(0, 1 − βh)                    (SLiC-HF's calibration loss)            2305.10425
dpop    −log σ(β(h − λ·max(0, log π_ref(y_c) − log π(y_c))))   (λ = ``lam``)      2402.13228
simpo   −log σ(β·log π(y_c)/|y_c| − β·log π(y_r)/|y_r| − γ)   (no reference)       2405.14734
orpo    NLL(y_c) − β·log σ(log odds(y_c) − log odds(y_r))     (no reference)       2403.07691
======  ========================================================================  ============

ORPO: log odds(y) = log(P/(1 − P)) with log P = log π(y)/|y| the length-averaged log-prob,
and NLL(y_c) = ``chosen_nll`` when given, else −log π(y_c)/|y_c|.  β plays the paper's λ
(the weight of the odds-ratio term), as in TRL's ORPOTrainer.  Any kind may add
``nll_weight``·NLL(y_c) (e.g. DPOP or DPO + NLL, "RPO").

Rewards (detached, for logging): β·(log π − log π_ref) per arm; for the reference-free kinds
β·log π/|y| (the length-normalised log-prob).  Pure: no I/O, no process groups.
"""

from __future__ import annotations

import difflib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pgs.errors import InvalidArgument

PREFERENCE_KINDS = ("dpo", "ipo", "hinge", "dpop", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")

#: Other libraries' names for these losses (TRL's ``loss_type``), for the did-you-mean hint only.
_ALIASES = {"sigmoid": "dpo", "slic": "hinge", "cdpo": "dpo"}

#: Which kind reads which optional hyperparameter (a nonzero value for any other kind is refused).
_USES = {"label_smoothing": ("dpo",), "gamma": ("simpo",), "lam": ("dpop",)}


class PreferenceLoss(NamedTuple):
    """Per-pair results of ``preference_loss`` (all [P]).

    Attributes:
        loss: the per-pair loss, differentiable; the caller reduces it (mean over pairs).
        chosen_rewards: β(log π(y_c) − log π_ref(y_c)), or β·log π(y_c)/|y_c| for the
            reference-free kinds; detached.
        rejected_rewards: the same for the rejected arm; detached.
    """

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor

    @property
    def margins(self) -> Tensor:
        """chosen_rewards − rejected_rewards (detached)."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> Tensor:
        """1.0 where the chosen arm's reward exceeds the rejected arm's, 0.5 where they tie (at the
        start of DPO, where the policy is the reference), else 0.0 (per pair)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return (c > r).to(c.dtype) + 0.5 * (c == r).to(c.dtype)


def _check_kind(kind: str) -> None:
    if kind in PREFERENCE_KINDS:
        return
    word = str(kind).lower()
    close = [_ALIASES[word]] if word in _ALIASES else difflib.get_close_matches(word, PREFERENCE_KINDS, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InvalidArgument(f"kind: unknown preference loss {kind!r}{hint}; expected one of {list(PREFERENCE_KINDS)}")


def check_number(name: str, value: float, ok: bool, expected: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        raise InvalidArgument(f"{name} must be {expected}, got {value!r}")


def _check_tensor(name: str, t: Tensor | None, shape: torch.Size) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise InvalidArgument(f"{name} must be a tensor of shape {tuple(shape)}, got {type(t).__name__}")
    if t.shape != shape:
        raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (chosen_logps' shape)")


def _lengths(name: str, t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.to(dtype)
    if bool((t <= 0).any()):
        raise InvalidArgument(f"{name} must be > 0 for every pair (an arm with no completion tokens)")
    return t

def _check_inputs(kind, beta, label_smoothing, gamma, lam, nll_weight, chosen_logps, rejected_logps,
                  ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths, chosen_nll) -> None:
    """:func:`preference_loss`'s arguments: the numbers' ranges, the tensors' shapes, and what
    ``kind`` needs (a reference or lengths) or ignores."""
    _check_kind(kind)
    check_number("beta", beta, beta > 0, "> 0")
    check_number("label_smoothing", label_smoothing, 0.0 <= label_smoothing < 0.5, "in [0, 0.5)")
    check_number("gamma", gamma, True, "a finite number")
    check_number("lam", lam, lam >= 0, ">= 0")
    check_number("nll_weight", nll_weight, nll_weight >= 0, ">= 0")
    for name, value in (("label_smoothing", label_smoothing), ("gamma", gamma), ("lam", lam)):
        if value != 0 and kind not in _USES[name]:
            raise InvalidArgument(
                f"{name}={value!r} has no effect with kind={kind!r} (it is read by kind={_USES[name][0]!r} only)"
            )
    if not isinstance(chosen_logps, Tensor) or chosen_logps.dim() != 1:
        shape = tuple(chosen_logps.shape) if isinstance(chosen_logps, Tensor) else type(chosen_logps).__name__
        raise InvalidArgument(f"chosen_logps must be a 1-D tensor [P] (one entry per pair), got {shape}")
    shape = chosen_logps.shape
    for name, t in (
        ("rejected_logps", rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
        ("chosen_lengths", chosen_lengths),
        ("rejected_lengths", rejected_lengths),
        ("chosen_nll", chosen_nll),
    ):
        _check_tensor(name, t, shape)
    if rejected_logps is None:
        raise InvalidArgument("rejected_logps is required")
    reference_free = kind in REFERENCE_FREE
    if reference_free:
        for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if t is not None:
                raise InvalidArgument(f"{name}: kind={kind!r} uses no reference model; pass None")
        for name, t in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
            if t is None:
                raise InvalidArgument(f"{name} is required by kind={kind!r} (it length-normalises the log-probs)")
    else:
        for name, t in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if t is None:
                raise InvalidArgument(
                    f"{name} is required by kind={kind!r} (a reference-based loss); "
                    f"the reference-free kinds are {list(REFERENCE_FREE)}"
                )
    needs_nll = kind == "orpo" or nll_weight > 0
    if needs_nll and chosen_nll is None and chosen_lengths is None:
        raise InvalidArgument(
            f"chosen_lengths (or chosen_nll) is required for the chosen arm's NLL "
            f"({'kind=orpo' if kind == 'orpo' else f'nll_weight={nll_weight!r}'})"
        )



def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    *,
    kind: str = "dpo",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    lam: float = 0.0,
    nll_weight: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    chosen_nll: Tensor | None = None,
) -> PreferenceLoss:
    """Per-pair preference loss and both arms' rewards (equations: the module docstring).

    Args:
        chosen_logps, rejected_logps: [P] summed log π over each arm's completion tokens.
        ref_chosen_logps, ref_rejected_logps: [P] the same under the frozen reference
            (required by dpo, ipo, hinge, dpop; refused by simpo, orpo); detached here.
        kind: one of ``PREFERENCE_KINDS``.
        beta: β > 0 (ORPO: the weight λ of the odds-ratio term).
        label_smoothing: ε ∈ [0, 0.5), the assumed label-flip rate of cDPO (dpo only).
        gamma: SimPO's target margin γ (simpo only).
        lam: DPOP's λ ≥ 0 (dpop only).
        nll_weight: w ≥ 0: adds w·NLL(y_c) for any kind.
        chosen_lengths, rejected_lengths: [P] completion-token counts |y| (> 0); required by
            simpo and orpo, and by ``nll_weight`` without ``chosen_nll``.
        chosen_nll: [P] the chosen arm's NLL, if the caller normalises it otherwise than
            −log π(y_c)/|y_c| (orpo and ``nll_weight``); differentiable.

    Returns:
        ``PreferenceLoss(loss [P], chosen_rewards [P], rejected_rewards [P])`` in
        chosen_logps' dtype promoted to at least fp32.

    Example:
        >>> c, r = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
        >>> out = preference_loss(c, r, torch.tensor([-11.0, -4.0]), torch.tensor([-11.0, -4.0]))
        >>> out.loss.shape, bool(out.accuracy[0]), bool(out.accuracy[1])
        (torch.Size([2]), True, False)
    """
    _check_inputs(kind, beta, label_smoothing, gamma, lam, nll_weight, chosen_logps, rejected_logps,
                  ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths, chosen_nll)
    reference_free = kind in REFERENCE_FREE

    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)
    pc, pr = chosen_logps.to(dtype), rejected_logps.to(dtype)
    len_c = None if chosen_lengths is None else _lengths("chosen_lengths", chosen_lengths, dtype)
    len_r = None if rejected_lengths is None else _lengths("rejected_lengths", rejected_lengths, dtype)

    if reference_free:
        avg_c, avg_r = pc / len_c, pr / len_r
        chosen_rewards, rejected_rewards = beta * avg_c.detach(), beta * avg_r.detach()
        if kind == "simpo":
            loss = -F.logsigmoid(beta * (avg_c - avg_r) - gamma)
        else:  # orpo
            loss = _nll(pc, len_c, chosen_nll, dtype) - beta * F.logsigmoid(_log_odds(avg_c) - _log_odds(avg_r))
    else:
        rc, rr = ref_chosen_logps.detach().to(dtype), ref_rejected_logps.detach().to(dtype)
        dc, dr = pc - rc, pr - rr
        chosen_rewards, rejected_rewards = beta * dc.detach(), beta * dr.detach()
        h = dc - dr
        if kind == "dpo":
            loss = -F.logsigmoid(beta * h)
            if label_smoothing:
                loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * h)
        elif kind == "ipo":
            loss = (h - 1 / (2 * beta)).square()
        elif kind == "hinge":
            loss = torch.relu(1 - beta * h)
        else:  # dpop
            loss = -F.logsigmoid(beta * (h - lam * torch.relu(rc - pc)))
    if nll_weight:
        loss = loss + nll_weight * _nll(pc, len_c, chosen_nll, dtype)
    return PreferenceLoss(loss, chosen_rewards, rejected_rewards)


def _nll(pc: Tensor, len_c: Tensor | None, chosen_nll: Tensor | None, dtype: torch.dtype) -> Tensor:
    """NLL of the chosen arm: the caller's ``chosen_nll``, else −log π(y_c)/|y_c|."""
    return chosen_nll.to(dtype) if chosen_nll is not None else -pc / len_c


def _log_odds(avg_logp: Tensor) -> Tensor:
    """log(P/(1 − P)) for log P = ``avg_logp`` ≤ 0, as log P − log(−expm1(log P)).

    log P is clamped below −1e-6 (fp32) / −1e-12 (fp64) inside log(1 − P) only, so a
    length-averaged log-prob of exactly 0 gives a large finite odds instead of +inf."""
    tiny = 1e-12 if avg_logp.dtype == torch.float64 else 1e-6
    return avg_logp - torch.log(-torch.expm1(avg_logp.clamp(max=-tiny)))
