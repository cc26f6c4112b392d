"""Fixtures shared by the test modules under this folder (their shared functions: helpers.py; the
tiny random models they build: tiny.py).

Layout: ``unit/`` holds fast in-process tests of one component; ``integration/`` the tests that
train through the loop or ``pgs run``, start processes or several ranks, inject faults, or run a
bench suite's smoke shape (and the rank-side harnesses those start by path)."""

import sys
from pathlib import Path

import pytest
import torch

# ``from helpers import ...`` and ``from test_<module> import ...`` (a test module reusing another's
# setup, across unit/ and integration/) in the test modules, whatever pytest's import mode.
HERE = Path(__file__).parent
for _folder in (HERE / "integration", HERE / "unit", HERE):
    sys.path.insert(0, str(_folder))


@pytest.fixture
def kernels_on(monkeypatch):
    """Route the chunked loss through its Triton passes: compiled on CUDA, else the interpreter.

    Returns the device the test should use."""
    from pgs.func import kernels

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(kernels, "CONFIG", kernels.CONFIG.evolve(triton_on_cpu=True))
    monkeypatch.setattr(kernels, "CONFIG", kernels.CONFIG.evolve(ce_kernels=True))
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def one_thread():
    """One torch thread for the test (in-process runs compared bit for bit, on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
