"""The tied head's gradient deferred into the embedding's hook (``token_loss(...,
defer_head_grad=True)`` + ``GradientRelease.before_step``) equals the plain chunked loss."""

from __future__ import annotations

import pytest
import torch

import pgs.func as pf
from pgs.func.losses import token_loss
from pgs.runtime.optim.bound import bind
from pgs.runtime.model.build import final_hidden, output_head
from pgs.runtime.optim.release import GradientRelease
from test_release import VOCAB, batches, tiny_model


def step_loss(model, ids, release=None):
    h = final_hidden(model, ids, torch.arange(ids.shape[1]).expand_as(ids))
    W, bias, softcap = output_head(model)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    defer = release is not None
    r = token_loss(h, W, labels, bias=bias, softcap=softcap, chunk_size=7, memory=pf.MemoryOptions(defer_head_grad=defer))
    if defer:
        seen = {}
        release.before_step(W, lambda g: (seen.setdefault("emb_part", g.clone()), r.head_grad.add_to(g)))
        (r.loss_sum / r.num_valid).backward()
        return seen
    (r.loss_sum / r.num_valid).backward()
    return None


def test_deferred_equals_plain_over_steps():
    data = batches(3)
    a, b = tiny_model(), tiny_model()
    opt = bind(pf.adamw(1e-2, weight_decay=0.1), a)
    rel = GradientRelease(pf.adamw(1e-2, weight_decay=0.1), b)
    for ids in data:
        step_loss(a, ids)
        opt.step()
        opt.zero_grad()
        seen = step_loss(b, ids, rel)
        # the hook saw only the embedding's part: the head's was not handed to autograd
        used = torch.zeros(VOCAB, dtype=torch.bool)
        used[ids.reshape(-1)] = True
        assert seen["emb_part"][~used].abs().max() == 0
        assert all(p.grad is None for p in b.parameters())
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    assert rel.counts() == {3}


def test_before_step_refuses_strangers_and_zero_grad_drops():
    model = tiny_model()
    rel = GradientRelease(pf.sgd(1e-2), model)
    with pytest.raises(Exception, match="not one of"):
        rel.before_step(torch.nn.Parameter(torch.ones(2)), lambda g: None)
    called = []
    rel.before_step(model.model.embed_tokens.weight, lambda g: called.append(1))
    rel.zero_grad()
    step_loss(model, batches(1)[0])
    assert called == []


def test_defer_needs_the_chunked_backend():
    h, W = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True)
    with pytest.raises(Exception, match="chunked"):
        token_loss(h, W, torch.zeros(4, dtype=torch.long), backend="dense", memory=pf.MemoryOptions(defer_head_grad=True))
