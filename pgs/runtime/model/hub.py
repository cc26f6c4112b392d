"""Hugging Face hub names as model, tokenizer, teacher and reference paths.

A spec may name ``model.path = "Qwen/Qwen3-8B"`` (and ``model.tokenizer``,
``distill.teacher_path``, ``preference.reference_path``) instead of a local folder.  A value
that is not an existing folder and has the form ``org/name`` (optionally ``org/name@revision``:
a branch, tag or commit) is resolved through huggingface_hub's cache (``HF_HUB_CACHE``, or
``HF_HOME/hub``, or ``~/.cache/huggingface/hub``):

* offline (``HF_HUB_OFFLINE=1``, or the hub cannot be reached) the cache's snapshot of that
  revision is used as it is; a repository or file the cache lacks is one line saying what is
  missing;
* online the snapshot is downloaded once (``snapshot_download``: files already in the cache are
  not fetched again), only what a model folder needs (configuration, safetensors weights,
  tokenizer and chat-template files, remote code).

The result is the snapshot's local folder, which everything else reads as a local model folder,
and the commit it is (:class:`HubSource`).  The resolved spec writes ``org/name@<commit>`` back
(``spec.resolved.toml``), so the run folder records the exact revision, a resumed run is checked
against it (``pgs.runtime.loop.resume``) and the resolved spec reloads the same files.
"""

from __future__ import annotations

import json
import os
import re

import attrs

from pgs.errors import SpecError
from pgs.runtime import process

#: ``org/name`` or ``org/name@revision`` (the hub's own rules for repository names).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*)"
                    r"(?:@(?P<rev>[A-Za-z0-9_.\-/]+))?$")

#: What a model folder needs from a repository (the rest, e.g. original/*.pth, is not fetched).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]

@attrs.frozen
class HubSource:
    """A hub name resolved to a local snapshot: ``repo`` (``org/name``), ``revision`` (the
    commit), ``path`` (the snapshot folder)."""

    repo: str
    revision: str
    path: str

    @property
    def ref(self) -> str:
        """``org/name@<commit>``: what the resolved spec writes."""
        return f"{self.repo}@{self.revision}"


def parse(value: str) -> tuple[str, str | None] | None:
    """``(repo, revision or None)`` when ``value`` has the form of a hub name, else None."""
    if not isinstance(value, str) or value.startswith((".", "/", "~")) or "\\" in value:
        return None
    m = HUB_ID.match(value)
    return (m.group("repo"), m.group("rev")) if m else None


def _true(name: str) -> bool:
    return (process.variable(name) or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``), read now, not at import."""
    return _true("HF_HUB_OFFLINE") or _true("TRANSFORMERS_OFFLINE")


def cache_dir() -> str:
    """The hub cache huggingface_hub uses, read from the environment now."""
    if process.variable("HF_HUB_CACHE"):
        return os.path.expanduser(process.variable("HF_HUB_CACHE"))
    if process.variable("HF_HOME"):
        return os.path.join(os.path.expanduser(process.variable("HF_HOME")), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__


def _missing(folder: str, kind: str) -> list[str]:
    """The files a snapshot ``folder`` lacks to be a model (``kind = "model"``: config.json and
    every safetensors file its index names, or model.safetensors) or a tokenizer."""
    from pgs.runtime.model.loading import TOKENIZER_FILES as TOKENIZER_NAMES

    if kind == "tokenizer":
        return [] if any(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_NAMES) else ["tokenizer.json"]
    missing = [] if os.path.exists(os.path.join(folder, "config.json")) else ["config.json"]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return missing + ["a readable model.safetensors.index.json"]
        missing += [s for s in shards if not os.path.exists(os.path.join(folder, s))]
    elif not os.path.exists(os.path.join(folder, "model.safetensors")):
        missing.append("model.safetensors")
    return missing


def _offline_why() -> str:
    return "HF_HUB_OFFLINE=1" if _true("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE=1"


def resolve(value: str, field: str, kind: str = "model", trust_remote_code: bool = False) -> HubSource:
    """The local snapshot of hub name ``value`` for spec field ``field``; ``kind``: ``"model"``
    (weights, configuration and tokenizer) or ``"tokenizer"``.  A ``SpecError`` line names the
    field and what is missing."""
    parsed = parse(value)
    if parsed is None:
        raise SpecError(f"{field}: {value!r} is neither a local folder nor a hub name (org/name)")
    repo, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from pgs.runtime.model.loading import quiet_transformers

    quiet_transformers()
    cache = cache_dir()
    local_only = offline()
    patterns = list(MODEL_FILES if kind == "model" else TOKENIZER_FILES)
    if not trust_remote_code:
        patterns.remove("*.py")
    at = f"{repo}@{revision}" if revision else repo
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=local_only,
                                   allow_patterns=patterns)
    except LocalEntryNotFoundError:
        how = (f"offline ({_offline_why()})" if local_only else "the hub cannot be reached")
        raise SpecError(f"{field}: {at} is not a local folder and the Hugging Face cache {cache} does not hold it; "
                        f"{how}: download it where there is network (hf download {repo}"
                        f"{f' --revision {revision}' if revision else ''}) into that cache") from None
    except (RepositoryNotFoundError, GatedRepoError) as err:
        what = "is gated (log in with hf auth login and accept its terms)" if isinstance(err, GatedRepoError) \
            else "is not a repository on the hub (nor a local folder)"
        raise SpecError(f"{field}: {repo} {what}") from None
    except RevisionNotFoundError:
        raise SpecError(f"{field}: {repo} has no revision {revision!r} on the hub") from None
    except HFValidationError as err:
        raise SpecError(f"{field}: {value!r} is not a hub name ({_first_line(err)})") from None
    except Exception as err:  # the hub's HTTP errors, a full disk: the user's environment, one line
        raise SpecError(f"{field}: cannot download {at} from the hub "
                        f"({type(err).__name__}: {_first_line(err)})") from None
    folder = str(folder)
    commit = os.path.basename(os.path.normpath(folder))
    missing = _missing(folder, kind)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        how = (f"offline ({_offline_why()}) nothing is downloaded" if local_only
               else "the download did not bring them (the repository may not have safetensors weights)")
        raise SpecError(f"{field}: {repo} at revision {commit[:12]} in the Hugging Face cache {cache} lacks {shown}; "
                        f"{how}: hf download {repo} --revision {commit} fetches them")
    return HubSource(repo=repo, revision=commit, path=folder)
