"""Named optimizers, each nothing but an explicit chain of building blocks."""

from __future__ import annotations

import torch

from pgs.func._common import nonzero
from pgs.func.adam import scale_by_adam
from pgs.func.base import Transform, chain, check_range, identity
from pgs.func.learning_rate import scale_by_learning_rate, takes_learning_rate
from pgs.func.lion_direction import scale_by_lion
from pgs.func.sgd_momentum import scale_by_sgd_momentum
from pgs.func.weight_decay import add_decayed_weights


@takes_learning_rate
def adamw(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> Transform:
    """AdamW = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate).

    θ ← θ − η_t (m̂/(sqrt(v̂)+ε) + λθ).  Equals ``torch.optim.AdamW`` (arXiv 1711.05101).
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="adamw")
    return chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        add_decayed_weights(weight_decay, mask) if nonzero(weight_decay) else identity(),
        scale_by_learning_rate(learning_rate),
    )


@takes_learning_rate
def lion(
    learning_rate=1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask=None,
    mu_dtype: torch.dtype | None = None,
) -> Transform:
    """Lion = chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate) (arXiv 2302.06675).

    θ ← θ − η_t (sign(β1 m + (1−β1) g) + λθ).
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="lion")
    return chain(
        scale_by_lion(b1, b2, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask) if nonzero(weight_decay) else identity(),
        scale_by_learning_rate(learning_rate),
    )


@takes_learning_rate
def sgd(learning_rate=1e-2, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
        mask=None) -> Transform:
    """SGD as torch.optim.SGD computes it: coupled weight decay, then momentum, then −η.

    g ← g + λθ ; b ← μb + g ; u = g + μb (nesterov) or b ; θ ← θ − η u.
    """
    check_range("learning_rate", learning_rate, 0.0, None, who="sgd")
    return chain(
        add_decayed_weights(weight_decay, mask) if nonzero(weight_decay) else identity(),
        scale_by_sgd_momentum(momentum, nesterov) if (nonzero(momentum) or nesterov) else identity(),
        scale_by_learning_rate(learning_rate),
    )
