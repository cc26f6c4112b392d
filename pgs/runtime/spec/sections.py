"""Which TOML section is which component's typed config: the composition ``Spec`` is made of.

Each section's class lives next to the code that uses it and checks its own fields (a
``SpecError`` naming the dotted field):

==============  ====================  =================================================
section         class                 module
==============  ====================  =================================================
``[model]``     ``ModelSpec``         ``pgs.runtime.model.config``
``[moe]``       ``MoESpec``           ``pgs.runtime.model.config``
``[data]``      ``DataConfig``        ``pgs.runtime.data.config``
``[optimizer]`` ``OptimizerSpec``     ``pgs.runtime.optim.config``
``[schedule]``  ``ScheduleSpec``      ``pgs.runtime.optim.config``
``[memory]``    ``MemorySpec``        ``pgs.runtime.optim.config``
``[train]``     ``TrainSpec``         ``pgs.runtime.loop.config``
``[loss]``      ``LossSpec``          ``pgs.runtime.loop.config``
``[preference]`` ``PreferenceSpec``   ``pgs.runtime.loop.config``
``[distill]``   ``DistillSpec``       ``pgs.runtime.loop.config``
``[checkpoint]`` ``CheckpointSpec``   ``pgs.runtime.store.config``
``[log]``       ``LogSpec``           ``pgs.runtime.loop.trackers``
``[averaging]`` ``AveragingSpec``     ``pgs.runtime.loop.averaging``
``[eval]``      ``EvalSpec``          ``pgs.runtime.loop.samples``
``[parallel]``  ``ParallelSpec``      ``pgs.runtime.dist.config``
==============  ====================  =================================================

The names are re-exported here and by ``pgs.runtime.spec.load`` (older imports keep working).
"""

from __future__ import annotations

from pathlib import Path

from pgs.runtime.data.config import DataConfig
from pgs.runtime.dist.config import ParallelSpec
from pgs.runtime.loop.averaging import MERGE_METHODS, AveragingSpec
from pgs.runtime.loop.config import (DEVICES, GENERATION_DEFAULTS, REFERENCE_MODES, DistillSpec, LossSpec,
                                     PreferenceSpec, TrainSpec)
from pgs.runtime.loop.samples import EvalSpec
from pgs.runtime.loop.trackers import LogSpec
from pgs.runtime.model.config import (ATTN_IMPLEMENTATIONS, DTYPES, EXPERTS_IMPLEMENTATIONS, FREEZE_POLICIES,
                                      VARLEN_KERNELS, ModelSpec, MoESpec)
from pgs.runtime.optim.config import (CHECKPOINT_POLICIES, MASTER_WEIGHTS, RELEASE_GROUPS, SCHEDULES, WSD_SHAPES,
                                      ChainEntry, MemorySpec, OptimizerSpec, ScheduleSpec, checkpoint_offload,
                                      head_grad_wanted, prefetch_depth)
from pgs.runtime.spec.fields import describe as _describe, is_int as _is_int, suggest
from pgs.runtime.store.config import CheckpointSpec

#: ``"pgs:quickstart/train.jsonl"`` names a file bundled with the package.
ASSET_PREFIX = "pgs:"
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"  # pgs/assets

SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "data": DataConfig,
    "optimizer": OptimizerSpec,
    "schedule": ScheduleSpec,
    "loss": LossSpec,
    "train": TrainSpec,
    "checkpoint": CheckpointSpec,
    "log": LogSpec,
    "memory": MemorySpec,
    "moe": MoESpec,
    "parallel": ParallelSpec,
    "preference": PreferenceSpec,
    "distill": DistillSpec,
    "averaging": AveragingSpec,
    "eval": EvalSpec,
}

__all__ = [
    "ASSET_PREFIX", "ASSETS_DIR", "ATTN_IMPLEMENTATIONS", "CHECKPOINT_POLICIES", "DEVICES", "DTYPES",
    "EXPERTS_IMPLEMENTATIONS", "FREEZE_POLICIES", "GENERATION_DEFAULTS", "MASTER_WEIGHTS", "MERGE_METHODS",
    "REFERENCE_MODES", "RELEASE_GROUPS", "SCHEDULES", "SECTIONS", "VARLEN_KERNELS", "WSD_SHAPES",
    "AveragingSpec", "ChainEntry", "CheckpointSpec", "DataConfig", "DistillSpec", "EvalSpec", "LogSpec", "LossSpec",
    "MemorySpec", "ModelSpec", "MoESpec", "OptimizerSpec", "ParallelSpec", "PreferenceSpec", "ScheduleSpec",
    "TrainSpec", "checkpoint_offload", "head_grad_wanted", "prefetch_depth", "suggest", "_describe", "_is_int",
]
