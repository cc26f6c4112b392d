"""``[checkpoint]``: the checkpointer's typed config (``pgs.runtime.loop.checkpointer``)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from pgs.runtime.spec.fields import boolean, int_at_least, string


@attrs.frozen
class CheckpointSpec:
    """``[checkpoint]``: where and how often; ``keep`` newest periodic ones (0 keeps all).

    ``best_metric`` (``""`` disables) also keeps the best checkpoint by that eval metric
    (lower is better unless the name contains ``accuracy``); it needs ``data.eval``.
    ``export`` writes a plain HF folder (config + safetensors + tokenizer) at the end;
    ``max_shard_size`` (``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes) is its largest weights
    file: larger models are sharded with an index, as ``save_pretrained`` does.
    ``background`` writes each periodic checkpoint on a thread from a host snapshot while
    training goes on (``pgs.runtime.store.background``; host memory for one checkpoint, or
    each rank's shards with several processes); stops, halts and the last step still save in
    the foreground.  ``last`` (default true) saves ``step_<N>`` after the last step; false
    leaves a run that is only measured or thrown away without a checkpoint at its end (periodic
    saves, stops and halts still save), and its disk is then not asked for one.
    """

    section: ClassVar[str] = "checkpoint"

    dir: str = attrs.field(default="runs/run", validator=string)
    every: int = attrs.field(default=100, validator=int_at_least(0))
    keep: int = attrs.field(default=2, validator=int_at_least(0))
    best_metric: str = attrs.field(default="eval_loss", validator=string)
    export: bool = attrs.field(default=True, validator=boolean)
    max_shard_size: str | int = attrs.field(default="5GB", validator=lambda _s, _a, v: _shard_size(v))
    background: bool = attrs.field(default=False, validator=boolean)
    last: bool = attrs.field(default=True, validator=boolean)


def _shard_size(value) -> None:
    from pgs.runtime.store.export import parse_size

    parse_size(value)
