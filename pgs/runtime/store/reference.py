"""The reference log-probs cache of a preference run: ``<run dir>/reference/logps.safetensors``.

The frozen reference model's summed log-probs of every training pair's chosen and rejected
completions (and of the held-out pairs, for eval) are computed once, before the first step,
and kept here.  The file belongs to the run: a resumed run reads it back instead of running
the reference again.  It is written as a checkpoint folder is, by the checkpoint's own
helpers: into a temporary folder beside ``reference/`` that ``checkpoint.publish`` fsyncs and
renames over it, so a crash leaves the old cache or the new one, never half of one; a full disk
removes the temporary and raises ``DiskFull`` (exit 84, ``checkpoint.disk_full_guard``).

The file's metadata holds the *fingerprint* it was computed for: the reference model (its
folder's config and weight files, or the random-init config and seed), the data files (size,
mtime and a hash of the first MiB of each), the chat template, the tokenizer, ``max_seq_len``
and the data settings that change the masks (and for ``kind = "kto"`` the seed that picks each
record's KL sample: the second column holds the reference's log-prob of that mismatched pair).
Reading it back with another fingerprint is refused (:class:`StaleReference`), naming what
changed: the numbers would belong to other pairs or another model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import torch
from safetensors import safe_open

from pgs.errors import PgsError
from pgs.runtime.data.chat import chat_template_of
from pgs.runtime.store import checkpoint as ckpt
from pgs.runtime.store.safetensors_io import write as write_safetensors

CACHE_DIR = "reference"
CACHE_FILE = "logps.safetensors"
FORMAT = 1
_HEAD_BYTES = 1 << 20


class StaleReference(PgsError):
    """The run folder's reference cache was computed for another model, data or settings."""


def cache_path(run_dir: str) -> str:
    return os.path.join(run_dir, CACHE_DIR, CACHE_FILE)


def file_fingerprint(path: str) -> str:
    """``size:mtime_ns:sha256(first MiB)`` of a file."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()[:16]
    return f"{st.st_size}:{st.st_mtime_ns}:{head}"


def _model_fingerprint(folder: str | None, model_spec) -> str:
    if folder is not None:
        names = sorted(n for n in os.listdir(folder)
                       if n == "config.json" or n.endswith((".safetensors", ".bin")))
        return "path " + folder + " " + ",".join(f"{n}={file_fingerprint(os.path.join(folder, n))}" for n in names)
    config = json.dumps(model_spec.config, sort_keys=True)
    return f"config {config} init_seed {model_spec.init_seed}"


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return f"{len(tokenizer)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def fingerprint(spec, tokenizer) -> dict[str, str]:
    """What the cached numbers depend on, one string per part (the parts a refusal names)."""
    pref, data, m = spec.preference, spec.data, spec.model
    folder = pref.reference_path or m.path
    files = [s.path for s in data.sources] + ([data.eval] if data.eval else [])
    print_ = {
        "format": str(FORMAT),
        "model": _model_fingerprint(folder, None if folder else m) + f" dtype {m.dtype}",
        "data": " ".join(f"{p}={file_fingerprint(p)}" for p in files),
        "template": hashlib.sha256(chat_template_of(tokenizer).encode()).hexdigest()[:16],
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "max_seq_len": str(data.max_seq_len),
        "masks": f"supervise_empty_think={data.supervise_empty_think} on_bad_record={data.on_bad_record}",
    }
    if pref.kind == "kto":  # the second column is each record's KL sample, chosen by data.seed
        print_["kto"] = f"KL samples seed {data.seed}"
    return print_


def key(print_: dict[str, str]) -> str:
    """A short digest of a fingerprint: the cache's name in a checkpoint's ``trainer.json``."""
    return hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:16]


def _temporary(path: str) -> str:
    """The temporary folder a save writes before publishing: ``<run dir>/.reference.tmp-<pid>``."""
    parent, name = os.path.split(os.path.dirname(os.path.abspath(path)))
    return os.path.join(parent, f".{name}.tmp-{os.getpid()}")


def remove_stale_temporaries(path: str) -> None:
    """Delete what a killed save left: ``.reference.tmp-<pid>`` and ``reference.old-<pid>``
    folders beside the cache's folder (and ``logps.safetensors.tmp-<pid>`` files in it)."""
    folder = os.path.dirname(os.path.abspath(path))
    parent, name = os.path.split(folder)
    if os.path.isdir(parent):
        stale = re.compile(rf"^(\.{re.escape(name)}\.tmp|{re.escape(name)}\.old)-\d+$")
        for other in os.listdir(parent):
            if stale.match(other):
                shutil.rmtree(os.path.join(parent, other), ignore_errors=True)
    if os.path.isdir(folder):
        for other in os.listdir(folder):
            if other.startswith(os.path.basename(path) + ".tmp-"):
                os.remove(os.path.join(folder, other))


def load(path: str, expected: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The cached tensors, or None when there is no cache; :class:`StaleReference` when the cache
    was made for another fingerprint."""
    if not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        saved = json.loads(meta.get("fingerprint", "{}"))
        # a part only one side has (a KTO cache read by a paired run) changed too
        changed = [k for k in [*expected, *(k for k in saved if k not in expected)] if saved.get(k) != expected.get(k)]
        if changed:
            raise StaleReference(
                f"{path}: the reference log-probs were computed for another {', '.join(changed)} "
                "than this run's; delete the file to recompute them, or start a new run (--overwrite)")
        return {k: f.get_tensor(k) for k in f.keys()}


def save(path: str, tensors: dict[str, torch.Tensor], print_: dict[str, str]) -> None:
    """Write the cache durably (see the module docstring); ``DiskFull`` when the disk fills."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _temporary(path)
    shutil.rmtree(tmp, ignore_errors=True)
    with ckpt.disk_full_guard(tmp, folder, ckpt.tensor_bytes(tensors), what="reference log-probs cache",
                              contents="reference log-probs"):
        os.makedirs(tmp)
        write_safetensors(os.path.join(tmp, os.path.basename(path)), tensors,
                          {"fingerprint": json.dumps(print_, sort_keys=True)})
        ckpt.publish(tmp, folder)
