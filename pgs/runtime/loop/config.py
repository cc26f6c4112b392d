"""``[train]``, ``[loss]``, ``[preference]`` and ``[distill]``: the loop's and its objectives'
typed configs (``pgs.runtime.loop.train``, ``.sft``, ``.preference``, ``.distill``)."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from pgs.errors import SpecError
from pgs.func.losses import DISTILL_KINDS, PREFERENCE_KINDS, REFERENCE_FREE
from pgs.runtime.model.config import DTYPES
from pgs.runtime.spec.fields import (describe, expect, int_at_least, is_int, is_number, number_in, one_of,
                                     string, suggest, table, to_float)

DEVICES = ("auto", "cpu", "cuda")
REFERENCE_MODES = ("cached", "live")
#: ``preference.kind``: the paired losses of ``pgs.func.losses.preference_loss`` and KTO
#: (``pgs.func.losses.kto_loss``, on unpaired labelled records: ``pgs.runtime.data.kto``).
PREFERENCE_SPEC_KINDS = (*PREFERENCE_KINDS, "kto")


@attrs.frozen
class LossSpec:
    """``[loss]``: the token objective and the output-head backend (``pgs.func.losses``).

    ``args`` go to the objective's class (``deft``: ``alpha``; ``infosft``: ``p_bar``, ...).
    ``neftune_alpha`` / ``symnoise_alpha`` (at most one > 0): noise on the input embeddings
    while training, NEFTune's uniform (arXiv 2310.05914) or SymNoise's symmetric Rademacher
    (arXiv 2312.01523) with the same scale α/√(L·d) (``pgs.func.losses.noise``).
    """

    section: ClassVar[str] = "loss"

    objective: str = attrs.field(default="ce", validator=string)
    backend: str = attrs.field(default="chunked", validator=string)
    chunk_size: int = attrs.field(default=1024, validator=int_at_least(1))
    z_loss: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    neftune_alpha: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    symnoise_alpha: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    args: dict = attrs.field(factory=dict, validator=table)

    def __attrs_post_init__(self) -> None:
        if self.neftune_alpha > 0 and self.symnoise_alpha > 0:
            raise SpecError(f"loss.symnoise_alpha: {self.symnoise_alpha:g} and loss.neftune_alpha = "
                            f"{self.neftune_alpha:g} are two kinds of embedding noise; set one of them (the other 0)")

    def embedding_noise(self):
        """``(noise function, α)`` of the input-embedding noise (``neftune`` or ``symnoise``,
        same signature), or None when both alphas are 0."""
        from pgs.func.losses import neftune, symnoise

        if self.symnoise_alpha > 0:
            return symnoise, self.symnoise_alpha
        if self.neftune_alpha > 0:
            return neftune, self.neftune_alpha
        return None


@attrs.frozen
class TrainSpec:
    """``[train]``: how long, how big, how often, and when to give up.

    Exactly one of ``steps`` (optimizer steps) and ``epochs`` (passes over the mix) is set.
    ``batch_size`` is global (packed sequences per optimizer step), split into ``grad_accum``
    micro-batches.  ``entropy_warn`` warns, ``entropy_halt`` (0: off) halts with exit 80 when an
    interval's mean next-token entropy is below it; ``health_every`` (0: ``log_every``) is that
    interval, the health summary's (``pgs.runtime.loop.health``).
    """

    section: ClassVar[str] = "train"

    steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    epochs: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    batch_size: int = attrs.field(default=8, validator=int_at_least(1))
    grad_accum: int = attrs.field(default=1, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    max_wall_seconds: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    eval_every: int = attrs.field(default=50, validator=int_at_least(0))
    log_every: int = attrs.field(default=10, validator=int_at_least(1))
    max_consecutive_skips: int = attrs.field(default=3, validator=int_at_least(0))
    max_skip_fraction: float = attrs.field(default=0.05, converter=to_float, validator=number_in(0.0, 1.0))
    entropy_warn: float = attrs.field(default=0.18, converter=to_float, validator=number_in(0.0))
    entropy_halt: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    health_every: int = attrs.field(default=0, validator=int_at_least(0))
    device: str = attrs.field(default="auto", validator=one_of(DEVICES))

    def check(self, spec) -> None:
        """The run's length and the batch's split (the processes' share is checked where their
        number is known, ``pgs.runtime.spec.load.check_world_size``)."""
        if self.steps is not None and self.epochs is not None:
            raise SpecError("train: set either steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            raise SpecError("train.steps: needed (or train.epochs = N)")
        if self.batch_size % self.grad_accum:
            raise SpecError(f"train.grad_accum: {self.grad_accum} does not divide train.batch_size = {self.batch_size}")


def _kind_known(instance, attribute, value):
    if value not in PREFERENCE_SPEC_KINDS:
        hint = suggest(value, PREFERENCE_SPEC_KINDS) if isinstance(value, str) else ""
        raise SpecError(f"preference.kind: {value!r} is not one of {', '.join(map(repr, PREFERENCE_SPEC_KINDS))}"
                        f"{hint}")


def _optional_path(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"preference.{attribute.name}: expected a local model folder or a hub name, "
                        f"got {describe(value)}")


@attrs.frozen
class PreferenceSpec:
    """``[preference]``: train on preference pairs with an offline objective (docs/techniques/preference.md).

    ``kind`` is one of ``pgs.func.losses.PREFERENCE_KINDS`` (``dpo``, ``ipo``, ``hinge``,
    ``dpop``, ``simpo``, ``orpo``); ``beta`` (ORPO: the odds-ratio term's weight),
    ``label_smoothing`` (cDPO's ε, dpo only), ``gamma`` (SimPO's margin, simpo only), ``lam``
    (DPOP's λ, dpop only) and ``nll_weight`` (an NLL term on the chosen answers, any kind) are
    its arguments (``pgs.func.losses.preference_loss``).  ``reference``: ``"cached"`` computes the
    reference log-probs of every pair once before training and keeps them in the run folder;
    ``"live"`` keeps a frozen copy that computes them every step.  ``reference_path`` names a
    local model folder as the reference (default: the initial policy).  ``simpo``/``orpo`` use
    no reference.  ``kind = "kto"`` trains on unpaired records (prompt, completion, label;
    docs/techniques/kto.md) with ``beta``, ``desirable_weight`` (λ_D) and ``undesirable_weight``
    (λ_U), read by it only (``pgs.func.losses.kto_loss``).
    """

    section: ClassVar[str] = "preference"

    kind: str = attrs.field(default="dpo", validator=_kind_known)
    beta: float = attrs.field(default=0.1, converter=to_float,
                              validator=expect("a number > 0", lambda v: is_number(v) and v > 0 and v != math.inf))
    label_smoothing: float = attrs.field(default=0.0, converter=to_float,
                                         validator=expect("a number in [0, 0.5)",
                                                           lambda v: is_number(v) and 0 <= v < 0.5))
    gamma: float = attrs.field(default=0.0, converter=to_float,
                               validator=expect("a finite number", lambda v: is_number(v) and math.isfinite(v)))
    lam: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    nll_weight: float = attrs.field(default=0.0, converter=to_float, validator=number_in(0.0))
    desirable_weight: float = attrs.field(default=1.0, converter=to_float,
                                          validator=expect("a number > 0",
                                                           lambda v: is_number(v) and 0 < v < math.inf))
    undesirable_weight: float = attrs.field(default=1.0, converter=to_float,
                                            validator=expect("a number > 0",
                                                             lambda v: is_number(v) and 0 < v < math.inf))
    reference: str = attrs.field(default="cached", validator=one_of(REFERENCE_MODES))
    reference_path: str | None = attrs.field(default=None, validator=_optional_path)

    def __attrs_post_init__(self) -> None:
        for name, kind in (("label_smoothing", "dpo"), ("gamma", "simpo"), ("lam", "dpop")):
            if getattr(self, name) != 0 and self.kind != kind:
                raise SpecError(f"preference.{name}: {getattr(self, name)!r} has no effect with kind = {self.kind!r} "
                                f"(only kind = {kind!r} reads it)")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) != 1.0 and self.kind != "kto":
                raise SpecError(f"preference.{name}: {getattr(self, name)!r} has no effect with kind = {self.kind!r} "
                                "(only kind = 'kto' reads it)")
        if self.kind == "kto" and self.nll_weight:
            raise SpecError(f"preference.nll_weight: {self.nll_weight!r} has no effect with kind = 'kto' (an NLL term "
                            "on the chosen answers belongs to the paired kinds)")
        if self.reference_path is not None and not self.uses_reference:
            raise SpecError(f"preference.reference_path: kind = {self.kind!r} uses no reference model")

    @property
    def uses_reference(self) -> bool:
        """Whether the objective reads reference log-probs (``simpo``/``orpo`` do not)."""
        return self.kind not in REFERENCE_FREE


#: ``[distill.generation]`` keys and their defaults (``pgs.runtime.model.generate.GenerationSettings``).
GENERATION_DEFAULTS = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0}


def _open_unit(instance, attribute, value):
    if value is not None and not (is_number(value) and 0 < value < 1):
        raise SpecError(f"distill.{attribute.name}: expected a number in (0, 1) (exclusive), got {describe(value)}")


def _teacher_path(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise SpecError(f"distill.teacher_path: expected a local model folder or a hub name, got {describe(value)}")


def _distill_kind(instance, attribute, value):
    if value not in DISTILL_KINDS:
        hint = suggest(value, DISTILL_KINDS) if isinstance(value, str) else ""
        raise SpecError(f"distill.kind: {value!r} is not one of {', '.join(map(repr, DISTILL_KINDS))}{hint}")


def _check_generation(table: dict) -> None:
    for key, value in table.items():
        where = f"distill.generation.{key}"
        if key not in GENERATION_DEFAULTS:
            raise SpecError(f"{where}: unknown key{suggest(key, GENERATION_DEFAULTS)}")
        if key == "max_new_tokens" and not (is_int(value) and value >= 1):
            raise SpecError(f"{where}: expected an integer >= 1, got {describe(value)}")
        if key == "temperature" and not (is_number(value) and 0 <= value < math.inf):
            raise SpecError(f"{where}: expected a number >= 0 (0: greedy), got {describe(value)}")
        if key == "top_p" and not (is_number(value) and 0 < value <= 1):
            raise SpecError(f"{where}: expected a number in (0, 1], got {describe(value)}")


@attrs.frozen
class DistillSpec:
    """``[distill]``: on-policy distillation from a frozen teacher (docs/techniques/distillation.md).

    The teacher is a local Hugging Face folder or hub name (``teacher_path``) or, for tests, an
    architecture table with a random init (``teacher_config``, ``teacher_init_seed``), loaded in
    ``teacher_dtype`` without gradients; its tokenizer must be the student's (``pgs validate``).
    ``on_policy`` (GKD's λ) is the probability that a batch's completions are sampled by the
    student from the prompts instead of read from the data.  ``kind`` (``forward_kl``,
    ``reverse_kl``, ``jsd``), ``beta`` (jsd's β ∈ (0, 1), default 0.5; jsd only) and
    ``temperature`` are ``pgs.func.losses.distill_loss``'s arguments.  ``[distill.generation]``
    (``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``) says how the student samples.
    ``eval_prompts``: held-out prompts on which the eval measures the teacher–student KL.
    """

    section: ClassVar[str] = "distill"

    teacher_path: str | None = attrs.field(default=None, validator=_teacher_path)
    teacher_config: dict | None = attrs.field(default=None, validator=attrs.validators.optional(table))
    teacher_init_seed: int = attrs.field(default=0, validator=int_at_least(0))
    teacher_dtype: str = attrs.field(default="bfloat16", validator=one_of(DTYPES))
    on_policy: float = attrs.field(default=0.5, converter=to_float, validator=number_in(0.0, 1.0))
    kind: str = attrs.field(default="jsd", validator=_distill_kind)
    beta: float | None = attrs.field(default=None, converter=to_float, validator=_open_unit)
    temperature: float = attrs.field(default=1.0, converter=to_float,
                                     validator=expect("a number > 0", lambda v: is_number(v) and 0 < v < math.inf))
    generation: dict = attrs.field(factory=dict, validator=table)
    eval_prompts: int = attrs.field(default=64, validator=int_at_least(0))

    def __attrs_post_init__(self) -> None:
        if (self.teacher_path is None) == (self.teacher_config is None):
            both = "both are set" if self.teacher_path is not None else "neither is set"
            raise SpecError("distill: set exactly one of distill.teacher_path (a local Hugging Face folder) or "
                            f"distill.teacher_config (random init, for tests); {both}")
        if self.teacher_config is not None and not isinstance(self.teacher_config.get("model_type"), str):
            raise SpecError("distill.teacher_config.model_type: needed (a string such as \"qwen3\")")
        if self.beta is not None and self.kind != "jsd":
            raise SpecError(f"distill.beta: {self.beta!r} has no effect with kind = {self.kind!r} "
                            "(only kind = 'jsd' reads it)")
        _check_generation(self.generation)

    @property
    def jsd_beta(self) -> float:
        """β as the loss reads it (0.5 unless set)."""
        return 0.5 if self.beta is None else self.beta

    def generation_settings(self) -> dict:
        """``[distill.generation]`` with its defaults filled in."""
        return {**GENERATION_DEFAULTS, **self.generation}
