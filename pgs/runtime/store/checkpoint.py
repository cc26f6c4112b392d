"""Checkpoints: durable step folders, a completion marker, resume, keep-N, the best copy.

A checkpoint is ``<run_dir>/step_<N>/``::

    model.safetensors      every parameter and persistent buffer (tied copies once)
    optimizer.safetensors  the bound chain's state (``BoundOptimizer.state_dict()``)
    rng.safetensors        torch generator states as uint8 tensors (CPU, each CUDA device, noise)
    trainer.json           counters, data-stream position, skip counters, best-so-far
    averaging.safetensors  with ``[averaging] ema``: the EMA of the weights (``save(extra=...)``)
    spec.resolved.toml     the spec the run was started with
    COMPLETE               manifest: size and digest (sha256 over 8 MiB chunks, see
                           ``pgs.runtime.store.digest``) of every file above, the safetensors
                           files hashed as they are written; written last

The safetensors files are written by ``pgs.runtime.store.safetensors_io.write``, which streams
each tensor from where it lives (the accelerator, pinned host memory) through a bounded
buffer, so a save holds no second copy of the weights or of the optimizer state.

It is written into ``.step_<N>.tmp-<pid>/``; each file is fsynced, then the folder, then
it is renamed to ``step_<N>`` and the run folder is fsynced (a rename that reaches the
journal before the data would leave zero-length files in a folder that looks complete).
Only a folder whose ``COMPLETE`` manifest matches its files is ever resumed from; nothing
here reads a pickle (safetensors and JSON only).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Iterator, Mapping

import attrs
import torch
from safetensors.torch import load_file

from pgs.errors import CheckpointError, DiskFull, PgsError, RunExists  # noqa: F401  (CheckpointError: re-exported)
from pgs.runtime.common import fsync_dir
from pgs.runtime.store import digest as digest_mod
from pgs.runtime.store import safetensors_io

#: the writer of every safetensors file of a checkpoint (a module attribute: tests replace it)
write_safetensors = safetensors_io.write

FORMAT_VERSION = 1  # trainer.json
#: the COMPLETE manifest: 2 records each file's chunked digest (``pgs.runtime.store.digest``);
#: 1 (pgs before it) a whole-file sha256, still verified at resume
MANIFEST_FORMAT = 2
MANIFEST_FORMATS = {1: "sha256", 2: digest_mod.NAME}  # format -> the files' digest key
COMPLETE = "COMPLETE"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
TRAINER_FILE = "trainer.json"
SPEC_FILE = "spec.resolved.toml"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^\.(step_\d+|best|final|final-ema)\.tmp-\d+$")


@attrs.frozen
class Checkpoint:
    """What a step folder holds (tensors on the CPU).

    ``model`` and ``optimizer`` are read lazily: each lookup reads that tensor from its file
    (``safetensors_io.LazyFile``), so ``load_model_state`` and the optimizers'
    ``load_state_dict`` (which copy entry by entry into what they hold) read one tensor at a time."""

    path: str
    step: int
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    trainer: dict[str, Any]


# -- writing ----------------------------------------------------------------------------
def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def model_tensors(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state tensors (detached, not copied), each storage once, and
    ``{alias: stored_name}`` for tied ones.

    They stay where they live (the accelerator) and may be views of one flat buffer
    (parameters bound with ``compile=True``): ``safetensors_io.write`` streams them as they are.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach()
    return tensors, aliases


def _named_generators(noise_generator: torch.Generator | None,
                      generators: Mapping[str, torch.Generator] | None) -> dict[str, torch.Generator]:
    named = dict(generators or {})
    if noise_generator is not None:
        named["noise"] = noise_generator
    reserved = [k for k in named if k == "torch_cpu" or k.startswith("torch_cuda_")]
    if reserved:
        raise ValueError(f"generator name {reserved[0]!r} is reserved for the global RNG")
    return named


def capture_rng(noise_generator: torch.Generator | None = None, *,
                generators: Mapping[str, torch.Generator] | None = None) -> dict[str, torch.Tensor]:
    """Every torch generator a step can draw from, as uint8 tensors: the global CPU and CUDA
    generators and the named ones (an objective's: NEFTune's ``"noise"``, a sampler's)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = state
    for name, gen in _named_generators(noise_generator, generators).items():
        out[name] = gen.get_state()
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def restore_rng(states: dict[str, torch.Tensor], noise_generator: torch.Generator | None = None, *,
                generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Set the generators :func:`capture_rng` saved (a named generator the states lack keeps its seed)."""
    torch.set_rng_state(states["torch_cpu"])
    cuda = sorted((k for k in states if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if cuda and torch.cuda.is_available():
        for k in cuda:
            i = int(k.rsplit("_", 1)[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(states[k], i)
    for name, gen in _named_generators(noise_generator, generators).items():
        if name in states:
            gen.set_state(states[name])


def write_manifest(folder: str, step: int, files: list[str], digests: Mapping[str, str] | None = None) -> dict:
    """The ``COMPLETE`` marker: size and digest (``pgs.runtime.store.digest``: sha256 over
    8 MiB chunks) of each of ``files``, fsynced.  Written last; returns the manifest.

    ``digests``: digests already computed while a file was written (``write_safetensors``
    returns it); the files without one are read back and hashed here.
    """
    digests = digests or {}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "chunk_bytes": digest_mod.CHUNK_BYTES,
        "files": {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                         digest_mod.NAME: digests.get(name) or digest_mod.file_digest(os.path.join(folder, name))}
                  for name in files},
    }
    path = os.path.join(folder, COMPLETE)
    _write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync_file(path)
    return manifest


def publish(tmp: str, final: str) -> None:
    """fsync ``tmp``'s files and ``tmp``, rename it to ``final`` (replacing one), fsync the parent."""
    for root, dirs, files in os.walk(tmp):
        for name in files:
            _fsync_file(os.path.join(root, name))
        fsync_dir(root)
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- a disk that cannot take the write -------------------------------------------------------
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded")
#: a run folder that can no longer be written: its filesystem remounted read-only, or the
#: write permission taken away while the run goes on
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_READ_ONLY_TEXT = ("Read-only file system", "Permission denied")


def write_failure(err: BaseException | None) -> str | None:
    """``"full"`` when ``err`` (or an exception it was raised from) is a full disk or an
    exhausted quota, ``"read-only"`` when the folder can no longer be written, else None.

    ``OSError`` carries ``errno``; safetensors' ``SafetensorError`` and DCP's
    ``CheckpointException`` carry only the OS's text, so that is checked too."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return "full"
        if isinstance(err, OSError) and err.errno in _READ_ONLY_ERRNOS:
            return "read-only"
        if any(text in str(err) for text in _DISK_FULL_TEXT):
            return "full"
        if any(text in str(err) for text in _READ_ONLY_TEXT):
            return "read-only"
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        for failure in (failures.values() if isinstance(failures, dict) else ()):
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            found = write_failure(inner) if isinstance(inner, BaseException) else None
            if found is not None:
                return found
        err = err.__cause__ or err.__context__
    return None


def is_disk_full(err: BaseException | None) -> bool:
    """True when the disk cannot take a write ``err`` reports: full, over quota, or no longer
    writable (:func:`write_failure`); such a write ends the run with exit 84."""
    return write_failure(err) is not None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def disk_full_error(final: str, need_bytes: int, what: str = "checkpoint",
                    contents: str = "weights + optimizer state", err: BaseException | None = None) -> DiskFull:
    """The one line for a disk that filled while writing ``final`` (``need_bytes``: the estimate),
    or, when ``err`` says so, for a run folder that could no longer be written."""
    run_dir = os.path.dirname(os.path.abspath(final))
    kept = [path for _, path in step_folders(run_dir) if path != final and problem(path, hashes=False) is None]
    previous = f"the previous checkpoint {kept[0]} is intact" if kept else "no earlier checkpoint exists"
    if write_failure(err) == "read-only":
        return DiskFull(f"the run folder can no longer be written (read-only or permission denied) while writing the "
                        f"{what} {final}; {previous}; make the folder writable, then continue with pgs run SPEC "
                        "--resume auto")
    try:
        free = f", {_gib(shutil.disk_usage(run_dir).free)} free now"
    except OSError:
        free = ""
    return DiskFull(
        f"disk full while writing the {what} {final}: it needs about {_gib(need_bytes)} "
        f"({need_bytes:,} bytes of {contents}){free}; the partial folder was removed and "
        f"{previous}; free space, then continue with pgs run SPEC --resume auto"
    )


@contextlib.contextmanager
def disk_full_guard(tmp: str, final: str, need_bytes: int, what: str = "checkpoint",
                    contents: str = "weights + optimizer state") -> Iterator[None]:
    """Turn a full disk inside the block into ``DiskFull`` (exit 84), removing ``tmp`` first."""
    try:
        yield
    except Exception as err:
        if not is_disk_full(err):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full_error(final, need_bytes, what, contents, err) from None


def tensor_bytes(tensors) -> int:
    """Bytes of a collection of tensors (a dict's values or an iterable; DTensors by global size)."""
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(int(t.numel()) * t.element_size() for t in values if isinstance(t, torch.Tensor))


def need_bytes(tensors, optimizer_state, rng, extra: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> int:
    """The tensor bytes of a step folder's files: what a full disk's message says it needs."""
    return (tensor_bytes(tensors) + tensor_bytes(optimizer_state) + tensor_bytes(rng)
            + sum(tensor_bytes(t) for t in (extra or {}).values()))


def save(
    run_dir: str,
    step: int,
    *,
    model,
    optimizer_state: dict[str, torch.Tensor],
    rng: dict[str, torch.Tensor],
    trainer: dict[str, Any],
    spec_toml: str,
    crash_hook: Callable[[str], None] | None = None,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
    timings: dict[str, float] | None = None,
) -> str:
    """Write ``<run_dir>/step_<step>`` durably; returns its path.

    ``optimizer_state``: ``{key: tensor}`` on any device, views of the live state welcome
    (``state_dict(copy=False)``): every tensor is streamed to its file, none copied whole.
    ``extra``: more safetensors files of the step (file name -> tensors), written before the
    manifest and covered by it (the weight EMA: ``averaging.safetensors``); ``load_extra``
    reads one back.

    ``timings``: when given, filled with ``write_seconds`` (every file written and hashed),
    ``sync_seconds`` (fsynced and renamed into place) and ``bytes`` (the files' size).

    ``crash_hook(stage)`` is called between files (tests kill the process there).  A full
    disk (``ENOSPC``, an exhausted quota) removes the temporary folder and raises
    ``DiskFull`` (exit 84) naming the folder and the bytes a checkpoint needs.
    """
    tensors, aliases = model_tensors(model)
    return save_tensors(run_dir, step, tensors=tensors, aliases=aliases, optimizer_state=optimizer_state, rng=rng,
                        trainer=trainer, spec_toml=spec_toml, crash_hook=crash_hook, extra=extra, timings=timings)


def save_tensors(
    run_dir: str,
    step: int,
    *,
    tensors: Mapping[str, torch.Tensor],
    aliases: dict[str, str],
    optimizer_state: Mapping[str, torch.Tensor],
    rng: Mapping[str, torch.Tensor],
    trainer: dict[str, Any],
    spec_toml: str,
    crash_hook: Callable[[str], None] | None = None,
    extra: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    timings: dict[str, float] | None = None,
) -> str:
    """:func:`save` of tensors already taken from the model (``model_tensors``: the weights and
    their ``aliases``): what a background save writes from its snapshot
    (``pgs.runtime.store.background``).  The same folder, files and durability."""
    final = os.path.join(run_dir, f"step_{step}")
    tmp = os.path.join(run_dir, f".step_{step}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    extra = extra or {}
    need = need_bytes(tensors, optimizer_state, rng, extra)
    with disk_full_guard(tmp, final, need):
        os.makedirs(tmp)
        _write_step(tmp, final, step, tensors, aliases, optimizer_state, rng, trainer, spec_toml,
                    crash_hook or (lambda stage: None), extra, timings)
    return final


def _write_step(tmp, final, step, tensors, aliases, optimizer_state, rng, trainer, spec_toml, hook,
                extra=None, timings=None) -> None:
    began = time.perf_counter()
    digests = {MODEL_FILE: write_safetensors(os.path.join(tmp, MODEL_FILE), tensors, {"format": "pt", "pgs": "model"})}
    hook("model")
    digests[OPTIMIZER_FILE] = write_safetensors(os.path.join(tmp, OPTIMIZER_FILE), optimizer_state,
                                                {"pgs": "optimizer"})
    hook("optimizer")
    digests[RNG_FILE] = write_safetensors(os.path.join(tmp, RNG_FILE), rng, {"pgs": "rng"})
    for name, extra_tensors in (extra or {}).items():
        digests[name] = write_safetensors(os.path.join(tmp, name), extra_tensors, {"pgs": name})
    payload = {"format": FORMAT_VERSION, "step": step, "aliases": aliases, **trainer}
    _write_text(os.path.join(tmp, TRAINER_FILE), json.dumps(payload, indent=2, sort_keys=True) + "\n")
    _write_text(os.path.join(tmp, SPEC_FILE), spec_toml)
    hook("manifest")
    files = [MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, *(extra or {}), TRAINER_FILE, SPEC_FILE]
    manifest = write_manifest(tmp, step, files, digests)
    written = time.perf_counter()
    publish(tmp, final)
    if timings is not None:
        timings.update(write_seconds=written - began, sync_seconds=time.perf_counter() - written,
                       bytes=sum(entry["bytes"] for entry in manifest["files"].values()))


# -- finding and verifying ----------------------------------------------------------------
def problem(folder: str, *, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when its manifest matches its files."""
    marker = os.path.join(folder, COMPLETE)
    if not os.path.isfile(marker):
        return "no COMPLETE marker (the write did not finish)"
    try:
        with open(marker, encoding="utf-8") as handle:
            manifest = json.load(handle)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable COMPLETE manifest ({err})"
    if not isinstance(files, dict) or not files:
        return "the COMPLETE manifest lists no files"
    if not all(isinstance(e, dict) and type(e.get("bytes")) is int for e in files.values()):
        return "unreadable COMPLETE manifest (a file entry without its bytes)"
    key = MANIFEST_FORMATS.get(manifest.get("format"))
    if key is None:
        return (f"checkpoint manifest format {manifest.get('format')!r}, expected one of "
                f"{', '.join(map(str, MANIFEST_FORMATS))} (written by a newer pgs?)")
    chunk = manifest.get("chunk_bytes", digest_mod.CHUNK_BYTES)
    if type(chunk) is not int or chunk < 1:
        return f"unreadable COMPLETE manifest (chunk_bytes {chunk!r}, expected a positive integer)"
    for name, entry in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}"
        if hashes:
            got = _sha256(path) if key == "sha256" else digest_mod.file_digest(path, chunk)
            if got != entry.get(key):
                return f"{name} does not match its {key} in the manifest"
    return None


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step_<N>`` folder, newest first (complete or not)."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(match.group(1)), os.path.join(run_dir, name)))
    return sorted(found, reverse=True)


def latest(run_dir: str, *, report: Callable[[str], None] | None = None) -> str | None:
    """The newest step folder whose manifest verifies; incomplete ones are reported and skipped."""
    report = report or (lambda line: print(line, file=sys.stderr))
    for step, path in step_folders(run_dir):
        why = problem(path)
        if why is None:
            return path
        report(f"pgs: skipping checkpoint {path}: {why}")
    return None


def resolve(run_dir: str, resume: str | None, *, report: Callable[[str], None] | None = None) -> str | None:
    """The folder ``--resume`` names: None (fresh), ``"auto"`` (newest complete, or fresh), or a path."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(run_dir, report=report)
    why = problem(resume)
    if why is not None:
        raise CheckpointError(f"--resume {resume}: not a complete checkpoint: {why}")
    return resume


def load(folder: str) -> Checkpoint:
    """Read a verified step folder (call ``problem`` first, or use ``resolve``)."""
    with open(os.path.join(folder, TRAINER_FILE), encoding="utf-8") as handle:
        trainer = json.load(handle)
    if trainer.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: trainer.json format {trainer.get('format')!r}, expected {FORMAT_VERSION}")
    return Checkpoint(
        path=folder,
        step=int(trainer["step"]),
        model=safetensors_io.read(os.path.join(folder, MODEL_FILE)),
        optimizer=safetensors_io.read(os.path.join(folder, OPTIMIZER_FILE)),
        rng=load_file(os.path.join(folder, RNG_FILE)),
        trainer=trainer,
    )


def load_extra(folder: str, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors of an ``extra`` file of a verified step folder, or None when it has none."""
    path = os.path.join(folder, name)
    return load_file(path) if os.path.isfile(path) else None


@torch.no_grad()
def load_model_state(model, tensors: Mapping[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Copy ``tensors`` into the model's own storage (parameters keep their identity).

    Each tensor is looked up once, copied and dropped before the next: with a lazy mapping
    (``Checkpoint.model``) one weight is in host memory at a time."""
    state = model.state_dict(keep_vars=True)
    missing = [n for n in state if n not in tensors and n not in aliases]
    unexpected = [n for n in tensors if n not in state]
    if missing or unexpected:
        raise CheckpointError(
            f"model weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, target in state.items():
        if name in tensors:
            source = tensors[name]
            if source.shape != target.shape:
                raise CheckpointError(f"model weight {name}: shape {tuple(source.shape)}, "
                                      f"expected {tuple(target.shape)}")
            target.copy_(source.to(dtype=target.dtype, device=target.device))
            del source


# -- housekeeping --------------------------------------------------------------------------
def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete ``.step_N.tmp-<pid>`` (and best/final temporaries) left by a killed process."""
    removed = []
    if not os.path.isdir(run_dir):
        return removed
    for name in os.listdir(run_dir):
        if TMP_DIR.match(name) or re.match(r"^(step_\d+|best|final)\.old-\d+$", name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def purge(run_dir: str, keep: int | None) -> list[str]:
    """Keep the newest ``keep`` complete step folders; delete older ones (never ``best/``).

    Incomplete step folders older than the newest complete one are deleted too; ``keep``
    None or <= 0 keeps everything.
    """
    if not keep or keep <= 0:
        return []
    removed = []
    complete = 0
    for step, path in step_folders(run_dir):
        if problem(path, hashes=False) is None:
            complete += 1
            if complete <= keep:
                continue
        elif complete == 0:
            continue  # an incomplete folder newer than every complete one: leave it for inspection
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# -- a run folder that already holds a run ---------------------------------------------------
def existing_run(run_dir: str) -> list[str]:
    """What in ``run_dir`` shows that a run already wrote there: a non-empty ``metrics.jsonl``,
    ``step_<N>`` folders, ``final/``, ``best/`` (empty when there is nothing of a run)."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    found += [os.path.basename(path) for _, path in step_folders(run_dir)]
    found += [name for name in ("best", "final", "final-ema") if os.path.isdir(os.path.join(run_dir, name))]
    return found


def refuse_existing_run(run_dir: str) -> None:
    """``RunExists`` (exit 2) when ``run_dir`` holds a run: a fresh start would mix with it."""
    found = existing_run(run_dir)
    if not found:
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise RunExists(
        f"checkpoint.dir: {run_dir} already holds a run ({shown}); continue it with --resume auto, "
        f"or start over with --overwrite (moves it aside to {run_dir.rstrip(os.sep)}.old-<timestamp>)"
    )


def move_aside(run_dir: str) -> str | None:
    """Rename ``run_dir`` to ``<run_dir>.old-<timestamp>`` (``--overwrite``); returns the new
    path, or None when there was nothing of a run to move."""
    if not existing_run(run_dir):
        return None
    base = f"{os.path.abspath(run_dir).rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = base, 1
    while os.path.exists(aside):
        n += 1
        aside = f"{base}-{n}"
    os.rename(run_dir, aside)
    return aside
