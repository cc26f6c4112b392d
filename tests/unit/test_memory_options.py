"""``pf.MemoryOptions``: the memory trade-offs below the binder as one typed record, made from
``[memory]`` by ``MemorySpec.options()`` and checked where it enters."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.func.losses import sequence_logps, token_loss
from pgs.runtime.optim import make_optimizer
from pgs.runtime.optim.bound import BoundOptimizer
from pgs.runtime.optim.config import MemorySpec
from pgs.runtime.optim.release import GradientRelease


def test_default_is_no_trade_off_and_fields_are_checked():
    assert pf.NO_MEMORY_OPTIONS == pf.MemoryOptions()
    assert pf.MemoryOptions() == pf.MemoryOptions(stochastic_rounding=False, defer_head_grad=False, tied_slabs=0)
    assert pf.MemoryOptions(tied_slabs=8).evolve(stochastic_rounding=True) == \
        pf.MemoryOptions(stochastic_rounding=True, tied_slabs=8)
    with pytest.raises(InvalidArgument, match="MemoryOptions.stochastic_rounding must be True or False"):
        pf.MemoryOptions(stochastic_rounding=1)
    with pytest.raises(InvalidArgument, match="MemoryOptions.defer_head_grad"):
        pf.MemoryOptions(defer_head_grad="auto")
    for bad in (-1, True, 2.0):
        with pytest.raises(InvalidArgument, match="MemoryOptions.tied_slabs must be an int >= 0"):
            pf.MemoryOptions(tied_slabs=bad)


def test_memory_spec_options_resolve_auto():
    assert MemorySpec().options() == pf.NO_MEMORY_OPTIONS
    assert MemorySpec(gradient_release=True, activation_checkpointing="full").options().defer_head_grad
    opts = MemorySpec(gradient_release=True, tied_slabs=64, stochastic_rounding=True).options()
    assert opts == pf.MemoryOptions(stochastic_rounding=True, defer_head_grad=True, tied_slabs=64)
    assert not MemorySpec(gradient_release=True, tied_slabs=64, defer_head_grad=False).options().defer_head_grad


def test_make_optimizer_hands_the_spec_options_to_the_binder():
    model = torch.nn.Linear(4, 4)
    opt = make_optimizer(pf.lion(1e-3), model, MemorySpec(stochastic_rounding=True))
    assert opt.memory == MemorySpec(stochastic_rounding=True).options()
    rel = make_optimizer(pf.lion(1e-3), model, MemorySpec(gradient_release=True, activation_checkpointing="full"))
    assert rel.memory.defer_head_grad and not rel.memory.stochastic_rounding


def test_entry_points_refuse_what_is_not_memory_options():
    h, W, labels = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([1, 2, -100])
    with pytest.raises(InvalidArgument, match="token_loss: memory must be a pgs.func.MemoryOptions, got bool"):
        token_loss(h, W, labels, memory=True)
    with pytest.raises(InvalidArgument, match="sequence_logps: memory must be a pgs.func.MemoryOptions"):
        sequence_logps(h, W, labels, torch.zeros(3, dtype=torch.long), 1, memory={"defer_head_grad": True})
    with pytest.raises(InvalidArgument, match="apply_updates: memory must be"):
        pf.apply_updates({"w": W}, {"w": W}, memory="sr")
    with pytest.raises(InvalidArgument, match="compile: memory must be"):
        pf.compile(pf.lion(1e-3), memory=True)


def test_binders_that_cannot_step_slabs_refuse_them():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidArgument, match="bind: memory.tied_slabs=8: .*GradientRelease"):
        BoundOptimizer(pf.lion(1e-3), model, memory=pf.MemoryOptions(tied_slabs=8))
    rel = GradientRelease(pf.lion(1e-3), model, memory=pf.MemoryOptions(stochastic_rounding=True))
    assert rel.memory.stochastic_rounding and rel.rounding("weight", rel.states[rel._group_of["weight"]])["memory"] \
        is rel.memory
    rel.remove()
