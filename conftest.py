"""Session-wide test setup (loaded before any test module imports triton).

On a machine without CUDA, Triton kernels can only run in Triton's CPU interpreter, and
``TRITON_INTERPRET=1`` must be set before the first ``@triton.jit`` is created: a kernel
module imported earlier in the same process would otherwise hold compiled (unusable) helper
functions.  Setting it here, once, makes the kernel tests independent of test order under
``pytest -n 2``.  Nothing takes the Triton path on CPU unless a test asks for it
(``backend="triton"`` for the 8-bit kernels, ``PGS_TRITON_ON_CPU=1`` for the fused
AdamW/Lion kernels).
"""

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False

if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
