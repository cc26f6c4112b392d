"""Optimizer state as a flat, readable ``dict[str, Tensor]`` (for safetensors)."""

from __future__ import annotations

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


def state_from_dict(template, d: dict[str, torch.Tensor]):
    """Rebuild a state shaped like ``template`` from ``d``; names the first missing or odd key."""
    v = d.get(VERSION_KEY)
    if v is None:
        raise TreeMismatch(f"state dict has no {VERSION_KEY!r} entry (not written by pgs.func.state_to_dict)")
    if int(v) != STATE_VERSION:
        raise TreeMismatch(f"state dict version {int(v)} is not the supported version {STATE_VERSION}")
    wanted = set()

    def one(path, x):
        wanted.add(path)
        if path not in d:
            raise TreeMismatch(f"state dict lacks {path!r}")
        y = d[path]
        if y.shape != x.shape:
            raise TreeMismatch(f"state entry {path!r} has shape {tuple(y.shape)}, expected {tuple(x.shape)}")
        if y.dtype != x.dtype:
            raise TreeMismatch(f"state entry {path!r} has dtype {y.dtype}, expected {x.dtype}")
        return y.to(x.device)

    out = T.tree_map_with_path(one, template)
    extra = sorted(set(d) - wanted - {VERSION_KEY})
    if extra:
        raise TreeMismatch(f"state dict has entry {extra[0]!r} that the optimizer does not have")
    return out
