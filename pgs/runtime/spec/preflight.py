"""The checks of a spec against its tokenizer, model configuration and run folder, shared by
``pgs validate`` and ``pgs run`` (docs/cli.md).

:func:`preflight_spec` is what both commands run before anything is built: the tokenizer
loads, the model configuration builds (an unknown ``model_type`` is one short line with a
suggestion, for ``model.config`` and a local folder's ``config.json`` alike), the vocabulary
covers the tokenizer, the attention heads are consistent, ``data.max_seq_len`` fits the
model's positions, ``checkpoint.dir`` can be a folder, ``freeze`` patterns match parameters
(counted on the meta device: no memory), the optimizer chain takes two finite steps on a
tiny parameter tree, and the host has the memory and disk ``pgs profile`` predicts the run
needs (``pgs.runtime.tools.resources``: a refusal is exit 83).  No weights are initialised and
no training data is read.

:func:`check_resources` is ``pgs validate``'s whole check: the preflight plus the first
records of every data file through the real reader, chat template and length policy.

Every problem is a ``SpecError`` (or ``DataError``) whose one line names the field or file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import attrs

import pgs.func as pf
from pgs.errors import DataError, PgsError, SpecError
from pgs.runtime.data import DataStats, encode_document, read_conversations
from pgs.runtime.data.inspect import dataset_stats
from pgs.runtime.data.isolation import ATTENTION_LAYER_TYPES, LEAKING_MODEL_TYPES, require_packing_isolation
from pgs.runtime.data.kto import label_counts, read_kto_records
from pgs.runtime.data.preference import pack_rows, read_pairs
from pgs.runtime.data.readers import has_records
from pgs.runtime.data.templates import apply_chat_template
from pgs.runtime.model.attention import hf_implementation
from pgs.runtime.model.loading import (TOKENIZER_FILES, config_from_folder, config_from_table, first_line,  # noqa: F401
                                      known_model_types, load_tokenizer, quiet_transformers)
from pgs.runtime.model.moe import experts_implementation
from pgs.runtime.spec.weights import check_weights

#: ``data.max_seq_len`` allowed when the model's configuration names no
#: ``max_position_embeddings`` (2**20 tokens; beyond it a batch alone outgrows a host).
MAX_SEQ_LEN_UNBOUNDED = 1 << 20

@attrs.define
class Preflight:
    """What the preflight resolved: the tokenizer, the HF config, and (when they were counted)
    the parameters' names and shapes on the meta device."""

    tokenizer: Any
    config: Any
    shapes: dict[str, tuple[int, ...]] | None = None
    chain: str = ""
    warnings: list[str] = attrs.field(factory=list)
    distill: str | None = None  # the teacher, described (a distillation run)
    prediction: Any = None  # tools.resources.Prediction: one process's predicted peak (None: not sized)
    tokenizer_note: str | None = None  # a tokenizer that does not fit the model, allowed by the spec


def model_config(model, vocab_size: int | None = None):
    """The HF config of the spec's ``[model]`` (``vocab_size = 0`` takes ``vocab_size``),
    with ``attn_implementation = "auto"`` resolved."""
    if model.path is not None:
        config = config_from_folder(model.path, model.trust_remote_code)
    else:
        table = dict(model.config)
        if not table.get("vocab_size") and vocab_size:
            table["vocab_size"] = vocab_size
        config = config_from_table(table)

    config._attn_implementation = hf_implementation(model.attn_implementation, config)
    return config


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _config_field(model, name: str) -> str:
    """How a message names a configuration field: ``model.config.X`` or ``<folder>/config.json: X``."""
    if model.path is not None:
        return f"model.path: {os.path.join(model.path, 'config.json')}: {name}"
    return f"model.config.{name}"


