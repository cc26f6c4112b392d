"""A vision-language checkpoint fine-tuned on text keeps its shape.

transformers loads the causal LM of some vision-language checkpoints on its own: a Qwen3.5 or
Qwen3.5-MoE folder (``model_type: qwen3_5``, ``Qwen3_5ForConditionalGeneration``, the text
model under ``model.language_model``, a vision tower under ``model.visual``) becomes a
``Qwen3_5ForCausalLM`` of its ``text_config``, without the vision tower.  Saved as it is, the
fine-tune would be a ``qwen3_5_text`` folder that the original's class cannot load, its vision
tower gone.

pgs keeps the checkpoint's shape instead.  When a ``model.path`` folder's ``config.json`` names
another ``model_type`` than the model transformers builds from it, and holds a ``text_config``,
:func:`describe` maps each trained tensor's name to the name the checkpoint's files give it (the
text model's prefix, e.g. ``model.language_model.``, found from the files' own names and
checked for every tensor, shapes included).  The export (``pgs.runtime.store.export``) then
writes the original ``config.json`` (its ``text_config`` updated from the trained model's, the
dtype set), the trained tensors under the checkpoint's names, and every other tensor of the
checkpoint (the vision tower, a multi-token-prediction head) copied unchanged from its files:
the folder loads with the same class as the original.  A checkpoint whose text tensors cannot
be mapped so is refused at validate (``SpecError``), naming the first tensor that has no place.
"""

from __future__ import annotations

import json
import os

import attrs

from pgs.errors import SpecError

#: The attribute of a model built from a composite checkpoint (``build_model`` sets it).
ATTR = "pgs_composite"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"


@attrs.frozen
class Composite:
    """Where a text model came from: the checkpoint ``folder``, its ``config.json`` as written
    (``config``), each trained tensor's name in the checkpoint (``names``) and the file of
    each of the checkpoint's tensors (``files``)."""

    folder: str
    config: dict
    names: dict
    files: dict

    def untouched(self) -> list[str]:
        """The checkpoint's tensors pgs does not train (vision tower, ...), in file order."""
        trained = set(self.names.values())
        return [key for key in self.files if key not in trained]

    def saved_config(self, trained_config, dtype=None) -> dict:
        """The checkpoint's ``config.json`` with its ``text_config`` fields updated from the
        trained model's configuration, and ``dtype`` (a torch dtype) where given."""
        config = json.loads(json.dumps(self.config))
        text = config["text_config"]
        for key, value in trained_config.to_dict().items():
            if key in text and key not in ("architectures", "model_type", "transformers_version"):
                text[key] = value
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            config["dtype"] = name
            text["dtype"] = name
            config.pop("torch_dtype", None)
            text.pop("torch_dtype", None)
        return config


