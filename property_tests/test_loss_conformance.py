"""Conformance of batched losses (``registry_losses.ENTRIES``), over random batches:

- purity: the inputs are left untouched;
- determinism: two calls give bitwise equal outputs;
- dtypes: outputs are fp32 for fp32/bf16 inputs, fp64 for fp64; all finite;
- gradients: the first output's sum has finite gradients for the declared inputs, and under
  ``torch.no_grad`` the outputs are the same values and need no gradient;
- batching: cutting the batch in two and combining the parts' outputs gives the whole
  batch's (per pair for preference losses, summed per sequence for sequence_logps).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from registry_losses import ENTRIES, REQUIRED, Inputs, LossEntry

per_entry = pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])


def draw(data, entry: LossEntry, min_n: int = 1) -> tuple[Inputs, int]:
    n = data.draw(st.integers(min_n, 6), label="n")
    dtype = data.draw(st.sampled_from(entry.dtypes), label="dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    return entry.draw(gen, n, dtype), n


def tensors(inp: Inputs):
    return [a for a in (*inp.args, *inp.kwargs.values()) if isinstance(a, torch.Tensor)]


def test_every_loss_name_is_registered():
    covered = {c for e in ENTRIES for c in e.covers}
    assert not set(REQUIRED) - covered, f"not registered in registry_losses.py: {sorted(set(REQUIRED) - covered)}"
    assert len({e.name for e in ENTRIES}) == len(ENTRIES)


@per_entry
@given(data=st.data())
def test_pure_deterministic_typed_finite(entry: LossEntry, data):
    inp, _ = draw(data, entry)
    before = [t.clone() for t in tensors(inp)]
    a = entry.fn(*inp.args, **inp.kwargs)
    b = entry.fn(*inp.args, **inp.kwargs)
    for x, y in zip(tensors(inp), before):
        assert torch.equal(x, y), "the loss changed an input"
    dtype = torch.float64 if inp.args[0].dtype == torch.float64 else torch.float32
    for x, y in zip(a, b):
        if x.is_floating_point():
            assert x.dtype == dtype, f"output dtype {x.dtype}, expected {dtype}"
            assert torch.isfinite(x).all()
        assert torch.equal(x, y), "two calls differ"


@per_entry
@given(data=st.data())
def test_gradients_finite_and_no_grad_agrees(entry: LossEntry, data):
    inp, _ = draw(data, entry)
    args = list(inp.args)
    for i in inp.grad:
        args[i] = args[i].detach().clone().requires_grad_()
    out = entry.fn(*args, **inp.kwargs)
    grads = torch.autograd.grad(out[0].sum(), [args[i] for i in inp.grad])
    for i, g in zip(inp.grad, grads):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype
        assert torch.isfinite(g).all()
    with torch.no_grad():
        quiet = entry.fn(*inp.args, **inp.kwargs)
    for x, y in zip(quiet, out):
        assert not x.requires_grad
        torch.testing.assert_close(x, y.detach(), rtol=0, atol=0)


@per_entry
@given(data=st.data())
def test_batch_split_combines(entry: LossEntry, data):
    inp, n = draw(data, entry, min_n=2)
    k = data.draw(st.integers(1, n - 1), label="k")
    first, rest = entry.split(inp, k)
    whole = entry.fn(*inp.args, **inp.kwargs)
    parts = entry.combine(entry.fn(*first.args, **first.kwargs), entry.fn(*rest.args, **rest.kwargs))
    low = inp.args[0].dtype == torch.bfloat16
    for x, y in zip(parts, whole):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-2 if low else 1e-6, atol=1e-2 if low else 1e-6)
        else:
            assert torch.equal(x, y)