def check_architecture(model, config) -> None:
    """Attention heads that the attention kernels can run: a whole number of query heads per
    key/value head, a positive head dimension, a hidden size that splits into the heads when
    the config derives the head dimension from it."""
    c = _text_config(config)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None)
    if isinstance(heads, int) and heads < 1:
        raise SpecError(f"{_config_field(model, 'num_attention_heads')}: expected an integer >= 1, got {heads}")
    if isinstance(heads, int) and isinstance(kv, int):
        if kv < 1 or heads % kv:
            raise SpecError(f"{_config_field(model, 'num_key_value_heads')}: {kv} does not divide "
                            f"num_attention_heads = {heads} (each key/value head serves a whole number of "
                            f"query heads); use a divisor of {heads}")
    head_dim = getattr(c, "head_dim", None)
    hidden = getattr(c, "hidden_size", None)
    if isinstance(head_dim, int) and head_dim < 1:
        raise SpecError(f"{_config_field(model, 'head_dim')}: expected an integer >= 1, got {head_dim}")
    derived = head_dim is None or (model.config is not None and "head_dim" not in model.config)
    if derived and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads:
        raise SpecError(f"{_config_field(model, 'hidden_size')}: {hidden} does not split into "
                        f"num_attention_heads = {heads} heads; use a multiple of {heads} or give head_dim")


def check_layers(spec, config) -> None:
    """What the model's layer types allow.  ``model.freeze = "non_attention"`` freezes the layers
    that are not attention, so a model without any would train unchanged: refused.
    ``parallel.context > 1`` splits each row over ranks and passes only attention's keys and
    values between them; a linear-attention or recurrent layer would need its state passed from
    rank to rank along the row, which pgs does not do: refused rather than silently different."""
    c = _text_config(config)
    model_type = str(getattr(c, "model_type", "") or getattr(config, "model_type", "") or "")
    other = sorted({str(t) for t in (getattr(c, "layer_types", None) or [])} - ATTENTION_LAYER_TYPES)
    if spec.model.freeze == "non_attention" and not other:
        raise SpecError(f"model.freeze: \"non_attention\" would freeze nothing: the layer_types of {model_type!r} "
                        "are all attention (no linear-attention or recurrent layers); use \"none\" or a list of "
                        "patterns")
    cp = spec.parallel.context
    recurrent = other or ([model_type] if any(model_type.startswith(t) for t in LEAKING_MODEL_TYPES) else [])
    if cp > 1 and recurrent:
        raise SpecError(f"parallel.context = {cp}: {model_type!r} has {', '.join(recurrent)} layers, whose recurrent "
                        "state would have to pass from rank to rank along each row, and pgs does not pass it "
                        "(set parallel.context = 1)")


def position_limit(config) -> tuple[int | None, str]:
    """The longest sequence the model's positions cover, and where that number comes from:
    ``max_position_embeddings`` (times a RoPE scaling ``factor`` > 1 when the config has one)."""
    c = _text_config(config)
    limit = getattr(c, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        return None, ""
    rope = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None)
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        return int(limit * factor), f"max_position_embeddings = {limit} x rope factor {factor:g}"
    return limit, f"max_position_embeddings = {limit}"


def check_seq_len(spec, config) -> None:
    """``data.max_seq_len`` within the model's positions (or within ``MAX_SEQ_LEN_UNBOUNDED``
    when the config names none)."""
    length = spec.data.max_seq_len
    limit, source = position_limit(config)
    if limit is not None:
        if length > limit:
            where = "model.path's config.json" if spec.model.path is not None else "model.config"
            raise SpecError(f"data.max_seq_len: {length} is longer than the model's {source} ({where}); "
                            f"set data.max_seq_len <= {limit}")
    elif length > MAX_SEQ_LEN_UNBOUNDED:
        raise SpecError(f"data.max_seq_len: {length} tokens per sequence; the model's configuration names no "
                        f"max_position_embeddings and pgs refuses more than {MAX_SEQ_LEN_UNBOUNDED}")


