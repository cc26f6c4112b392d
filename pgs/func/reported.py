"""Metrics a chain's state reports: declared by the state types of its transforms, not guessed.

A transform whose state carries something worth logging declares it on its state class:
``reports = (("lr", "lr"),)`` — pairs of (metric name, field of the state, dotted into dicts).
``reported_metrics(state)`` walks any chain state (chains, masks, partitions, accumulation,
injected hyperparameters, one state per release group) and returns each declared metric from
the first state that reports it, in the chain's order.

The metric names the runtime reads (``pgs.runtime.optim.StepMetrics``): ``lr`` (the learning
rate the last update used), ``grad_norm`` (‖g‖ before clipping), ``spike`` (the last update was
a spike), ``spikes_skipped`` (spikes skipped so far).
"""

from __future__ import annotations

from typing import Any

import torch


def _field(state: Any, dotted: str) -> Any:
    value = state
    for part in dotted.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        else:
            value = getattr(value, part, None)
        if value is None:
            return None
    return value


def reported_metrics(state: Any) -> dict[str, torch.Tensor]:
    """``{metric: 0-d tensor}`` declared by the state types found in ``state`` (first wins)."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any) -> None:
        declared = getattr(type(node), "reports", None)
        if isinstance(node, tuple) and declared:
            for metric, dotted in declared:
                value = _field(node, dotted)
                if metric not in out and isinstance(value, torch.Tensor) and value.numel() == 1:
                    out[metric] = value
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                walk(v)

    walk(state)
    return out
