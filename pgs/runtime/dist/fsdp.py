"""Data parallelism with FSDP2: the process group, the mesh, and how a model is sharded.

One process per device, started by ``torchrun`` (or ``pgs run --nproc N``, which re-executes
itself under it, see ``pgs.runtime.dist.launch``).  :func:`init` reads the launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and
opens the default process group with a timeout that is ours to choose; :func:`shard_model`
wraps every decoder layer and the root in ``fully_shard``.

The batch is global.  Each rank's loss is ``Σ token losses / N`` where ``N`` is the number
of valid tokens of the *whole* step, summed over the ranks (:func:`global_count`), so the
gradient of the step is the sum over ranks of the per-rank gradients.  FSDP2 averages
gradients by default (divides the reduce-scatter by the world size); :func:`shard_model`
sets the divide factor to 1 and asks for plain SUM collectives (``set_gradient_divide_factor``
and ``set_force_sum_reduction_for_comms``), instead of multiplying the loss by the world
size, so that the loss a rank logs is its true share of the global mean.

Sharding layout (``shard_model``):

- every decoder layer is its own unit (all-gathered just before it runs, freed after);
- the last decoder layer keeps its parameters after forward (``reshard_after_forward=False``):
  backward needs them at once, so freeing them would only cost one more all-gather;
- the root unit (embeddings, final norm, output head, tied or not) also stays gathered after
  forward: the chunked loss applies the head *outside* the model's forward, to the hidden
  states that ``pgs.runtime.model.build.final_hidden`` returns, so the head's weight must still be the gathered
  parameter then.  Its gradient is reduce-scattered by FSDP's end-of-backward callback.
"""

from __future__ import annotations

import datetime
import os
import types
from typing import Any

import attrs
import torch
import torch.distributed as dist

from pgs.errors import SpecError
from pgs.runtime import process
from pgs.runtime.model.build import HIDDEN_METHOD, base_hidden
from pgs.runtime.model.layers import decoder_layers
from pgs.runtime.process import collective_device, is_distributed

#: Environment variable with the process-group timeout in seconds (default below).
TIMEOUT_ENV = "PGS_PG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
#: Name of the method :func:`shard_model` registers as an FSDP forward on the root.