def check_run_dir(path: str) -> None:
    """``checkpoint.dir`` is a folder or can become one: neither it nor a folder above it is a file."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise SpecError(f"checkpoint.dir: {path} is a file, expected a folder (the run folder)")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise SpecError(f"checkpoint.dir: {path} cannot be created: {parent} is a file, not a folder")


# --------------------------------------------------------------------------- parameters, chain


def parameter_shapes(config, trust_remote_code: bool) -> dict[str, tuple[int, ...]] | None:
    """Parameter names and shapes of the architecture, built on the meta device (no memory);
    None for an architecture that cannot build there."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # an architecture that cannot build on meta: the run will say more
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_composite(model, config) -> None:
    """A vision-language checkpoint whose text model pgs trains (``model.path``): every trained
    tensor must have its place among the checkpoint's weights, so that the export keeps the
    checkpoint's shape (``pgs.runtime.model.composite``); refused here, before any weights load."""
    import torch
    from transformers import AutoModelForCausalLM

    from pgs.runtime.model import composite

    if model.path is None or getattr(config, "text_config", None) is None:
        return
    raw_type = getattr(config, "model_type", None)
    try:
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    except Exception:  # an architecture that cannot build on meta: build_model checks it with the weights
        return
    built_type = str(getattr(built.config, "model_type", ""))
    if built_type != raw_type and composite.is_composite(model.path, built_type):
        composite.describe(model.path, composite.stored_shapes(built))


