"""A model folder's weights, judged by their headers: what ``pgs run`` would refuse in its first
minute (loading tens of GB), ``pgs validate`` refuses in a second.

A safetensors file begins with an 8-byte length and a JSON header naming every tensor's dtype,
shape and byte range; reading the header alone tells whether each file is there, whole (every
range inside the file) and of the architecture the folder's ``config.json`` describes.  Checked:

- the folder has ``model.safetensors`` or ``model.safetensors.index.json`` (pgs loads no
  pickled weights), and every shard the index names exists and lists the tensors the index
  maps to it;
- every header parses and every tensor's bytes lie inside its file (a truncated download);
- every tensor whose name is a parameter of the architecture has that parameter's shape;
- the weights are this architecture's: when most of its parameters are named in the files, the
  rest must be too (a missing tensor would otherwise be initialised at random and trained as if
  it had been loaded).  Checkpoints that transformers renames on load (fused experts, a
  vision-language wrapper) share few names with the model; then only the shapes of the shared
  names are checked, and the load itself refuses missing weights (``pgs.runtime.model.build``).
"""

from __future__ import annotations

import json
import os

from pgs.errors import SpecError
from pgs.runtime.store.safetensors_io import LazyFile

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: an index is a name -> file map: a few MB even for the largest models
INDEX_LIMIT = 64 * 2**20
#: the share of the architecture's parameters that must be named in the files before the rest
#: are required too (below it, the checkpoint's names are ones transformers converts on load)
SAME_NAMING = 0.5


def _index(path: str, field: str) -> dict[str, str]:
    where = os.path.join(path, INDEX)
    if os.path.getsize(where) > INDEX_LIMIT:
        raise SpecError(f"{field}: {where} is larger than {INDEX_LIMIT >> 20} MB: not a weight index")
    try:
        with open(where, encoding="utf-8") as handle:
            table = json.load(handle)
        weight_map = table["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a name -> file table")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise SpecError(f"{field}: {where} is not a weight index ({type(err).__name__}: {err})") from None
    for name in set(weight_map.values()):
        if os.path.basename(name) != name:
            raise SpecError(f"{field}: {where} names a weight file outside the folder: {name!r}")
    return weight_map


def read_headers(path: str, field: str = "model.path") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the folder's weights: name -> (file, shape), from the headers alone."""
    if os.path.isfile(os.path.join(path, INDEX)):
        weight_map = _index(path, field)
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE)):
        weight_map, files = {}, [SINGLE]
    else:
        raise SpecError(f"{field}: {path} has neither {SINGLE} nor {INDEX} (pgs loads safetensors weights only)")
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
        where = os.path.join(path, name)
        if not os.path.isfile(where):
            raise SpecError(f"{field}: {where} is missing (named by {INDEX})")
        try:
            header = LazyFile(where)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            raise SpecError(f"{field}: {where} is not a whole safetensors file ({err})") from None
        for tensor in header:
            found[tensor] = (name, header.shape(tensor))
    for tensor, name in weight_map.items():
        if found.get(tensor, (None,))[0] != name:
            raise SpecError(f"{field}: {INDEX} maps {tensor!r} to {name}, whose header does not list it")
    return found


def check_weights(path: str, shapes: dict[str, tuple[int, ...]] | None, tied: bool,
                  field: str = "model.path") -> str:
    """Refuse (``SpecError``, exit 2) weights that are missing, cut short, of another shape or of
    another architecture than ``shapes`` (the parameter shapes the folder's config builds;
    None: the architecture does not build on the meta device, so only the files are checked).
    ``tied``: the output head shares the input embedding (its tensor may be absent).  Returns a
    one-line summary for ``pgs validate``."""
    found = read_headers(path, field)
    if shapes is None:
        return f"{len(found)} tensors (headers read; the architecture was not built to compare)"
    shared = [n for n in shapes if n in found]
    for name in shared:
        if tuple(found[name][1]) != tuple(shapes[name]):
            raise SpecError(f"{field}: {os.path.join(path, found[name][0])}: {name} has shape "
                            f"{list(found[name][1])}, but the config's architecture makes it {list(shapes[name])}")
    wanted = [n for n in shapes if not (tied and n == "lm_head.weight")]
    if not shared:
        raise SpecError(f"{field}: none of the {len(found)} tensors in the weights is a parameter of the config's "
                        f"architecture (e.g. {next(iter(found), 'no tensors at all')!r}): not this model's weights")
    if len(shared) >= SAME_NAMING * len(wanted):
        missing = [n for n in wanted if n not in found]
        if missing:
            raise SpecError(f"{field}: the weights lack {len(missing)} of the architecture's {len(wanted)} parameters "
                            f"(e.g. {missing[0]!r}); a missing weight would be trained from a random init")
    return f"{len(found)} tensors, shapes match the config"
