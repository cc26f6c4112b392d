"""Export a trained model as a HF folder that ``from_pretrained`` loads and generates from.

The folder holds ``model.safetensors`` (tied weights once, as transformers writes them),
``config.json``, ``generation_config.json`` (eos/pad from the tokenizer) and the tokenizer.
It is written to a temporary folder and published with the same fsync-and-rename as a
checkpoint, so ``final/`` and ``best/`` are either the old copy or the new one.
"""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import save_file

from pgs.runtime.store.checkpoint import disk_full_guard, model_tensors, publish, tensor_bytes

EXPORT_INFO = "pgs_export.json"


def export_hf(model, tokenizer, out_dir: str, *, info: dict | None = None) -> str:
    """Write ``model`` (+ ``tokenizer``) to ``out_dir`` in HF format; returns ``out_dir``.

    ``info`` (step, metric, ...) is recorded in ``pgs_export.json`` next to the weights.
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
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        dtype = next(iter(tensors.values())).dtype if tensors else None
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


def _generation_config(model, tokenizer):
    from transformers import GenerationConfig

    generation = getattr(model, "generation_config", None)
    generation = GenerationConfig.from_dict(generation.to_dict()) if generation is not None else GenerationConfig()
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            generation.eos_token_id = tokenizer.eos_token_id
        if getattr(tokenizer, "pad_token_id", None) is not None:
            generation.pad_token_id = tokenizer.pad_token_id
        if getattr(tokenizer, "bos_token_id", None) is not None:
            generation.bos_token_id = tokenizer.bos_token_id
    return generation
