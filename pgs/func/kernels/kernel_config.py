"""The kernel configuration: one frozen object instead of environment variables.

Every Triton path of ``pgs.func`` reads the settings below from ``pgs.func.kernels.CONFIG``
at call time (never at import), so a test or a caller changes them by passing another
``KernelConfig``: ``pgs.func.kernels.configure(triton_on_cpu=True)`` or, scoped,
``with pgs.func.kernels.using(KernelConfig(fp_fusion=False)): ...``.

The defaults are the measured choices (docs/performance.md); the launch geometry (blocks per
program, warps) is fixed in the kernels' modules, not configurable.
"""

from __future__ import annotations

import os

import attrs


def interpret_requested() -> bool:
    """Whether this process asked Triton for its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton's own switch, fixed when Triton starts: the one place pgs reads it (the kernels'
    plain-Triton twins, the CPU paths of the Triton kernels, and ``pgs.runtime.triton_gate``
    ask here), so that no other module of pgs reads the environment.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@attrs.frozen
class KernelConfig:
    """Settings of the fused Triton kernels.

    Attributes:
        triton_on_cpu: run the Triton kernels on CPU tensors in Triton's interpreter (which
            needs ``TRITON_INTERPRET=1`` in the environment before Triton compiles anything).
            Slow: for tests at tiny sizes.  Off: CPU tensors take the torch paths.
        ce_kernels: the chunked cross-entropy's Triton passes (``pgs.func.losses.chunked``);
            False takes the torch path everywhere.
        fp_fusion: let the compiler contract a multiply and an add into one FMA (Triton's
            default).  It does so per element position and per kernel body, so an unmasked
            and a masked body, or two launches of one buffer, may round a value differently
            by an ulp.  False: no contraction (explicit ``tl.math.fma`` stays), every body
            agrees bit for bit on a GPU as in the interpreter, at a few more instructions per
            element.  Passed to every launch explicitly: Triton 3.9 warns that its default
            changes in 3.10, which would silently change the kernels' rounding.
        small_kernel: gradient release's small fp32-state Lion8bit leaves (norm weights) in
            one Triton launch per ≤ 4 leaves (``kernels/small.py``) instead of ~10
            multi-tensor torch ops.
        fast_launch: on a GPU, launch the 8-bit step kernels through a cache of their
            compiled kernels instead of ``kernel[grid](...)``, whose argument binding and
            cache key cost host time per call (gradient release launches one per tensor
            inside backward, where the host is the bottleneck).
        split: full programs of the 8-bit kernels run an unmasked copy of the body, only the
            last one the masked copy.  False runs the masked copy everywhere (the tests
            compare the two).
    """

    triton_on_cpu: bool = False
    ce_kernels: bool = True
    fp_fusion: bool = True
    small_kernel: bool = True
    fast_launch: bool = True
    split: bool = True

    def evolve(self, **changes) -> "KernelConfig":
        """A copy with ``changes`` applied."""
        return attrs.evolve(self, **changes)
