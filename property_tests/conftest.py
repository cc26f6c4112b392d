"""Hypothesis profiles for the property tests.

``pgs`` (default): derandomized (the same examples on every run, so a failure reproduces),
no deadline (the first call of a transform pays for lazy imports and kernel selection), a
modest example count so that the whole folder runs in a few minutes on 2 CPU cores.
``thorough``: many more examples, for a nightly run: ``HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

# ``import registry`` from the test modules, whatever pytest's import mode; ``from tiny import ...``:
# the tiny random-init models of tests/tiny.py.
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

# pytest -n 2 on 2 cores: one intra-op thread per worker avoids oversubscription, and the
# tensors here are tiny anyway.
torch.set_num_threads(1)

_common = dict(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("pgs", max_examples=12, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "pgs"))