def check_freeze(freeze, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The frozen parameter names of ``model.freeze`` patterns; each pattern must match one,
    and something must stay trainable."""
    frozen: list[str] = []
    if not isinstance(freeze, tuple):
        return frozen
    for i, pattern in enumerate(freeze):
        if not any(re.search(pattern, name) for name in shapes):
            raise SpecError(f"model.freeze[{i}]: {pattern!r} matches no parameter of the model")
    frozen = [n for n in shapes if any(re.search(p, n) for p in freeze)]
    if len(frozen) == len(shapes):
        raise SpecError("model.freeze: these patterns freeze every parameter; nothing would train")
    return frozen


def _dummy_params():
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g),
    }


def check_chain(spec) -> str:
    """Build the chain and take two steps on a tiny parameter tree; returns its description."""
    import torch

    total = spec.train.steps or 100
    chain = spec.build_chain(total_steps=total)
    params = _dummy_params()
    g = torch.Generator().manual_seed(1)  # the run's own random state stays untouched
    opt = pf.compile(chain, jit=False) if spec.optimizer.compile else chain
    try:
        state = opt.init(params)
        for _ in range(2):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            updates, state = opt.update(grads, state, params)
            params = pf.apply_updates(params, updates)
    except PgsError as err:
        raise SpecError(f"optimizer: the chain fails on a test parameter tree ({err})") from None
    bad = [k for k, v in params.items() if not torch.isfinite(v).all()]
    if bad:
        raise SpecError(f"optimizer: the chain produced non-finite values on a test parameter tree ({bad[0]})")
    o = spec.optimizer
    if o.chain is not None:
        text = " → ".join(e.name for e in o.chain)
    else:
        args = ", ".join(f"{k}={v}" for k, v in o.args.items())
        text = (f"clip_by_global_norm({o.clip:g}) → " if o.clip > 0 else "") + f"{o.alias}({args})"
    return text + (" (compiled)" if o.compile else "")


# --------------------------------------------------------------------------- the tokenizer


def _show_path(path: str) -> str:
    """A path as the spec names it: a bundled asset as ``pgs:...``."""
    from pgs.runtime.spec.sections import ASSET_PREFIX, ASSETS_DIR

    try:
        rel = os.path.relpath(path, ASSETS_DIR)
    except ValueError:
        return path
    return path if rel.startswith("..") else ASSET_PREFIX + rel


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_tokenizer_fit(spec, tokenizer) -> str | None:
    """The tokenizer a spec names against the model folder it trains (``model.path``).

    A tokenizer that is the folder's own (``model.tokenizer`` left out, ``"model"``, or the same
    folder) fits.  Another one must equal the folder's own tokenizer, when the folder ships one
    (vocabulary, special tokens and chat rendering: ``compat.tokenizer_mismatch``), or give the
    special-token ids the folder's ``config.json`` and ``generation_config.json`` name
    (``compat.config_special_mismatch``).  A misfit is one ``SpecError`` line naming
    ``model.tokenizer``, unless ``model.allow_tokenizer_mismatch`` is true: then it is returned
    as a warning.  A model built from ``model.config`` takes the tokenizer's vocabulary: nothing
    to compare."""
    from pgs.runtime.model.compat import config_special_mismatch, tokenizer_mismatch

    m = spec.model
    if m.path is None or m.tokenizer is None or _same_folder(m.tokenizer, m.path):
        return None
    named, folder = _show_path(m.tokenizer), m.path
    if any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        own = load_tokenizer(folder, m.trust_remote_code, field="model.path")
        why = tokenizer_mismatch(own, tokenizer, _sample_records(spec), names=("model's", "spec's"))
        if why is None:
            return None
        text = f"model.tokenizer: {named} is not the tokenizer of model.path {folder} ({why})"
        fix = ("remove model.tokenizer (or set it to \"model\") to train with the model's own tokenizer, "
               "or set model.allow_tokenizer_mismatch = true to keep this one")
    else:
        generation_eos = None
        try:
            with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as handle:
                generation_eos = json.load(handle).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            pass
        why = config_special_mismatch(tokenizer, config_from_folder(folder, m.trust_remote_code), generation_eos)
        if why is None:
            return None
        text = f"model.tokenizer: {named} does not fit model.path {folder} ({why})"
        fix = "name the model's own tokenizer, or set model.allow_tokenizer_mismatch = true to keep this one"
    if not m.allow_tokenizer_mismatch:
        raise SpecError(f"{text}; {fix}")
    return f"{text}; trained with it as model.allow_tokenizer_mismatch = true says"


# --------------------------------------------------------------------------- the two doors


def preflight_spec(spec, *, count_parameters: bool = False, processes: int | None = None) -> Preflight:
    """The checks ``pgs run`` makes before it builds anything, and ``pgs validate`` before it
    reads data: tokenizer, model configuration, heads, lengths, run folder, freeze patterns,
    chain.  Cheap: no weights, no data.  ``count_parameters``: build the parameter shapes on the
    meta device even without ``freeze`` patterns (validate's summary counts them).
    ``processes``: how many processes will train (``tools.resources.check_host``; None: not
    known, as in ``pgs validate``)."""
    m = spec.model
    tokenizer = load_tokenizer(m.tokenizer or m.path, m.trust_remote_code)
    config = model_config(m, len(tokenizer))
    vocab = getattr(_text_config(config), "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        field = "model.config.vocab_size" if m.config is not None else "model.path"
        raise SpecError(f"{field}: the model has {vocab} embeddings but the tokenizer has {len(tokenizer)} tokens")
    tokenizer_note = check_tokenizer_fit(spec, tokenizer)  # before data.chat_template replaces the template
    tokenizer = apply_chat_template(tokenizer, spec.data.chat_template)
    check_architecture(m, config)
    check_layers(spec, config)
    check_composite(m, config)
    experts_implementation(m.experts_implementation, config)  # a known implementation, a model with experts
    check_seq_len(spec, config)
    check_run_dir(spec.checkpoint.dir)
    if spec.memory.device_limit_gib and spec.train.device == "cpu":  # it would do nothing: refused, not ignored
        raise SpecError(f"memory.device_limit_gib: {spec.memory.device_limit_gib:g} caps CUDA's caching allocator, "
                        "and train.device is \"cpu\" (set it to 0)")
    found = Preflight(tokenizer=tokenizer, config=config, tokenizer_note=tokenizer_note)
    if tokenizer_note is not None:
        found.warnings.append(tokenizer_note)
    if count_parameters or isinstance(m.freeze, tuple):
        found.shapes = parameter_shapes(config, m.trust_remote_code)
        if found.shapes is None:
            found.warnings.append("the architecture could not be built on the meta device; parameters not counted")
        else:
            check_freeze(m.freeze, found.shapes)
    found.chain = check_chain(spec)
    from pgs.runtime.loop.trackers import check_trackers  # a tracker that is on must be installed

    check_trackers(spec.log)
    if spec.preference is not None:
        check_preference(spec, tokenizer)
    if spec.distill is not None:
        found.distill = check_distill(spec, tokenizer, config)
    from pgs.runtime.tools.resources import check_host  # the memory and disk the run will need (exit 83)

    found.prediction = check_host(spec, processes)
    if found.prediction is None:
        found.warnings.append("the run's memory could not be predicted (the architecture does not build on the "
                              "meta device); memory and disk not checked")
    return found


def check_preference(spec, tokenizer) -> None:
    """``[preference]`` against the rest of the spec: one source set read whole (no mix weights),
    a reference folder whose vocabulary fits the tokenizer, ``checkpoint.best_metric`` an
    eval metric a preference run reports."""
    pref = spec.preference
    for i, source in enumerate(spec.data.sources):
        if source.weight != 1.0:
            raise SpecError(f"data.sources[{i}].weight: a preference run reads every pair of every source once "
                            f"an epoch; mix weights are not supported (got {source.weight:g})")
    if pref.reference_path is not None:
        if not os.path.isfile(os.path.join(pref.reference_path, "config.json")):
            raise SpecError(f"preference.reference_path: {pref.reference_path} has no config.json "
                            "(a local Hugging Face model folder)")
        config = config_from_folder(pref.reference_path, spec.model.trust_remote_code)
        vocab = getattr(_text_config(config), "vocab_size", None)
        if isinstance(vocab, int) and vocab < len(tokenizer):
            raise SpecError(f"preference.reference_path: the reference has {vocab} embeddings but the tokenizer "
                            f"has {len(tokenizer)} tokens")
    metric = spec.checkpoint.best_metric
    known = KTO_EVAL_METRICS if pref.kind == "kto" else PREFERENCE_EVAL_METRICS
    if metric and metric.startswith("eval_") and metric not in known:
        raise SpecError(f"checkpoint.best_metric: {metric!r} is not reported by a {pref.kind} run; one of "
                        f"{', '.join(known)} (or \"\")")
    if metric and not spec.data.eval:
        raise SpecError(f"checkpoint.best_metric: {metric!r} needs data.eval (held-out pairs)")


def teacher_config(spec, tokenizer):
    """The teacher's HF config: its folder's ``config.json`` or ``distill.teacher_config`` (whose
    vocabulary defaults to the tokenizer's size, as ``model.config``'s does).  Errors name the
    ``[distill]`` field."""
    d = spec.distill
    try:
        if d.teacher_path is not None:
            return config_from_folder(d.teacher_path, spec.model.trust_remote_code)
        table = dict(d.teacher_config)
        table.setdefault("vocab_size", len(tokenizer))
        return config_from_table(table)
    except SpecError as err:
        text = (str(err).replace("model.path", "distill.teacher_path", 1)
                .replace("model.config", "distill.teacher_config", 1))
        raise SpecError(text) from None


def _sample_records(spec, n: int = 4) -> list[dict]:
    """The first ``n`` records of the first source, as ``{"messages", "tools"}`` (rendered by both
    tokenizers); a record the reader refuses is left to the data checks that report it."""
    out = []
    try:
        for conversation in read_conversations(spec.data.sources[0].path, "auto", "skip"):
            out.append({"messages": conversation.messages, "tools": conversation.tools})
            if len(out) >= n:
                break
    except (PgsError, OSError):
        return out
    return out


def check_distill(spec, tokenizer, config) -> str:
    """``[distill]`` against the student: the teacher's configuration builds, its vocabulary is the
    student's (the loss compares the two heads id by id), and the teacher's tokenizer (a folder
    teacher's own) has the student's vocabulary, special tokens and chat rendering
    (``pgs.runtime.model.compat.tokenizer_mismatch``, on sample conversations and the data's first
    records).  Returns a one-line description of the teacher."""
    from pgs.runtime.model.compat import tokenizer_mismatch

    d = spec.distill
    field = "distill.teacher_path" if d.teacher_path is not None else "distill.teacher_config"
    t_config = teacher_config(spec, tokenizer)
    t_vocab = getattr(_text_config(t_config), "vocab_size", None)
    s_vocab = getattr(_text_config(config), "vocab_size", None)
    if t_vocab != s_vocab:
        raise SpecError(f"{field}: the teacher's head has {t_vocab} rows but the student's has {s_vocab} "
                        "(distillation compares the two distributions over one shared vocabulary)")
    if d.teacher_path is not None:
        teacher_tok = load_tokenizer(d.teacher_path, spec.model.trust_remote_code, field="distill.teacher_path")
        mismatch = tokenizer_mismatch(tokenizer, teacher_tok, _sample_records(spec))
        if mismatch is not None:
            raise SpecError(f"distill.teacher_path: the teacher's tokenizer differs from the student's: {mismatch}")
    teacher = d.teacher_path or f"random init ({t_config.model_type})"
    beta = f", beta {d.jsd_beta:g}" if d.kind == "jsd" else ""
    g = d.generation_settings()
    return (f"teacher {teacher} ({d.teacher_dtype}); {d.kind}{beta}, T {d.temperature:g}; on-policy {d.on_policy:g}, "
            f"sampling max_new_tokens {g['max_new_tokens']}, temperature {g['temperature']:g}, top_p {g['top_p']:g}")


#: The eval metrics of a preference run (``loop.preference.PreferenceObjective.evaluate``).
PREFERENCE_EVAL_METRICS = ("eval_preference_accuracy", "eval_preference_loss", "eval_reward_margin",
                           "eval_logp_chosen")
#: The eval metrics of a KTO run (``loop.kto.KTOObjective.evaluate_pairs``).
KTO_EVAL_METRICS = ("eval_preference_accuracy", "eval_preference_loss", "eval_reward_margin", "eval_reward_desirable",
                    "eval_logp_desirable", "eval_kl")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _check_eval(spec, tokenizer, records: int) -> int:
    stats = DataStats()
    count = 0
    for count, conversation in enumerate(read_conversations(spec.data.eval, "auto", "error"), start=1):
        encode_document(conversation, tokenizer, spec.data, stats)
        if records and count >= records:
            break
    if count == 0:
        raise SpecError(f"data.eval: {spec.data.eval} has no records")
    return count


def check_resources(spec, records: int = 200, processes: int | None = None) -> dict:
    """What ``pgs validate`` checks beyond the spec itself; returns facts for its summary.

    :func:`preflight_spec` (the same checks ``pgs run`` makes), then packing isolation and the
    first ``records`` records of every data file through the data pipeline.  Problems raise
    ``SpecError`` or ``DataError``; ``facts["warnings"]`` holds what is worth saying but not fatal.
    ``processes``: ``pgs validate --nproc N`` (None: not given): what ``pgs run --nproc N`` refuses
    before it launches is refused here too, and the memory figures are one process's share.
    """

    if processes is not None and processes > 1:
        from pgs.runtime.optim.memory import single_process_refusal
        from pgs.runtime.spec.load import check_world_size

        check_world_size(spec.train, processes, spec.parallel.context)
        why = single_process_refusal(spec.memory)
        if why:
            raise SpecError(why)
    found = preflight_spec(spec, count_parameters=True, processes=processes)
    tokenizer, config = found.tokenizer, found.config
    facts: dict = {"warnings": list(found.warnings)}
    facts["tokenizer"] = f"{len(tokenizer)} tokens"
    facts["model"] = f"{config.model_type}, vocab {getattr(_text_config(config), 'vocab_size', None)}"
    if found.shapes is not None:
        shapes = found.shapes
        facts["parameters"] = f"{sum(_numel(s) for s in shapes.values()) / 1e6:,.2f} M"
        if isinstance(spec.model.freeze, tuple):
            frozen = check_freeze(spec.model.freeze, shapes)
            facts["frozen"] = f"{sum(_numel(shapes[n]) for n in frozen) / 1e6:,.2f} M in {len(frozen)} tensors"
    if spec.model.path is not None:  # the weights' headers: missing, cut short, another shape or model
        tied = bool(getattr(_text_config(config), "tie_word_embeddings", False)
                    or getattr(config, "tie_word_embeddings", False))
        facts["weights"] = check_weights(spec.model.path, found.shapes, tied)
    if spec.data.packing:
        verdict = require_packing_isolation(config, spec.data.allow_packing_leakage)
        if not verdict.isolates:
            facts["warnings"].append(f"packing leaks across documents: {verdict.reason}")
    facts["chain"] = found.chain
    if found.prediction is not None:
        limit = spec.memory.device_limit_gib
        memory = found.prediction.memory
        ranks = memory.get("ranks", 1)
        host = memory.get("host_state")
        facts["memory"] = (f"predicted peak {found.prediction.peak / 2**30:.2f} GiB per process (pgs profile; "
                           "a lower bound)" + (f", allocator capped at {limit:g} GiB (memory.device_limit_gib)"
                                               if limit else "")
                           + (f"; optimizer state in host memory {host / 2**30:.2f} GiB per process"
                              + (f" (its shards, one of {ranks})" if ranks > 1 else "") if host is not None else ""))
    if found.distill is not None:
        facts["distill"] = found.distill
    if spec.preference is not None:
        return _preference_facts(spec, tokenizer, records, facts)
    for i, source in enumerate(spec.data.sources):
        if not has_records(source.path):
            raise DataError(f"{source.path}: no records (data.sources[{i}] is empty)")
    stats = dataset_stats(spec.data, tokenizer, max_records=records or None)
    if stats.samples == 0:
        raise SpecError("data.sources: no record of the data checked keeps a trained token within "
                        f"max_seq_len = {spec.data.max_seq_len} (see pgs data inspect)")
    facts["data"] = stats
    if stats.dropped:
        facts["warnings"].append(
            f"{stats.dropped} of the {stats.records} records checked would be dropped "
            f"({stats.dropped_too_long} too long, {stats.dropped_no_trained} without a trained token)"
        )
    if spec.data.eval is not None:
        facts["eval"] = f"{_check_eval(spec, tokenizer, records)} records checked"
    return facts


def _preference_facts(spec, tokenizer, records: int, facts: dict) -> dict:
    """``pgs validate`` of a preference run's data: the first ``records`` pairs of each file
    through the pair pipeline (a bad pair raises its one-line ``DataError``)."""
    limit = records or None
    stats = DataStats()
    skipped: list[str] = []
    kto = spec.preference.kind == "kto"
    read = read_kto_records if kto else read_pairs
    pairs = read([s.path for s in spec.data.sources], tokenizer, spec.data, stats, skipped, max_records=limit)
    if not pairs:
        raise SpecError(f"data.sources: no usable preference pair in the {stats.bad_records} records checked")
    rows = pack_rows(pairs, spec.data.max_seq_len)
    stats.sequences, stats.sequence_capacity = len(rows), len(rows) * spec.data.max_seq_len
    facts["data"] = stats
    unit = "records" if kto else "pairs"
    facts["pairs"] = f"{len(pairs)} {unit} checked, {stats.trained_tokens} completion tokens" + (
        f", {len(skipped)} bad {unit} skipped (first: {skipped[0]})" if skipped else "")
    if kto:
        from pgs.runtime.loop.kto import ratio_warning

        good, bad = label_counts(pairs)
        facts["pairs"] += f" ({good} desirable, {bad} undesirable; each with its KL sample)"
        warning = ratio_warning(spec.preference, good, bad)
        if warning:
            facts["warnings"].append(warning)
    pref = spec.preference
    facts["preference"] = (f"{pref.kind}, beta {pref.beta:g}, reference "
                           + ("none" if not pref.uses_reference else
                              f"{pref.reference} ({pref.reference_path or 'the initial policy'})"))
    if spec.data.eval is not None:
        held = read([spec.data.eval], tokenizer, spec.data, max_records=limit)
        facts["eval"] = f"{len(held)} held-out {unit} checked"
    return facts
