"""NEFTune and symmetric embedding noise (docs/techniques/noise.md)."""

from __future__ import annotations

import math

import pytest
import torch

from pgs.errors import InvalidArgument
from pgs.func.losses import neftune, symnoise


@pytest.mark.parametrize("fn,var_factor", [(neftune, 1 / 3), (symnoise, 1.0)])
def test_noise_moments(fn, var_factor):
    alpha, seq, d = 5.0, 64, 128
    e = torch.zeros(32, seq, d)
    noise = fn(e, alpha, generator=torch.Generator().manual_seed(0), training=True)
    scale2 = alpha**2 / (seq * d)
    assert abs(float(noise.mean())) < 0.02 * math.sqrt(scale2)
    assert float(noise.var()) == pytest.approx(scale2 * var_factor, rel=0.02)


def test_generator_makes_noise_reproducible_and_gradient_is_identity():
    e = torch.randn(2, 5, 8, requires_grad=True)
    a = neftune(e, 10.0, generator=torch.Generator().manual_seed(3), training=True)
    b = neftune(e, 10.0, generator=torch.Generator().manual_seed(3), training=True)
    assert torch.equal(a, b)
    (grad,) = torch.autograd.grad(a.sum(), e)
    assert torch.equal(grad, torch.ones_like(e))


def test_lengths_use_the_true_length_and_leave_padding_alone():
    e = torch.zeros(2, 10, 4)
    lengths = torch.tensor([10, 4])
    noisy = neftune(e, 8.0, generator=torch.Generator().manual_seed(0), training=True, lengths=lengths)
    assert float(noisy[1].abs().max()) <= 8.0 / math.sqrt(4 * 4) + 1e-6
    assert float(noisy[1, :4].abs().max()) > 8.0 / math.sqrt(10 * 4)  # larger than the padded scale
    assert torch.count_nonzero(noisy[1, 4:]) == 0
    padded = symnoise(e, 8.0, generator=torch.Generator().manual_seed(0), training=True)
    assert torch.allclose(padded.abs(), torch.full_like(e, 8.0 / math.sqrt(40)))


def test_bf16_keeps_dtype_and_bad_arguments_are_refused():
    e = torch.randn(1, 3, 4, dtype=torch.bfloat16)
    assert neftune(e, 5.0, generator=None, training=True).dtype == torch.bfloat16
    with pytest.raises(InvalidArgument, match="alpha"):
        neftune(e, -1.0, generator=None, training=True)
    with pytest.raises(InvalidArgument, match="lengths"):
        symnoise(e, 1.0, generator=None, training=True, lengths=torch.tensor([1, 2]))
