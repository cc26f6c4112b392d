"""From a spec's ``[optimizer]``, ``[schedule]`` and ``[loss]`` to ``pgs.func`` objects.

Transforms are looked up by name in ``pgs.func`` at call time, so a transform added there
(``muon``, ``lion8bit``, ...) is usable from a spec without touching this file:

* a *chain entry* is any public ``pgs.func`` factory annotated ``-> Transform`` that does
  not wrap other transforms (``chain``, ``masked``, ``accumulate``, ... cannot be written
  in TOML);
* an *alias* is such a factory that declares ``pf.takes_learning_rate`` (``adamw``, ``lion``,
  ``sgd``, ...), other than ``scale_by_learning_rate`` itself.

The learning rate is an explicit argument: :func:`build_chain` takes the run's schedule (built
once from ``[schedule]``, ``ScheduleSpec.build``) and hands it to the ``learning_rate`` of every
factory that declares ``takes_learning_rate``, unless the spec sets ``learning_rate`` there
itself; a factory that declares nothing never receives it.  The spec's own arguments are
checked against ``inspect.signature`` before the factory is called.  Strings given to ``mask``
arguments are compiled from a small vocabulary (:func:`compile_mask`), and strings given to
``*_dtype`` arguments become torch dtypes.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable, TYPE_CHECKING

import pgs.func as pf
from pgs.errors import PgsError, SpecError
from pgs.func.base import no_step_stage
from pgs.func.losses import BACKENDS, OBJECTIVES
from pgs.func.schedule_free_iterates import wraps_schedule_free
from pgs.runtime.optim.release import refusal, slab_refusal
from pgs.runtime.common import suggest

if TYPE_CHECKING:  # the spec imports this module to build what it names
    from pgs.runtime.optim.config import OptimizerSpec
    from pgs.runtime.spec.load import Spec

#: Parameter names of factories that wrap other transforms (not expressible as a chain entry).
_WRAPPER_ARGS = {"opt", "inner", "transforms", "named", "factory"}

#: Mask strings: what each keeps (``(path, param) -> True`` means the transform applies).
MASKS: dict[str, str] = {
    "all": "every parameter",
    "ndim>=2": "matrices and higher (not biases, norm scales or other vectors)",
    "no_bias_no_norm": "every parameter except biases and normalisation weights",
    "re:PATTERN": "parameters whose path matches the regular expression (re.search)",
    "!MASK": "the complement of another mask, e.g. \"!re:embed\"",
}

_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
_NORM_PART = re.compile(r"(norm|^ln(_|$))", re.IGNORECASE)


def compile_mask(text: str) -> Callable:
    """A mask string (see :data:`MASKS`) as a function ``(path, param) -> bool``."""
    if text.startswith("!"):
        inner = compile_mask(text[1:])
        return lambda path, p: not inner(path, p)
    if text == "all":
        return lambda path, p: True
    if text == "ndim>=2":
        return lambda path, p: p.ndim >= 2
    if text == "no_bias_no_norm":
        def keep(path, p):
            parts = str(path).split(".")
            return parts[-1] != "bias" and not any(_NORM_PART.search(part) for part in parts)

        return keep
    if text.startswith("re:"):
        try:
            pattern = re.compile(text[3:])
        except re.error as err:
            raise SpecError(f"bad regular expression {text[3:]!r} ({err})") from None
        return lambda path, p: pattern.search(str(path)) is not None
    raise SpecError(f"unknown mask {text!r}; expected one of {', '.join(MASKS)}{suggest(text, MASKS)}")


# --------------------------------------------------------------------------- lookup


def _factories() -> dict[str, Callable]:
    out = {}
    for name in getattr(pf, "__all__", dir(pf)):
        obj = getattr(pf, name, None)
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        if "Transform" not in str(sig.return_annotation) or _WRAPPER_ARGS & set(sig.parameters):
            continue
        out[name] = obj
    return out


def transform_names() -> list[str]:
    """The names a chain entry may use (every transform factory in ``pgs.func``)."""
    return sorted(_factories())


def alias_names() -> list[str]:
    """The names ``optimizer.alias`` may use (factories that declare ``takes_learning_rate``)."""
    return sorted(
        name for name, f in _factories().items()
        if name != "scale_by_learning_rate" and getattr(f, "takes_learning_rate", False)
    )


def _lookup(name: str, where: str, aliases: bool):
    table = _factories()
    names = alias_names() if aliases else sorted(table)
    if name not in names:
        what = "optimizer alias" if aliases else "pgs.func transform"
        hint = suggest(name, names) or f" (one of {', '.join(names)})"
        raise SpecError(f"{where}: unknown {what} {name!r}{hint}")
    return table[name]


def _convert(name: str, value, where: str):
    if isinstance(value, str) and "mask" in name:
        try:
            return compile_mask(value)
        except SpecError as err:
            raise SpecError(f"{where}: {err}") from None
    if isinstance(value, str) and name.endswith("dtype"):
        import torch

        if value not in _DTYPE_NAMES:
            raise SpecError(f"{where}: {value!r} is not one of {', '.join(_DTYPE_NAMES)}{suggest(value, _DTYPE_NAMES)}")
        return getattr(torch, value)
    return value


def _hint(key: str, value, params) -> str:
    """What to say after an unknown argument: torch's ``betas`` is pgs's b1 and b2."""
    if key == "betas" and "b1" in params and "b2" in params:
        b1, b2 = (value if isinstance(value, (list, tuple)) and len(value) == 2 else (0.9, 0.999))
        return f" (pgs uses b1 and b2 (betas=(b1, b2)): write b1 = {b1}, b2 = {b2})"
    return suggest(key, list(params))


def make_transform(name: str, args: dict, *, where: str, learning_rate, alias: bool = False):
    """Call the ``pgs.func`` factory ``name`` with checked ``args``; errors name ``where``.

    ``learning_rate`` (the run's schedule) goes to a factory that declares
    ``takes_learning_rate`` and whose ``args`` do not set it.  ``where`` is the dotted field of
    the entry (``optimizer.chain[1]``); an unknown argument is reported as ``{where}.{arg}`` (or
    ``{where}.args.{arg}`` for an alias).
    """

    if name == "ema" and not alias:
        raise SpecError(f"{where}.name: \"ema\" in a chain would average the updates, not the weights; an EMA of "
                        "the weights is [averaging] ema = 0.999 (docs/techniques/ema.md)")
    factory = _lookup(name, f"{where}.name" if not alias else "optimizer.alias", alias)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    arg_where = "optimizer.args" if alias else where
    kwargs = {}
    for key, value in args.items():
        if key not in params and not takes_any:
            raise SpecError(f"{arg_where}.{key}: unknown argument of {name}{_hint(key, value, params)}")
        kwargs[key] = _convert(key, value, f"{arg_where}.{key}")
    if getattr(factory, "takes_learning_rate", False):
        kwargs.setdefault("learning_rate", learning_rate)
    missing = [
        p.name for p in params.values()
        if p.default is inspect.Parameter.empty and p.name not in kwargs
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if missing:
        raise SpecError(f"{where}: {name} needs {', '.join(missing)}")
    try:
        transform = factory(**kwargs)
    except (PgsError, TypeError, ValueError) as err:
        raise SpecError(f"{where}: {err}") from None
    if not isinstance(transform, pf.Transform):
        raise SpecError(f"{where}: {name} did not build a transform (got {type(transform).__name__})")
    return transform


# --------------------------------------------------------------------------- builders


def build_chain(opt: OptimizerSpec, schedule):
    """The ``[optimizer]`` as one ``pgs.func.Transform`` whose learning rate is ``schedule`` (the
    ``[schedule]``'s ``ScheduleSpec.build``, or a number): it goes to the factories that declare
    ``takes_learning_rate``.  A chain that would climb the loss (no learning-rate stage) is refused."""

    if opt.chain is not None:
        parts = [
            make_transform(e.name, e.args, where=f"optimizer.chain[{i}]", learning_rate=schedule)
            for i, e in enumerate(opt.chain)
        ]
        chain = pf.chain(*parts)
        why = no_step_stage(chain)
        if why:  # the [schedule] reaches it through { name = "scale_by_learning_rate" }
            entry = '{ name = "scale_by_learning_rate" }'
            raise SpecError(f"optimizer.chain: {why.replace('scale_by_learning_rate(lr)', entry)}")
        return chain
    alias = make_transform(opt.alias, opt.args, where="optimizer", learning_rate=schedule, alias=True)
    why = no_step_stage(alias)
    if why:
        raise SpecError(f"optimizer.alias: {why}")
    if opt.clip > 0:
        return pf.chain(pf.clip_by_global_norm(opt.clip), alias)
    return alias


def build_token_loss(loss):
    """The ``[loss]`` objective instance, with ``loss.args`` checked against its class."""

    if loss.objective not in OBJECTIVES:
        names = sorted(OBJECTIVES)
        raise SpecError(f"loss.objective: {loss.objective!r} is not one of {', '.join(names)}"
                        f"{suggest(loss.objective, names)}")
    cls = OBJECTIVES[loss.objective]
    params = inspect.signature(cls).parameters
    for key in loss.args:
        if key not in params:
            hint = suggest(key, list(params)) or (f" (it takes {', '.join(params)})" if params else " (it takes none)")
            raise SpecError(f"loss.args.{key}: unknown argument of the {loss.objective} objective{hint}")
    try:
        return cls(**loss.args)
    except (PgsError, TypeError, ValueError) as err:
        raise SpecError(f"loss.args: {err}") from None


def check_loss(loss) -> None:
    """Names and combinations of ``[loss]`` that cannot work."""

    if loss.backend not in BACKENDS:
        raise SpecError(f"loss.backend: {loss.backend!r} is not one of {', '.join(BACKENDS)}"
                        f"{suggest(loss.backend, BACKENDS)}")
    objective = build_token_loss(loss)
    if getattr(objective, "q_source", "live") == "reference":
        raise SpecError("loss.args.q_source: \"reference\" needs log-probs of a frozen reference model per token, "
                        "which pgs run does not compute; use q_source = \"live\" (the default: q from the model "
                        "being trained)")
    if loss.backend in ("liger", "cce"):
        if loss.objective != "ce":
            raise SpecError(f"loss.backend: {loss.backend} computes cross-entropy only; "
                            f"objective {loss.objective!r} needs the chunked or dense backend")
        if loss.z_loss:
            raise SpecError(f"loss.z_loss: the {loss.backend} backend has no z-loss; use chunked or dense")


def check_memory_options(spec: Spec, chain, schedule) -> None:
    """``[memory]`` against the rest of the spec: what gradient release cannot run (``schedule``:
    the chain's learning rate, to rebuild an entry that release refuses and name it)."""
    mem = spec.memory
    why = mem.refusal()
    if why:
        raise SpecError(why)
    if mem.seco_chunk:
        check_seco(spec)
    if not mem.gradient_release:
        return
    if spec.train.grad_accum > 1:
        raise SpecError(f"memory.gradient_release: train.grad_accum = {spec.train.grad_accum} needs whole gradients "
                        "summed over micro-batches, but gradient release updates at every backward; set "
                        "train.grad_accum = 1 (a larger micro-batch) or memory.gradient_release = false")
    opt = spec.optimizer
    if opt.chain is None and opt.clip > 0:
        raise SpecError(f"memory.gradient_release: optimizer.clip = {opt.clip:g} is a global-norm clip, which "
                        "cannot run inside backward (the global norm is unknown until backward ends); set "
                        "optimizer.clip = 0, or write an optimizer.chain with a per-tensor clip "
                        "({ name = \"clip_by_norm_per_tensor\", ... })")

    if wraps_schedule_free(chain) and (mem.offload_optimizer or mem.tied_slabs):
        field, where, off = (("offload_optimizer", "kept in host memory", "false") if mem.offload_optimizer
                             else ("tied_slabs", "stepped in row slabs", "0"))
        raise SpecError(f"memory.{field}: a schedule-free optimizer is evaluated and exported at its averaged point "
                        f"x, which pgs does not compute from a state {where} yet; set memory.{field} = {off}")
    why = refusal(chain, 1)
    if why:
        where = "optimizer.chain" if opt.chain is not None else "optimizer.alias"
        for i, entry in enumerate(opt.chain or ()):
            if refusal(make_transform(entry.name, entry.args, where=f"optimizer.chain[{i}]",
                                      learning_rate=schedule), 1):
                where = f"optimizer.chain[{i}] ({entry.name})"
                break
        raise SpecError(f"memory.gradient_release: {where} cannot run inside backward: {why}; "
                        "remove it or set memory.gradient_release = false")
    if mem.tied_slabs:
        why = slab_refusal(chain)
        if why:
            where = "optimizer.chain" if opt.chain is not None else "optimizer.alias"
            raise SpecError(f"memory.tied_slabs: {where}: {why}")


#: Token objectives whose loss is not a sum of per-token terms of the token's own logits: a chunk
#: alone cannot compute its share (Cayley's mean target probability is over the micro-batch,
#: CADFT's compatibility over each sample).
WHOLE_ROW_OBJECTIVES = ("deft_cayley", "cadft")


def check_seco(spec: Spec) -> None:
    """``memory.seco_chunk`` against the rest of the spec (one line each): chunk-wise training
    (``pgs.runtime.model.seco``) trains the SFT token loss, a sum over tokens, on one process."""
    for section in ("preference", "distill"):
        if getattr(spec, section, None) is not None:
            raise SpecError(f"memory.seco_chunk: chunk-wise training runs the SFT token loss; a [{section}] run "
                            "scores whole sequences; set memory.seco_chunk = 0")
    if spec.loss.objective in WHOLE_ROW_OBJECTIVES:
        raise SpecError(f"memory.seco_chunk: loss.objective {spec.loss.objective!r} reads statistics over the whole "
                        "row or sample, which a chunk does not see; use another objective or seco_chunk = 0")
    if spec.loss.embedding_noise() is not None:
        raise SpecError("memory.seco_chunk: embedding noise (loss.neftune_alpha / symnoise_alpha) is drawn once per "
                        "forward, and chunk-wise training runs each chunk's forward twice; set it to 0 or "
                        "seco_chunk = 0")
    if spec.parallel.context > 1:
        raise SpecError(f"memory.seco_chunk: parallel.context = {spec.parallel.context} splits rows over ranks; "
                        "chunk-wise training splits them in time on one process; use one of the two")


def _stand_in_total(spec: Spec) -> int:
    total = spec.schedule.total or spec.train.steps
    if total is None:  # epochs: the length is known later; check the arguments on a stand-in
        s = spec.schedule
        total = s.warmup + s.stable + s.decay + 100
    return total


def check_spec(spec: Spec) -> None:
    """Everything that can be checked without a model or data: data (mSFT), loss, averaging, schedule,
    chain, memory."""
    spec.data.check(spec)  # the cross-section rules, each in its section's own check
    check_loss(spec.loss)
    if spec.averaging is not None:
        spec.averaging.check(spec)
    spec.eval.check(spec)
    schedule = spec.schedule.build(_stand_in_total(spec))
    chain = build_chain(spec.optimizer, schedule)
    check_memory_options(spec, chain, schedule)
