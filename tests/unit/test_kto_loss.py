"""kto_loss and kto_reference_point (KTO, arXiv 2402.01306): values by hand, equality with a
transcription of the paper's equations written here independently (values and gradients, the
reference point estimated over mismatched prompt/completion pairs), fp64 gradcheck, the errors.

TRL's KTO loss is a method of its trainer (it needs ``accelerate`` and ``datasets``, which this
environment does not have), so the trusted reference is the transcription below."""

from __future__ import annotations

import math

import pytest
import torch

from pgs.errors import InvalidArgument
from pgs.func.losses import (RECOMMENDED_RATIO, kto_accuracy, kto_loss, kto_reference_point,
                             kto_weight_ratio)

F64 = torch.float64


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def paper_kto(policy, ref, kl_policy, kl_ref, labels, beta, lam_d, lam_u):
    """The paper's L_KTO per example, in plain Python floats: r = log π/π_ref;
    z0 = max(0, mean over the mismatched pairs of log π(y'|x)/π_ref(y'|x));
    v = λ_D σ(β(r − z0)) if desirable else λ_U σ(β(z0 − r)); loss = λ_y − v."""
    z0 = max(0.0, sum(a - b for a, b in zip(kl_policy, kl_ref)) / len(kl_policy))
    out = []
    for p, q, good in zip(policy, ref, labels):
        r = p - q
        if good:
            out.append(lam_d - lam_d * sigmoid(beta * (r - z0)))
        else:
            out.append(lam_u - lam_u * sigmoid(beta * (z0 - r)))
    return out, z0


def test_hand_values():
    # desirable: r = −10 − (−11) = 1, z = 0.5: λ_D(1 − σ(0.1·0.5)); undesirable: r = 0: λ_U(1 − σ(0.1·0.5))
    out = kto_loss(torch.tensor([-10.0, -4.0]), torch.tensor([-11.0, -4.0]), torch.tensor([True, False]),
                   torch.tensor(0.5), beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    expected = [2.0 * (1 - sigmoid(0.05)), 0.5 * (1 - sigmoid(0.05))]
    torch.testing.assert_close(out.loss, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.rewards, torch.tensor([0.1, 0.0]))
    # β·z = 0.05: the desirable reward 0.1 is above it, the undesirable reward 0 below it: both right
    assert kto_accuracy(out, 0.1).tolist() == [1.0, 1.0]


def test_accuracy_sides_of_the_reference_point():
    out = kto_loss(torch.tensor([-10.0, -10.0, -10.0, -10.0]), torch.tensor([-11.0, -9.0, -11.0, -9.0]),
                   torch.tensor([True, True, False, False]), 0.0, beta=1.0)
    assert kto_accuracy(out, 1.0).tolist() == [1.0, 0.0, 0.0, 1.0]
    tie = kto_loss(torch.tensor([-3.0, -3.0]), torch.tensor([-3.0, -3.0]), torch.tensor([True, False]), 0.0)
    assert kto_accuracy(tie, 0.1).tolist() == [0.5, 0.5]


@pytest.mark.parametrize("beta,lam_d,lam_u", [(0.1, 1.0, 1.0), (0.5, 1.33, 1.0), (2.0, 1.0, 0.7)])
def test_equals_the_papers_equations_values_and_gradients(beta, lam_d, lam_u):
    g = torch.Generator().manual_seed(7)
    n = 9
    policy = -torch.rand(n, generator=g, dtype=F64) * 30 - 0.5
    ref = policy + torch.randn(n, generator=g, dtype=F64) * 3
    labels = torch.rand(n, generator=g) < 0.5
    # the mismatched pairs: prompt i with the completion of example (i + 1) mod n
    kl_policy = -torch.rand(n, generator=g, dtype=F64) * 30 - 0.5
    kl_ref = kl_policy - torch.rand(n, generator=g, dtype=F64) * 2  # the policy drifted up: z0 > 0
    expected, z0 = paper_kto(policy.tolist(), ref.tolist(), kl_policy.tolist(), kl_ref.tolist(), labels.tolist(),
                             beta, lam_d, lam_u)
    assert z0 > 0
    x = policy.clone().requires_grad_()
    kl = kl_policy.clone().requires_grad_()
    z = kto_reference_point(kl, kl_ref)
    out = kto_loss(x, ref, labels, z, beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u)
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
    assert float(z) == pytest.approx(z0, rel=1e-12)
    out.loss.sum().backward()
    # d/dr of λ(1 − σ(s·β(r − z))) = −λ·s·β·σ'(·), s = ±1; z carries no gradient
    for i in range(n):
        s = 1.0 if labels[i] else -1.0
        lam = lam_d if labels[i] else lam_u
        a = beta * s * (float(policy[i] - ref[i]) - z0)
        assert float(x.grad[i]) == pytest.approx(-lam * s * beta * sigmoid(a) * (1 - sigmoid(a)), rel=1e-10)
    assert kl.grad is None  # the reference point is detached


def test_reference_point_clamped_at_zero_and_detached():
    kl = torch.tensor([-5.0, -6.0], requires_grad=True)
    z = kto_reference_point(kl, torch.tensor([-4.0, -4.0]))  # the policy fell below the reference: mean −1.5
    assert float(z) == 0.0 and not z.requires_grad
    assert float(kto_reference_point(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -5.0]))) == 0.5
    assert float(kto_reference_point(torch.zeros(0), torch.zeros(0))) == 0.0


def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(3)
    x = (-torch.rand(6, generator=g, dtype=F64) * 10).requires_grad_()
    ref = -torch.rand(6, generator=g, dtype=F64) * 10
    labels = torch.tensor([True, False, True, True, False, False])
    assert torch.autograd.gradcheck(
        lambda v: kto_loss(v, ref, labels, 0.3, beta=0.7, desirable_weight=1.2, undesirable_weight=0.8).loss, (x,))


def test_weight_ratio():
    assert kto_weight_ratio(600, 400) == 1.5
    assert kto_weight_ratio(600, 400, 1.0, 1.5) == 1.0
    assert kto_weight_ratio(3, 0) == math.inf
    assert RECOMMENDED_RATIO == (1.0, 4.0 / 3.0)


@pytest.mark.parametrize("call,match", [
    (lambda: kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), 0.0, beta=0.0), "beta"),
    (lambda: kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), 0.0,
                      desirable_weight=-1.0), "desirable_weight"),
    (lambda: kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), 0.0,
                      undesirable_weight=0.0), "undesirable_weight"),
    (lambda: kto_loss(torch.zeros(2), torch.zeros(3), torch.ones(2, dtype=torch.bool), 0.0), "ref_logps"),
    (lambda: kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 0.0), "bool"),
    (lambda: kto_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool), 0.0), "1-D"),
    (lambda: kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), -0.1), "reference_point"),
    (lambda: kto_reference_point(torch.zeros(2), torch.zeros(3)), "ref_kl_logps"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()
