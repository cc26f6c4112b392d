"""``[parallel]``: the process layout's typed config (``pgs.runtime.dist``)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from pgs.runtime.spec.fields import int_at_least, one_of


@attrs.frozen
class ParallelSpec:
    """``[parallel]``: how the processes of ``pgs run --nproc N`` share the work (docs/distributed.md).

    ``context``: ranks that split each packed row along the sequence (context parallelism,
    ring attention, ``pgs.runtime.dist.context``); it must divide the number of processes, the
    rest is data parallelism (``N / context`` ranks, each with its own rows).  ``layout``:
    ``"zigzag"`` (rank r holds chunks r and 2·context−1−r of the row: equal causal work) or
    ``"contiguous"``.
    """

    section: ClassVar[str] = "parallel"

    context: int = attrs.field(default=1, validator=int_at_least(1))
    layout: str = attrs.field(default="zigzag", validator=one_of(("zigzag", "contiguous")))

