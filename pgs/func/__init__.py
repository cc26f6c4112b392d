"""pgs.func — pure gradient transforms, chains, schedules and losses on torch.

Everything here is a pure function of tensors: ``init(params) -> state`` and
``update(updates, state, params) -> (updates, state)``; no I/O, no process groups, no
mutation of the caller's inputs (unless ``pf.compile(..., donate=True)`` is asked for).

    import torch, pgs.func as pf
    opt = pf.chain(
        pf.clip_by_global_norm(1.0),
        pf.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
        pf.add_decayed_weights(0.1, mask=lambda path, p: p.ndim >= 2),
        pf.scale_by_learning_rate(pf.cosine_schedule(peak=3e-4, warmup=100, total=10_000)),
    )
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = pf.apply_updates(params, updates)
"""

from pgs.func.accumulation import AccumulateState, accumulate
from pgs.func.adam import ScaleByAdamState, scale_by_adam
from pgs.func.alias import adamw, lion, sgd
from pgs.func.apply import apply_updates, stochastic_round_to_bf16
from pgs.func.base import (
    DIRECTION,
    ELEMENTWISE,
    GLOBAL,
    MATRIX,
    PER_TENSOR,
    STEP,
    EmptyState,
    Transform,
    chain,
    identity,
    named_chain,
    skip_signal,
)
from pgs.func.clip import clip_by_global_norm, clip_by_norm_per_tensor, global_norm
from pgs.func.combine import masked, partition
from pgs.func.flat_chain import FlatChain, compile
from pgs.func.hyperparams import InjectHyperparamsState, inject_hyperparams
from pgs.func.layout import Layout, per_tensor_apply, per_tensor_dot, per_tensor_sumsq
from pgs.func.learning_rate import ScaleByLearningRateState, scale_by_learning_rate, takes_learning_rate
from pgs.func.lion_direction import ScaleByLionState, scale_by_lion
from pgs.func.schedules import (
    constant_schedule,
    cosine_schedule,
    join_schedules,
    linear_warmup,
    power_decay_schedule,
    wsd_schedule,
)
from pgs.func.sgd_momentum import scale_by_sgd_momentum
from pgs.func.reported import reported_metrics
from pgs.func.state_io import state_entries, state_from_dict, state_to_dict
from pgs.func.weight_decay import add_decayed_weights
from pgs.func.tree import leaves_with_paths, tree_map
from pgs.func.step import NO_CONTEXT, StepContext
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions
from pgs.func.plan import FLAT, RELEASE, SHARDED, Placement, Plan, PlanEntry, plan_for
from pgs.func.kernels.kernel_config import KernelConfig

# -- research transforms: AdaGC, AdamC, EMA/merging, Hyperball, MONA, Muon, SAGE, schedule-free, ZClip
from pgs.func.adagc_clip import AdaGCState, adagc
from pgs.func.adamc_decay import AddCorrectedDecayState, adamc, add_corrected_decayed_weights, schedule_peak
from pgs.func.ema_weights import EmaState, ema, ema_params
from pgs.func.hyperball_sphere import HyperballState, adamh, hyperball, muonh
from pgs.func.merge import lerp, merge_back, slerp
from pgs.func.mona_acceleration import MonaState, mona
from pgs.func.muon_direction import ScaleByMuonState, muon, muon_route, newton_schulz, scale_by_muon
from pgs.func.sage_direction import ScaleBySageState, sage, scale_by_sage
from pgs.func.schedule_free_iterates import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
)
from pgs.func.zclip_spike import ZClipState, zclip

# -- 8-bit optimizer state (block-wise quantization) and fused execution ------------------
from pgs.func.adam8bit import ScaleByAdam8bitState, adamw8bit, scale_by_adam8bit
from pgs.func.kernels.fused_transform import FusedTransform
from pgs.func.lion8bit_direction import ScaleByLion8bitState, lion8bit, scale_by_lion8bit
from pgs.func.quant8 import Quantized8bit, dequantize_blockwise, dynamic_map, quantize_blockwise
from pgs.func.state_memory import state_bytes, state_bytes_per_param

#: The public surface, written out: what ``import pgs.func as pf`` offers as ``pf.<name>`` (and
#: what a spec's ``[optimizer]`` may name, ``pgs.runtime.spec.chain``).  Submodules are not part
#: of it: they are named after what they hold (``lion_direction``, ``flat_chain``), never after a
#: function exported here, so that importing one cannot rebind a name of this list.
__all__ = [
    # the transform and its composition
    "Transform", "EmptyState", "chain", "named_chain", "identity", "masked", "partition", "skip_signal",
    "ELEMENTWISE", "PER_TENSOR", "MATRIX", "GLOBAL", "DIRECTION", "STEP",
    # gradient transforms and optimizers
    "scale_by_adam", "ScaleByAdamState", "adamw",
    "scale_by_lion", "ScaleByLionState", "lion",
    "scale_by_sgd_momentum", "sgd",
    "scale_by_learning_rate", "ScaleByLearningRateState", "takes_learning_rate",
    "add_decayed_weights",
    "clip_by_global_norm", "clip_by_norm_per_tensor", "global_norm",
    "accumulate", "AccumulateState",
    "inject_hyperparams", "InjectHyperparamsState",
    # schedules
    "constant_schedule", "cosine_schedule", "join_schedules", "linear_warmup", "power_decay_schedule",
    "wsd_schedule",
    # applying updates, trees, state
    "apply_updates", "stochastic_round_to_bf16", "tree_map", "leaves_with_paths",
    "MemoryOptions", "NO_MEMORY_OPTIONS",
    "state_entries", "state_from_dict", "state_to_dict", "state_bytes", "state_bytes_per_param",
    "reported_metrics",
    # execution: flat layout, compiled chains, fused plans
    "compile", "FlatChain", "Layout", "per_tensor_apply", "per_tensor_dot", "per_tensor_sumsq",
    "StepContext", "NO_CONTEXT", "FLAT", "RELEASE", "SHARDED", "Placement", "Plan", "PlanEntry", "plan_for",
    "KernelConfig", "FusedTransform",
    # research transforms
    "adagc", "AdaGCState",
    "adamc", "add_corrected_decayed_weights", "AddCorrectedDecayState", "schedule_peak",
    "ema", "ema_params", "EmaState", "lerp", "slerp", "merge_back",
    "hyperball", "adamh", "muonh", "HyperballState",
    "mona", "MonaState",
    "muon", "scale_by_muon", "ScaleByMuonState", "muon_route", "newton_schulz",
    "sage", "scale_by_sage", "ScaleBySageState",
    "schedule_free", "schedule_free_adamw", "schedule_free_eval_params", "ScheduleFreeState",
    "zclip", "ZClipState",
    # 8-bit optimizer state
    "adamw8bit", "scale_by_adam8bit", "ScaleByAdam8bitState",
    "lion8bit", "scale_by_lion8bit", "ScaleByLion8bitState",
    "Quantized8bit", "dequantize_blockwise", "dynamic_map", "quantize_blockwise",
]


def __dir__() -> list[str]:
    """``dir(pf)`` (and tab completion) show the public surface, not the submodules."""
    return sorted(__all__)
