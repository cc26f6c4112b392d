"""Export a trained model as a HF folder that ``from_pretrained`` loads and generates from.

The folder holds the weights as ``save_pretrained`` writes them (tied weights once): one
``model.safetensors`` when they fit in ``max_shard_size`` (``checkpoint.max_shard_size``,
default ``"5GB"``), else ``model-00001-of-0000N.safetensors`` … with
``model.safetensors.index.json`` (``metadata.total_size`` and the ``weight_map`` from each
tensor to its file) — plus ``config.json``, ``generation_config.json`` (every end-of-turn id
kept: the model's own, the tokenizer's eos and the chat template's end-of-turn token) and the
tokenizer.  The weights are streamed from where they live through a bounded buffer
(``pgs.runtime.store.safetensors_io``), never copied whole to the host.  It is written to a
temporary folder and published with the same fsync-and-rename as a checkpoint, so ``final/``
and ``best/`` are either the old copy or the new one.
"""

from __future__ import annotations

import json
import os
import shutil

from pgs.runtime.common import parse_size
from pgs.runtime.model.composite import ATTR
from pgs.runtime.store.checkpoint import disk_full_guard, model_tensors, publish, tensor_bytes
from pgs.runtime.store.safetensors_io import write as write_safetensors

EXPORT_INFO = "pgs_export.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"
def shard(tensors: dict, max_bytes: int) -> list[dict]:
    """The tensors cut into files of at most ``max_bytes`` in their order (a tensor larger than
    that gets a file of its own), as ``save_pretrained`` cuts them."""
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(tensors: dict, folder: str, max_shard_size="5GB") -> list[str]:
    """Write ``tensors`` into ``folder`` as one file or as shards with an index; returns the files."""
    shards = shard(tensors, parse_size(max_shard_size))
    if len(shards) == 1:
        write_safetensors(os.path.join(folder, WEIGHTS), shards[0], {"format": "pt"})
        return [WEIGHTS]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, part in zip(names, shards):
        write_safetensors(os.path.join(folder, name), part, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": tensor_bytes(tensors)}, "weight_map": weight_map}
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=2, sort_keys=True)
        handle.write("\n")
    return names + [INDEX]


def saved_names(model, tensors: dict) -> dict:
    """``tensors`` under the names and in the layout ``save_pretrained`` gives them: the weight
    conversions transformers applied when it loaded the checkpoint reverted (a mixture of
    experts' fused expert tensors split back into one tensor per expert, a vision-language
    model's legacy prefixes restored), so that the export has the layout of the checkpoint it
    came from (or of the family's published checkpoints), not transformers' in-memory one.
    Splits are views: nothing is copied."""
    target = getattr(model, "pgs_model", model)  # what a gathered state dict stands for
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions: its names are the layout
        return tensors
    if not isinstance(target, PreTrainedModel):
        return tensors
    return revert_weight_conversion(target, dict(tensors))


def write_composite(composite, tensors: dict, trained_config, dtype, folder: str, max_shard_size="5GB") -> None:
    """The fine-tuned text model of a vision-language checkpoint in the checkpoint's shape
    (``pgs.runtime.model.composite``): its ``config.json`` (``text_config`` updated, ``dtype``),
    the trained tensors under the checkpoint's names, the tensors pgs did not train (the vision
    tower) read unchanged from the checkpoint's files, in the checkpoint's order."""
    from safetensors import safe_open

    renamed = {composite.names[name]: t for name, t in tensors.items()}
    untouched: dict = {}
    by_file: dict[str, list[str]] = {}
    for key in composite.untouched():
        by_file.setdefault(composite.files[key], []).append(key)
    for file, keys in by_file.items():
        with safe_open(os.path.join(composite.folder, file), framework="pt") as handle:
            untouched.update({key: handle.get_tensor(key) for key in keys})
    ordered = {key: renamed[key] if key in renamed else untouched[key]
               for key in composite.files if key in renamed or key in untouched}
    write_weights(ordered, folder, max_shard_size)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(composite.saved_config(trained_config, dtype), handle, indent=2, sort_keys=True)
        handle.write("\n")


def export_hf(model, tokenizer, out_dir: str, *, info: dict | None = None, max_shard_size="5GB") -> str:
    """Write ``model`` (+ ``tokenizer``) to ``out_dir`` in HF format; returns ``out_dir``.

    ``info`` (step, metric, ...) is recorded in ``pgs_export.json`` next to the weights;
    ``max_shard_size``: the largest weights file (``parse_size``).
    """
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors, _aliases = model_tensors(model)
    # a full disk is one line (exit 84), the temporary removed and the published folder kept
    with disk_full_guard(tmp, out_dir, tensor_bytes(tensors), "export", "weights"):
        # Weights under the names transformers expects; tied copies are re-tied by the config.
        dtype = next(iter(tensors.values())).dtype if tensors else None
        composite = getattr(model, ATTR, None)
        if composite is not None:  # a vision-language checkpoint's text model: the checkpoint's shape
            write_composite(composite, tensors, model.config, dtype, tmp, max_shard_size)
        else:
            write_weights(saved_names(model, tensors), tmp, max_shard_size)
            config = model.config
            if dtype is not None:
                config.dtype = dtype
            config.save_pretrained(tmp)
        generation = _generation_config(model, tokenizer)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, EXPORT_INFO), "w", encoding="utf-8") as handle:
            json.dump(info or {}, handle, indent=2, sort_keys=True)
            handle.write("\n")
        publish(tmp, out_dir)
    return out_dir


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply, in order, each once: the model's own ``eos_token_id`` (an int
    or a list), the tokenizer's eos, and the chat template's end-of-turn marker when it is one
    token (``<|im_end|>``, ``<|eot_id|>``)."""
    found: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v not in found:
                found.append(v)

    generation = getattr(model, "generation_config", None)
    if generation is not None:
        add(getattr(generation, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
        if getattr(tokenizer, "chat_template", None):
            from pgs.runtime.data.chat import TemplateProblem, turn_markers

            try:
                _header, end = turn_markers(tokenizer)
            except TemplateProblem:
                end = ""
            ids = tokenizer.encode(end.strip(), add_special_tokens=False) if end.strip() else []
            if len(ids) == 1:
                add(ids[0])
    return found


def _generation_config(model, tokenizer):
    from transformers import GenerationConfig

    generation = getattr(model, "generation_config", None)
    generation = GenerationConfig.from_dict(generation.to_dict()) if generation is not None else GenerationConfig()
    eos = end_of_turn_ids(model, tokenizer)
    if eos:
        generation.eos_token_id = eos if len(eos) > 1 else eos[0]
    if tokenizer is not None:
        if getattr(tokenizer, "pad_token_id", None) is not None:
            generation.pad_token_id = tokenizer.pad_token_id
        if getattr(tokenizer, "bos_token_id", None) is not None:
            generation.bos_token_id = tokenizer.bos_token_id
    return generation