@attrs.frozen
class DistContext:
    """Where this process stands: rank, world size, its device and the data-parallel mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, or None on one process
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None


#: Flight-recorder entries kept per rank (torch's own default is 0: off).
TRACE_BUFFER_SIZE = 2000
#: The folder of the run where the ranks' flight-recorder dumps go.
TRACE_DIR = "nccl_trace"


def flight_recorder_env(run_dir: str | None, environ=None, *, create: bool = False) -> dict[str, str]:
    """The environment entries that make every rank keep NCCL's flight recorder and dump it
    into ``<run_dir>/nccl_trace/rank_<r>`` when a collective times out (the watchdog's
    dump-on-timeout; ``PGS_PG_TIMEOUT_S`` is that timeout).  Only names absent from ``environ``
    are returned: a user's own setting wins.  ``create``: make the dump folder (the recorder
    writes its files but not their folder).  Buffer size: ``TORCH_FR_BUFFER_SIZE``; the dump file
    prefix: ``TORCH_FR_DUMP_TEMP_FILE``; the watchdog's monitor (``TORCH_NCCL_ENABLE_MONITORING``)
    must be on for the dump to be written.  Only these names are set (torch warns on every rank
    about the deprecated ``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``),
    but a user's setting under an old name still wins."""
    environ = process.environment() if environ is None else environ
    out: dict[str, str] = {}

    def default(names: tuple[str, ...], value: str) -> None:
        if not any(name in environ for name in names):
            out[names[0]] = value

    default(("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(TRACE_BUFFER_SIZE))
    default(("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")
    default(("TORCH_NCCL_ENABLE_MONITORING",), "1")
    if run_dir:
        prefix = os.path.join(os.path.abspath(run_dir), TRACE_DIR, "rank_")
        default(("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), prefix)
    if create:  # the folder of the prefix in force, ours or the environment's
        prefix = next((where.get(name) for where in (out, environ)
                       for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE") if where.get(name)), None)
        if prefix:
            os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    return out


def timeout_seconds(value: float | None = None) -> float:
    """The process-group timeout: ``value``, else ``$PGS_PG_TIMEOUT_S``, else 1800 s."""
    if value is None:
        raw = process.variable(TIMEOUT_ENV, "")
        try:
            value = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise SpecError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise SpecError(f"process-group timeout must be > 0 seconds, got {value!r}")
    return float(value)


def init(*, timeout_s: float | None = None, backend: str | None = None, device: str = "auto",
         single: bool = False, trace_dir: str | None = None) -> DistContext:
    """Open the default process group from the launcher's environment (idempotent).

    On one process (no ``WORLD_SIZE`` > 1) nothing is opened and the context has no mesh.
    ``backend``: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU by default.  ``timeout_s``: how
    long a collective may wait for its peers before the job fails (instead of hanging):
    ``$PGS_PG_TIMEOUT_S`` or 1800 s unless given.  ``single``: open a group and a mesh even
    for one process (under torchrun with one worker: the same FSDP2 path as with several).
    ``trace_dir``: the run folder; before the group opens, the flight recorder's settings that
    the environment lacks are set (:func:`flight_recorder_env`), so that a timeout dumps every
    rank's last collectives into ``<trace_dir>/nccl_trace/`` also under a plain torchrun.
    """
    place = process.layout()
    world, local = place.world_size, place.local_rank
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world <= 1 and not single and not dist.is_initialized():
        return DistContext(0, 1, 0, dev, None, None)
    backend = backend or ("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        if trace_dir is not None:
            process.set_variables(flight_recorder_env(trace_dir, create=True))
        kwargs: dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_seconds(timeout_s)))
        if use_cuda:
            kwargs["device_id"] = dev  # binds NCCL to this device at once (no lazy init)
        dist.init_process_group(**kwargs)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return DistContext(dist.get_rank(), dist.get_world_size(), local, dev, mesh, dist.get_backend())


def shutdown() -> None:
    """Close the default process group (every rank, at the end of a run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_count(n: int) -> int:
    """An integer (valid tokens of this rank's micro-batches) summed over the ranks.

    The denominator of the loss: every rank divides its summed token loss by this same
    global count, so that the summed gradients are the gradient of the global token mean.
    """
    return global_counts(n)[0]


def global_counts(*ns: int) -> tuple[int, ...]:
    """Several integers summed over the ranks in one all-reduce (``global_count`` of each)."""
    if not is_distributed():
        return tuple(int(n) for n in ns)
    t = torch.tensor([int(n) for n in ns], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return tuple(int(v) for v in t.tolist())


def all_true(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a MIN all-reduce; ``flag`` itself on one process)."""
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj):
    """``obj`` of rank 0 (picklable) on every rank; ``obj`` itself on one process."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), rank by rank, on every rank; ``[obj]`` on one process."""
    if not is_distributed():
        return [obj]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


# ----------------------------------------------------------------------------------------
# sharding


def mixed_precision_policy(mixed_precision: str | None):
    """``None``/``"fp32"``: parameters as stored.  ``"bf16"``: bf16 compute, fp32 gradient reduce."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision in (None, "fp32", "float32", "no"):
        return MixedPrecisionPolicy()
    if mixed_precision in ("bf16", "bfloat16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise SpecError(f"mixed_precision: {mixed_precision!r}, expected null, \"fp32\" or \"bf16\"")


def shard_model(model, mesh=None, *, mixed_precision: str | None = None, layers: list | None = None,
                reshard_layers: bool = True):
    """Shard ``model`` in place with FSDP2 and return it.  Call it on every rank.

    ``fully_shard`` on each decoder layer (the last one keeps its parameters after forward),
    then on the root (kept gathered through the chunked loss).  Gradients are SUMMED over the
    ranks (divide factor 1, see the module docstring).  A method :data:`HIDDEN_METHOD`
    (``model.pgs_final_hidden(input_ids, position_ids, embed_noise=None)``) is registered as
    an FSDP forward: it all-gathers the root and returns the final hidden states, which is
    what ``pgs.runtime.model.build.final_hidden`` calls.

    Args:
        model: a HF causal LM (or any module whose blocks ``layers`` lists).
        mesh: the 1-D data-parallel mesh (``DistContext.mesh``; default: all ranks).
        mixed_precision: None / "fp32" or "bf16" (bf16 parameters in compute, fp32 reduce).
        layers: the blocks to shard one by one (default ``pgs.runtime.model.layers.decoder_layers``).
        reshard_layers: free each layer's parameters after forward (False trades memory for
            one all-gather less per layer in backward).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    policy = mixed_precision_policy(mixed_precision)
    blocks = list(layers) if layers is not None else decoder_layers(model)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_layers and not last)
    setattr(model, HIDDEN_METHOD, types.MethodType(base_hidden, model))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    register_fsdp_forward_method(model, HIDDEN_METHOD)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # SUM collectives only: gloo has no PREMUL_SUM, NCCL is zero-copy only for SUM
            module.set_force_sum_reduction_for_comms(True)
    return model


def shard_frozen(model, mesh=None, *, layers: list | None = None):
    """Shard a frozen model (no gradients, no optimizer: a distillation teacher) in place and
    return it.  Call it on every rank.

    ``fully_shard`` on each decoder layer, every one freed after its forward (there is no
    backward to keep it for); the root (embeddings, final norm, output head) is not sharded and
    stays whole on every rank, because a loss applies the head chunk by chunk outside the
    model's forward (as the student's chunked loss does).  ``final_hidden`` then runs the base
    model as it is: each layer all-gathers its parameters just before it runs, a collective, so
    every rank must run the model the same number of times."""
    from torch.distributed.fsdp import fully_shard

    for block in (list(layers) if layers is not None else decoder_layers(model)):
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model) -> None:
    """Free every gathered parameter (after an eval forward: the root and the last layer keep
    theirs after forward, and an optimizer step must see sharded parameters only)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
