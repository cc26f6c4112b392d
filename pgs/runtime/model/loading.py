"""A model's configuration and tokenizer from a spec, with one-line errors: a ``model.config``
table or a local folder's ``config.json`` to a ``transformers`` config, and a tokenizer folder to
a tokenizer.  Used by ``build.py`` to build the model and by the spec's preflight to check it."""

from __future__ import annotations

import json
import os
from typing import Any

from pgs.errors import SpecError
from pgs.runtime import process
from pgs.runtime.common import suggest

#: Files of a tokenizer folder (at least one must be there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "merges.txt", "tokenizer.tiktoken")


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (of its cause, for transformers' config
    validation errors whose own first line says only which validator failed), cut to ``limit``."""
    text = str(err).strip()
    if err.__cause__ is not None and text.startswith("Class validation error"):
        text = str(err.__cause__).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def quiet_transformers() -> None:
    process.set_default("TRANSFORMERS_VERBOSITY", "error")
    process.set_default("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_tokenizer(path: str | None, trust_remote_code: bool = False, field: str = "model.tokenizer"):
    """The tokenizer of the local folder ``path``; one ``SpecError`` line when it will not load."""
    quiet_transformers()
    if not path or not os.path.isdir(path):
        raise SpecError(f"{field}: {path!r} is not a tokenizer folder")
    if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise SpecError(f"{field}: {path} holds no tokenizer (none of tokenizer.json, tokenizer_config.json, "
                        "tokenizer.model, vocab.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # a folder that transformers cannot read: the user's file, not a bug
        raise SpecError(f"{field}: cannot load a tokenizer from {path} ({first_line(err)})") from None


def known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return list(CONFIG_MAPPING.keys())


def _unknown_model_type(field: str, model_type) -> SpecError:
    import transformers

    hint = suggest(str(model_type), known_model_types())
    return SpecError(f"{field}: unknown architecture {model_type!r}"
                     f"{hint or f' (not a model type of transformers {transformers.__version__})'}")


def config_from_table(table: dict[str, Any]):
    """A ``transformers`` config from a ``model.config`` table (``model_type`` + fields)."""
    from transformers import AutoConfig

    table = dict(table)
    model_type = table.pop("model_type", None)
    if not model_type:
        raise SpecError("model.config.model_type: needed (a string such as \"qwen3\") to pick the architecture")
    if str(model_type) not in known_model_types():
        raise _unknown_model_type("model.config.model_type", model_type)
    try:
        return AutoConfig.for_model(str(model_type), **table)
    except Exception as err:  # transformers' own validation of the fields the user gave
        raise SpecError(f"model.config: not a usable {model_type} configuration ({first_line(err)})") from None


def config_from_folder(path: str, trust_remote_code: bool = False):
    """The ``transformers`` config of a local model folder (its ``config.json``)."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as handle:
            raw = json.load(handle)
    except OSError as err:
        raise SpecError(f"model.path: cannot read {file} ({err.strerror or err})") from None
    except ValueError as err:
        raise SpecError(f"model.path: {file} is not JSON ({first_line(err)})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"model.path: {file} is not a JSON object")
    model_type = raw.get("model_type")
    remote = trust_remote_code and "auto_map" in raw
    if not remote and model_type is not None and str(model_type) not in known_model_types():
        raise _unknown_model_type(f"model.path: {file}: model_type", model_type)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise SpecError(f"model.path: {file} is not a usable model configuration ({first_line(err)})") from None
