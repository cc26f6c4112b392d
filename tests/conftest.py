"""Fixtures shared by the test modules of this folder."""

import pytest
import torch


@pytest.fixture
def kernels_on(monkeypatch):
    """Route the chunked loss through its Triton passes: compiled on CUDA, else the interpreter.

    Returns the device the test should use."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("PGS_TRITON_ON_CPU", "1")
    monkeypatch.setenv("PGS_CE_KERNELS", "1")
    return "cuda" if torch.cuda.is_available() else "cpu"
