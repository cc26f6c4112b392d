"""pgs.runtime — the stateful side: models, bound optimizers, data, checkpoints, the loop."""

from pgs.runtime.optim.bound import BoundOptimizer, bind

__all__ = ["BoundOptimizer", "bind"]
