"""The runtime's one optimizer interface (pgs/runtime/optim/interface.py): make_optimizer picks
the binder from [memory]; every binder answers the Optimizer protocol with typed metrics."""

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument, SpecError
from pgs.runtime.optim import (BoundOptimizer, GradientRelease, Optimizer, ShardedBoundOptimizer, StepMetrics,
                               make_optimizer)
from pgs.runtime.spec.sections import MemorySpec


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def chain(clip=False):
    stages = [pf.clip_by_global_norm(1.0)] if clip else []
    return pf.chain(*stages, pf.scale_by_adam(), pf.scale_by_learning_rate(1e-2))


@pytest.mark.parametrize("release, sharded, kind", [(False, False, BoundOptimizer), (True, False, GradientRelease),
                                                     (False, True, ShardedBoundOptimizer)])
def test_make_optimizer_picks_the_binder_and_it_is_an_optimizer(release, sharded, kind):
    opt = make_optimizer(chain(), model(), MemorySpec(gradient_release=release), sharded=sharded)
    assert type(opt) is kind and isinstance(opt, Optimizer)
    assert opt.in_backward == release
    assert isinstance(opt.metrics(), StepMetrics) and opt.state_bytes() > 0


def test_several_processes_refuse_tied_slabs():
    with pytest.raises(SpecError, match="memory.tied_slabs"):
        make_optimizer(chain(), model(), MemorySpec(gradient_release=True, tied_slabs=64), sharded=True)


def test_metrics_are_what_the_chain_declares():
    """lr from scale_by_learning_rate's state, the pre-clip norm from the clip's; a chain
    without a clip reports no grad_norm (the loop then measures it)."""
    m = model()
    opt = make_optimizer(chain(clip=True), m, MemorySpec())
    m(torch.ones(3, 4)).sum().backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])))
    opt.step()
    got = opt.metrics()
    assert got.lr == pytest.approx(1e-2) and got.grad_norm == pytest.approx(expected, rel=1e-5)
    assert got.spike is False and got.spikes_skipped is None
    assert make_optimizer(chain(), model(), MemorySpec()).metrics().grad_norm is None


def test_before_step_adds_a_contribution_to_the_next_step_only():
    """BoundOptimizer.before_step: the contribution joins the gradient at the next step(), equal to
    a gradient that had it already; zero_grad drops a pending one; a stranger is refused."""
    a, b = model(), model()
    opt_a, opt_b = make_optimizer(chain(), a, MemorySpec()), make_optimizer(chain(), b, MemorySpec())
    extra = torch.full_like(a[0].weight, 0.5)
    for m in (a, b):
        m(torch.ones(3, 4)).sum().backward()
    a[0].weight.grad.add_(extra)
    opt_b.before_step(b[0].weight, lambda g: g.add_(extra))
    opt_a.step(), opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt_b.before_step(b[0].weight, lambda g: g.add_(1e6))
    opt_a.zero_grad(), opt_b.zero_grad()  # drops b's pending contribution
    for m, opt in ((a, opt_a), (b, opt_b)):
        m(torch.ones(3, 4)).sum().backward()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(InvalidArgument, match="not one of the bound parameters"):
        opt_b.before_step(torch.nn.Parameter(torch.ones(2)), lambda g: None)
