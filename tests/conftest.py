"""Fixtures shared by the test modules of this folder (their shared functions: helpers.py)."""

import sys
from pathlib import Path

import pytest
import torch

# ``from helpers import ...`` in the test modules, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))


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
