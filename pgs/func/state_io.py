"""Optimizer state as a flat, readable ``dict[str, Tensor]`` (for safetensors)."""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from pgs.errors import TreeMismatch
from pgs.func import tree as T

STATE_VERSION = 1
VERSION_KEY = "__pgs_state_version__"


def state_to_dict(state, device: str | torch.device | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
    """``{"0_scale_by_adam.mu.layers.0.weight": tensor, ...}`` plus a version entry.

    Keys are the leaf paths of the state (names of NamedTuple fields, chain entries and
    parameter paths), so a checkpoint of it reads like the chain that made it.  Tensors are
    made contiguous and unshared (safetensors refuses shared storage): copies on their own
    device, or, with ``device`` (e.g. ``"cpu"`` for a checkpoint), copied straight there one
    leaf at a time, so that no second copy of the state ever exists on the accelerator.

    ``copy=False``: the leaves themselves (detached; moved only when ``device`` names another
    device), possibly views of one buffer and non-contiguous -- for a writer that streams them
    (``pgs.runtime.store.safetensors_io``) before the state changes again.
    """
    out = {VERSION_KEY: torch.tensor(STATE_VERSION, dtype=torch.int32)}
    for path, x in T.leaves_with_paths(state):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TreeMismatch(f"state leaf {path!r} is a {type(x).__name__}; state must hold tensors only")
        if not copy:
            out[path] = x.detach() if device is None else x.detach().to(device)
        elif device is None:
            out[path] = x.detach().contiguous().clone()
        else:
            out[path] = x.detach().to(device, copy=True).contiguous()
    return out


def _version(d: Mapping[str, torch.Tensor]) -> None:
    v = d.get(VERSION_KEY)
    if v is None:
        raise TreeMismatch(f"state dict has no {VERSION_KEY!r} entry (not written by pgs.func.state_to_dict)")
    if int(v) != STATE_VERSION:
        raise TreeMismatch(f"state dict version {int(v)} is not the supported version {STATE_VERSION}")


def _entry(d: Mapping[str, torch.Tensor], path: str, x: torch.Tensor) -> torch.Tensor:
    if path not in d:
        raise TreeMismatch(f"state dict lacks {path!r}")
    y = d[path]
    if y.shape != x.shape:
        raise TreeMismatch(f"state entry {path!r} has shape {tuple(y.shape)}, expected {tuple(x.shape)}")
    if y.dtype != x.dtype:
        raise TreeMismatch(f"state entry {path!r} has dtype {y.dtype}, expected {x.dtype}")
    return y


def _no_extra(d: Mapping[str, torch.Tensor], wanted: set[str], ignore: Callable[[str], bool] | None) -> None:
    extra = sorted(k for k in d if k not in wanted and k != VERSION_KEY and not (ignore and ignore(k)))
    if extra:
        raise TreeMismatch(f"state dict has entry {extra[0]!r} that the optimizer does not have")


def state_from_dict(template, d: Mapping[str, torch.Tensor], ignore: Callable[[str], bool] | None = None):
    """Rebuild a state shaped like ``template`` from ``d``; names the first missing or odd key.
    ``ignore``: keys of ``d`` that are not state (a caller's own entries)."""
    _version(d)
    wanted = set()

    def one(path, x):
        wanted.add(path)
        return _entry(d, path, x).to(x.device)

    out = T.tree_map_with_path(one, template)
    _no_extra(d, wanted, ignore)
    return out


def state_entries(template, d: Mapping[str, torch.Tensor],
                  ignore: Callable[[str], bool] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(leaf, entry)`` for each tensor leaf of ``template`` and its entry of ``d``, checked as
    ``state_from_dict`` checks them; ``d`` is read one entry at a time, as the pairs are taken
    (a lazily read file holds one tensor in memory), and its keys that ``template`` lacks are
    refused after the last pair.  For a caller that copies each entry into the state it holds
    (``leaf.copy_(entry)``) instead of building a second state beside it."""
    _version(d)
    wanted = set()
    for path, x in T.leaves_with_paths(template):
        if x is None:
            continue
        wanted.add(path)
        yield x, _entry(d, path, x)
    _no_extra(d, wanted, ignore)
