"""Small helpers that several runtime packages share, in one low module.

It imports nothing of pgs but :mod:`pgs.errors`, so any runtime package may use it: a hint for
a mistyped name (``suggest``), a size written as transformers writes it (``parse_size``), a
folder's directory entry made durable (``fsync_dir``), the device ``train.device`` names
(``pick_device``).
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Iterable

import torch

from pgs.errors import SpecError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def suggest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def describe(value) -> str:
    """What kind of TOML value ``value`` is, for a message: ``an integer (3)``, ``a table``."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) else kind


def is_int(v) -> bool:
    """An integer that is not a boolean."""
    return isinstance(v, int) and not isinstance(v, bool)


def parse_size(value, field: str = "checkpoint.max_shard_size") -> int:
    """Bytes of a size written as transformers writes it: an integer, or ``"5GB"`` (10^9),
    ``"500MB"``, ``"2GiB"`` (2^30), ..."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(value).upper())
        if match is None or match.group(2) not in _UNITS:
            raise SpecError(f"{field}: {value!r} is not a size (write e.g. \"5GB\", \"500MB\" or \"2GiB\")")
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size < 1:
        raise SpecError(f"{field}: {value!r} must be at least one byte")
    return size


def fsync_dir(path: str) -> None:
    """Make ``path``'s directory entries durable (after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def auto_device(name: str) -> torch.device:
    """``train.device`` as a device, ``"auto"`` being CUDA where this host has it; no check."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def run_device(name: str) -> torch.device:
    """``train.device`` as the device ``pgs run`` trains on; a CUDA device this host does not
    have is a ``SpecError`` (``pgs validate`` passes such a spec, whose device may be
    elsewhere: it uses :func:`auto_device`; ``pgs run`` cannot)."""
    device = auto_device(name)
    if name == "auto":
        name = device.type
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SpecError(f"train.device: {name!r}, but this host has no CUDA device (torch "
                            f"{torch.__version__}{'' if torch.version.cuda else ', built without CUDA'}); "
                            "set train.device = \"auto\" or \"cpu\"")
        if device.index is not None and device.index >= count:
            raise SpecError(f"train.device: {name!r}, but this host has {count} CUDA device(s) (cuda:0"
                            f"{f'..cuda:{count - 1}' if count > 1 else ''})")
    return device
