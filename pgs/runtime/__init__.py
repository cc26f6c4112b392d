"""pgs.runtime — the stateful side: models, bound optimizers, data, checkpoints, the loop."""

from pgs.runtime.bind import BoundOptimizer, bind

__all__ = ["BoundOptimizer", "bind"]
