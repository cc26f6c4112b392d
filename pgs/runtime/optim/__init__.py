"""Optimizer binding: a pure chain bound to a model's parameters (plain, gradient release, FSDP2-sharded).

Every binder implements :class:`Optimizer` (``interface.py``); :func:`make_optimizer` picks one
from a run's ``[memory]`` settings and process layout.
"""

from pgs.runtime.optim.bound import BoundOptimizer, bind
from pgs.runtime.optim.interface import Optimizer, StepMetrics
from pgs.runtime.optim.make import make_optimizer
from pgs.runtime.optim.offload import OffloadedRelease
from pgs.runtime.optim.release import GradientRelease
from pgs.runtime.optim.sharded_bind import ShardedBoundOptimizer, bind_sharded
from pgs.runtime.optim.sharded_offload import ShardedOffloadedRelease
from pgs.runtime.optim.sharded_release import ShardedGradientRelease

__all__ = ["BoundOptimizer", "GradientRelease", "OffloadedRelease", "Optimizer", "ShardedBoundOptimizer",
           "ShardedGradientRelease", "ShardedOffloadedRelease", "StepMetrics", "bind", "bind_sharded", "make_optimizer"]
