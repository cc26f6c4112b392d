"""Token losses of the output head, reported as sums (pure: no I/O, no process groups).

Backends (same signature, chosen by ``token_loss(..., backend=...)``):
``chunked`` (default, O(chunk·V) memory), ``dense`` (reference), ``liger`` and ``cce``
(CUDA fused kernels, cross-entropy only).  Objectives: ``ce``, ``deft``, ``deft_cayley``,
``dft``, ``infosft``, ``cadft``, ``deformed_log`` (docs/techniques/README.md).  Embedding noise: ``neftune``,
``symnoise`` (docs/techniques/noise.md).  Preference losses: ``preference_loss`` (DPO, IPO, SLiC hinge, DPOP,
SimPO, ORPO) on per-sequence log-probs from ``sequence_logps``; ``kto_loss`` (KTO) on unpaired labelled
ones.  Distillation: ``distill_loss`` (forward KL, reverse KL, GKD's JSD(β)) between a student's and a teacher's
head, chunked.  Mixture-of-experts router statistics and losses: ``router_stats``,
``load_balance_loss``, ``router_z_loss`` (docs/moe.md).  See docs/losses.md,
docs/techniques/preference.md and docs/techniques/distillation.md.
"""

from pgs.func.losses.chunked import (
    ChunkedTokenLoss,
    DeferredHeadGrad,
    chunked_cross_entropy,
    chunked_token_loss,
    target_logprobs,
    token_nll_entropy,
)
from pgs.func.losses.distill import DISTILL_KINDS, DistillLoss, distill_loss
from pgs.func.losses.dense import cross_entropy, dense_token_loss
from pgs.func.losses.peer_kernels import fused_cross_entropy
from pgs.func.losses.moe import (
    RouterStats,
    dead_fraction,
    load_balance_loss,
    load_utilization,
    max_violation,
    router_stats,
    router_z_loss,
)
from pgs.func.losses.noise import neftune, symnoise
from pgs.func.losses.objectives import (
    CADFT,
    CE,
    DEFT,
    DFT,
    OBJECTIVES,
    DeformedLog,
    DEFTCayley,
    InfoSFT,
    Objective,
    TokenInputs,
    TokenObjective,
    cadft_compatibility,
    cayley_alpha,
    infosft_weight,
    resolve_objective,
)
from pgs.func.losses.kto import (RECOMMENDED_RATIO, KTOLoss, kto_accuracy, kto_loss, kto_reference_point,
                                 kto_weight_ratio)
from pgs.func.losses.preference import PREFERENCE_KINDS, REFERENCE_FREE, PreferenceLoss, preference_loss
from pgs.func.losses.result import TokenLossResult
from pgs.func.losses.sequence import sequence_logps
from pgs.func.losses.dispatch import BACKENDS, token_loss

__all__ = [
    "BACKENDS",
    "CADFT",
    "CE",
    "DEFT",
    "DEFTCayley",
    "DeformedLog",
    "DFT",
    "ChunkedTokenLoss",
    "DeferredHeadGrad",
    "DISTILL_KINDS",
    "DistillLoss",
    "InfoSFT",
    "OBJECTIVES",
    "Objective",
    "PREFERENCE_KINDS",
    "PreferenceLoss",
    "KTOLoss",
    "RECOMMENDED_RATIO",
    "REFERENCE_FREE",
    "RouterStats",
    "TokenInputs",
    "TokenLossResult",
    "TokenObjective",
    "cadft_compatibility",
    "cayley_alpha",
    "chunked_cross_entropy",
    "chunked_token_loss",
    "cross_entropy",
    "dead_fraction",
    "dense_token_loss",
    "distill_loss",
    "fused_cross_entropy",
    "infosft_weight",
    "load_balance_loss",
    "load_utilization",
    "max_violation",
    "neftune",
    "preference_loss",
    "kto_accuracy",
    "kto_loss",
    "kto_reference_point",
    "kto_weight_ratio",
    "resolve_objective",
    "router_stats",
    "router_z_loss",
    "sequence_logps",
    "symnoise",
    "target_logprobs",
    "token_loss",
    "token_nll_entropy",
]