def _raw_config(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def is_composite(folder: str, built_model_type: str) -> bool:
    """Whether ``folder``'s ``config.json`` is a composite (``text_config``) of another model
    type than the one transformers built from it."""
    raw = _raw_config(folder)
    return (raw is not None and isinstance(raw.get("text_config"), dict)
            and raw.get("model_type") != built_model_type)


def checkpoint_files(folder: str) -> dict[str, str]:
    """Each tensor of ``folder``'s safetensors weights -> its file (the index's ``weight_map``,
    or the one ``model.safetensors``'s header)."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as handle:
            return dict(json.load(handle)["weight_map"])
    single = os.path.join(folder, WEIGHTS)
    if not os.path.exists(single):
        raise SpecError(f"model.path: {folder} is a vision-language checkpoint without safetensors weights "
                        f"({WEIGHTS} or {INDEX}); pgs can only keep the shape of safetensors checkpoints")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), WEIGHTS)


def checkpoint_shapes(folder: str, files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _prefix(name: str, keys) -> list[str]:
    """The prefixes ``p`` with ``p + name`` among ``keys`` (``p`` empty or ending in ``.``)."""
    return [k[: len(k) - len(name)] for k in keys
            if k.endswith(name) and (len(k) == len(name) or k[len(k) - len(name) - 1] == ".")]


def map_names(shapes: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], folder: str) -> dict[str, str]:
    """Each trained tensor name (``shapes``: name -> shape) -> its name among the checkpoint's
    tensors (``stored``), or ``SpecError`` naming the first that has none.

    A name found as it is keeps it; the base model's ``model.X`` is ``P + X`` for the one
    prefix ``P`` (``model.language_model.``) under which every such tensor is found; any other
    (the head) is found under a single prefix of its own."""
    base = [n for n in shapes if n.startswith("model.") and n not in stored]
    names: dict[str, str] = {n: n for n in shapes if n in stored}
    if base:
        first = base[0][len("model."):]
        fits = [p for p in _prefix(first, stored) if all(p + n[len("model."):] in stored for n in base)]
        if len(fits) != 1:
            tried = _prefix(first, stored)
            lost = next((n for n in base if tried and tried[0] + n[len("model."):] not in stored), base[0])
            raise SpecError(f"model.path: {folder} is a vision-language checkpoint, and pgs finds "
                            f"{'no' if not fits else 'more than one'} place among its weights for the text model's "
                            f"{lost!r}, so it cannot export the fine-tune in the checkpoint's shape")
        names.update({n: fits[0] + n[len("model."):] for n in base})
    for n in shapes:
        if n not in names:
            found = _prefix(n, stored)
            if len(found) != 1:
                raise SpecError(f"model.path: {folder} is a vision-language checkpoint, and pgs finds no single "
                                f"place among its weights for the trained {n!r}, so it cannot export the fine-tune in "
                                "the checkpoint's shape")
            names[n] = found[0] + n
    for n, key in names.items():
        if tuple(stored[key]) != tuple(shapes[n]):
            raise SpecError(f"model.path: {folder}: the checkpoint's {key!r} is {list(stored[key])}, the text "
                            f"model's {n!r} is {list(shapes[n])}; pgs cannot export the fine-tune in its shape")
    return names


def describe(folder: str, shapes: dict[str, tuple[int, ...]]) -> Composite:
    """The ``Composite`` of the checkpoint ``folder`` whose text model has the tensors ``shapes``
    (name -> shape, each stored tensor once: a tied head left out)."""
    files = checkpoint_files(folder)
    names = map_names(shapes, checkpoint_shapes(folder, files), folder)
    return Composite(folder=folder, config=_raw_config(folder) or {}, names=names, files=files)


def stored_shapes(model) -> dict[str, tuple[int, ...]]:
    """The model's state tensors by name, a tied head left out (the export writes it once,
    under the input embeddings' name), also for a model on the meta device."""
    tied = _tied_names(model)
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=False).items() if name not in tied}


def _tied_names(model) -> set[str]:
    """The names under which a parameter appears again after its first name (a tied head)."""
    first = {n for n, _ in model.named_parameters()}
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - first


def attach(model, folder: str) -> Composite | None:
    """Record on ``model`` (built from ``folder``) the ``Composite`` its export restores; None
    (nothing recorded) when ``folder`` is not a composite checkpoint of another model type."""
    if not is_composite(folder, str(getattr(model.config, "model_type", ""))):
        return None
    found = describe(folder, stored_shapes(model))
    setattr(model, ATTR, found)
    return found


def freeze_towers(model) -> list[str]:
    """Freeze what a text-only forward of a vision-language model never reaches (its vision
    tower and projector: every parameter outside its one ``language_model`` submodule, input
    embeddings and output head kept); returns their names ([] for a model without one).

    transformers loads some vision-language checkpoints whole as the causal LM
    (``Gemma3ForConditionalGeneration`` for ``model_type: gemma3``).  Their tower gets no
    gradient from text; left trainable, the optimizer would still step it with a zero gradient
    (weight decay would shrink it), and the export would carry a tower that text training
    changed.  Frozen, the tower is exported exactly as it was loaded."""
    language = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "language_model"]
    if len(language) != 1:
        return []
    prefix = language[0] + "."
    kept = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    frozen = []
    for name, p in model.named_parameters():
        if not name.startswith(prefix) and id(p) not in kept:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen
