"""Hypothesis tests of KTO's invariants (arXiv 2402.01306; docs/techniques/kto.md).

Per example: the loss lies in (0, λ_y); it is λ_y/2 exactly at r = z_ref; a desirable
example's loss falls as its log-ratio r rises, an undesirable one's rises; relabelling an
example and reflecting r about z_ref leaves the loss (equal weights) unchanged; only
log-ratios matter (a common shift of policy and reference log-probs changes nothing) and a
common shift of r and z_ref changes nothing; the weights scale each side linearly.  The
reference point is ≥ 0, detached, and the mean log-ratio of the mismatched pairs where that
is positive.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pgs.func.losses import kto_loss, kto_reference_point

FAST = settings(max_examples=30, deadline=None)
F64 = torch.float64

seeds = st.integers(0, 2**31 - 1)
betas = st.floats(0.01, 5.0)
weights = st.floats(0.1, 5.0)


def draw(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(n, generator=g, dtype=F64) * 40 - 1e-3
    ref = -torch.rand(n, generator=g, dtype=F64) * 40 - 1e-3
    labels = torch.rand(n, generator=g) < 0.5
    z = float(torch.rand((), generator=g, dtype=F64) * 3)
    return x, ref, labels, z


@FAST
@given(seed=seeds, beta=betas, ld=weights, lu=weights)
def test_bounded_by_the_weights(seed, beta, ld, lu):
    x, ref, labels, z = draw(seed, 12)
    loss = kto_loss(x, ref, labels, z, beta=beta, desirable_weight=ld, undesirable_weight=lu).loss
    cap = torch.where(labels, torch.tensor(ld, dtype=F64), torch.tensor(lu, dtype=F64))
    assert (loss >= 0).all() and (loss <= cap).all()


@FAST
@given(ref=st.floats(-100.0, -0.1), z=st.floats(0.0, 5.0), beta=betas, ld=weights, lu=weights)
def test_half_the_weight_at_the_reference_point(ref, z, beta, ld, lu):
    x = torch.tensor([ref + z, ref + z], dtype=F64)
    out = kto_loss(x, torch.tensor([ref, ref], dtype=F64), torch.tensor([True, False]), z, beta=beta,
                   desirable_weight=ld, undesirable_weight=lu)
    torch.testing.assert_close(out.loss, torch.tensor([ld / 2, lu / 2], dtype=F64), rtol=1e-9, atol=1e-9)


@FAST
@given(rs=st.lists(st.floats(-30.0, 30.0), min_size=2, max_size=16, unique=True), z=st.floats(0.0, 5.0), beta=betas)
def test_monotone_in_the_log_ratio(rs, z, beta):
    r = torch.tensor(sorted(rs), dtype=F64)
    zero = torch.zeros_like(r)
    good = kto_loss(r, zero, torch.ones_like(r, dtype=torch.bool), z, beta=beta).loss
    bad = kto_loss(r, zero, torch.zeros_like(r, dtype=torch.bool), z, beta=beta).loss
    assert (good[1:] <= good[:-1]).all() and (bad[1:] >= bad[:-1]).all()
    # strictly, where the logistic has not saturated in fp64
    assert (good[1:] < good[:-1]).any() or beta * (float(r[-1]) - float(r[0])) < 1e-9


@FAST
@given(seed=seeds, beta=betas)
def test_relabel_and_reflect_about_the_reference_point(seed, beta):
    x, ref, labels, z = draw(seed, 10)
    mirrored = ref + 2 * z - (x - ref)  # r' = 2z − r
    a = kto_loss(x, ref, labels, z, beta=beta).loss
    b = kto_loss(mirrored, ref, ~labels, z, beta=beta).loss
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@FAST
@given(seed=seeds, beta=betas, shift=st.floats(-20.0, 20.0), up=st.floats(0.0, 5.0))
def test_only_log_ratios_and_their_distance_to_z_matter(seed, beta, shift, up):
    x, ref, labels, z = draw(seed, 10)
    base = kto_loss(x, ref, labels, z, beta=beta)
    moved = kto_loss(x + shift, ref + shift, labels, z, beta=beta)
    torch.testing.assert_close(moved.loss, base.loss, rtol=1e-9, atol=1e-12)
    raised = kto_loss(x + up, ref, labels, z + up, beta=beta)
    torch.testing.assert_close(raised.loss, base.loss, rtol=1e-7, atol=1e-10)


@FAST
@given(seed=seeds, beta=betas, ld=weights, lu=weights)
def test_weights_scale_each_side(seed, beta, ld, lu):
    x, ref, labels, z = draw(seed, 10)
    unit = kto_loss(x, ref, labels, z, beta=beta).loss
    weighted = kto_loss(x, ref, labels, z, beta=beta, desirable_weight=ld, undesirable_weight=lu).loss
    scale = torch.where(labels, torch.tensor(ld, dtype=F64), torch.tensor(lu, dtype=F64))
    torch.testing.assert_close(weighted, unit * scale, rtol=1e-9, atol=1e-12)


@FAST
@given(seed=seeds, n=st.integers(1, 12))
def test_reference_point_is_the_clamped_mean_log_ratio(seed, n):
    g = torch.Generator().manual_seed(seed)
    kl = (-torch.rand(n, generator=g, dtype=F64) * 40).requires_grad_()
    ref = -torch.rand(n, generator=g, dtype=F64) * 40
    z = kto_reference_point(kl, ref)
    mean = float((kl.detach() - ref).mean())
    assert not z.requires_grad and float(z) >= 0
    assert float(z) == (mean if mean > 0 else 0.0) or abs(float(z) - mean) < 1e-12
    # the mean over the examples: permuting the mismatched pairs changes nothing
    perm = torch.randperm(n, generator=g)
    torch.testing.assert_close(kto_reference_point(kl[perm], ref[perm]), z, rtol=1e-12, atol=1e-12)
