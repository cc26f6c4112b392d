"""Keep Triton out of a process that cannot run a Triton kernel.

Triton's bindings (nanobind) report every type and function of the module as "leaked" when the
interpreter exits (about 30 lines of ``nanobind: leaked ...`` at the end of every CPU run), and
importing Triton is not pgs's doing alone: building any transformers model imports
``torch._dynamo``, which imports Triton whenever it is installed.  On a host without a CUDA
device, and without Triton's interpreter (``TRITON_INTERPRET=1``, what the kernel tests use),
no Triton kernel can run, so the ``pgs`` command marks the module unavailable for its process
(``sys.modules["triton"] = None``: ``import triton`` raises ``ImportError``, as on an install
without it, and torch and pgs take their non-Triton paths).  Only the process entry points
(``pgs`` and ``python -m pgs``) do this; importing pgs as a library changes nothing.
"""

from __future__ import annotations

import sys

from pgs.func.kernels.kernel_config import interpret_requested


def keep_triton_out() -> bool:
    """Make ``import triton`` fail in this process when no Triton kernel could run in it;
    returns whether it did.  A no-op once Triton is imported, with ``TRITON_INTERPRET=1``, or
    where CUDA is available."""
    if "triton" in sys.modules or interpret_requested():
        return False
    import torch

    if torch.cuda.is_available():
        return False
    sys.modules["triton"] = None
    return True
