"""``[model]`` and ``[moe]``: the model's typed configs (``pgs.runtime.model.build``, ``.moe``)."""

from __future__ import annotations

import re
from typing import ClassVar

import attrs

from pgs.errors import SpecError
from pgs.runtime.spec.fields import boolean, describe, int_at_least, number_in, one_of, string, table

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "varlen", "eager", "flash_attention_2", "flex_attention")
VARLEN_KERNELS = ("auto", "cudnn", "flash")  # pgs.runtime.model.attention.VARLEN_KERNELS
#: transformers' expert implementations of MoE layers that run without a hub download ("auto":
#: transformers' own default); pgs.runtime.model.moe.experts_implementation checks the model.
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm")
FREEZE_POLICIES = ("none", "non_attention")


@attrs.frozen
class ModelSpec:
    """``[model]``: where the weights (or the architecture) and the tokenizer come from.

    ``tokenizer`` left out (or ``"model"``) is the model folder's own; a tokenizer that does not
    fit the folder's model is refused unless ``allow_tokenizer_mismatch`` (docs/spec.md)."""

    section: ClassVar[str] = "model"

    path: str | None = attrs.field(default=None, validator=attrs.validators.optional(string))
    config: dict | None = attrs.field(default=None, validator=attrs.validators.optional(table))
    tokenizer: str | None = attrs.field(default=None, validator=attrs.validators.optional(string))
    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    attn_implementation: str = attrs.field(default="auto", validator=one_of(ATTN_IMPLEMENTATIONS))
    varlen_kernel: str = attrs.field(default="auto", validator=one_of(VARLEN_KERNELS))
    experts_implementation: str = attrs.field(default="auto", validator=one_of(EXPERTS_IMPLEMENTATIONS))
    freeze: str | tuple[str, ...] = attrs.field(default="none")
    trust_remote_code: bool = attrs.field(default=False, validator=boolean)
    init_seed: int = attrs.field(default=0, validator=int_at_least(0))
    allow_tokenizer_mismatch: bool = attrs.field(default=False, validator=boolean)

    @freeze.validator
    def _check_freeze(self, attribute, value):
        if isinstance(value, str):
            one_of(FREEZE_POLICIES)(self, attribute, value)
            return
        if not isinstance(value, tuple) or not value:
            raise SpecError(
                f"model.freeze: expected \"none\", \"non_attention\" or a non-empty array of "
                f"regular expressions, got {describe(value)}"
            )
        for i, pattern in enumerate(value):
            if not isinstance(pattern, str):
                raise SpecError(f"model.freeze[{i}]: expected a regular expression string, got {describe(pattern)}")
            try:
                re.compile(pattern)
            except re.error as err:
                raise SpecError(f"model.freeze[{i}]: bad regular expression {pattern!r} ({err})") from None


@attrs.frozen
class MoESpec:
    """``[moe]``: mixture-of-experts models (docs/moe.md, ``pgs.runtime.model.moe``).

    ``load_balance``: the coefficient of the Switch load-balancing loss over the global batch
    (arXiv:2101.03961, arXiv:2501.11873); ``router_z_loss``: that of the ST-MoE router z-loss
    (arXiv:2202.08906).  Both 0 by default (post-training keeps the pretrained router's
    balance).  ``telemetry``: log the routers' load statistics (``moe/*``) with every step.
    Ignored for a dense model unless a coefficient is set (then refused).
    """

    section: ClassVar[str] = "moe"

    load_balance: float = attrs.field(default=0.0, validator=number_in(0.0))
    router_z_loss: float = attrs.field(default=0.0, validator=number_in(0.0))
    telemetry: bool = attrs.field(default=True, validator=boolean)
