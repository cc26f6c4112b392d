"""Composition: AdaGC → MONA → Lion → Hyperball trains a tiny transformer on CPU."""

from __future__ import annotations

import math

import pytest
import torch

import pgs.func as pf
from tiny import tiny_model


def _tiny_model():
    pytest.importorskip("transformers")
    return tiny_model(seed=0, dtype=torch.float32, mode=None, vocab_size=64, max_position_embeddings=64,
                      tie_word_embeddings=False)


def test_adagc_mona_lion_hyperball_trains_a_tiny_qwen3():
    model = _tiny_model()
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    radius = {n: p.norm() for n, p in params.items() if p.ndim >= 2}
    opt = pf.chain(pf.adagc(warmup_steps=10), pf.mona(), pf.scale_by_lion(0.9, 0.99), pf.hyperball(0.02))
    state = opt.init(params)
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (8, 1), generator=gen)
    batch = (start + torch.arange(17)) % 64  # next token = current + 1: learnable
    losses = []
    for step in range(200):
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        out = torch.func.functional_call(model, leaves, (batch[:, :-1],))
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        grads = torch.autograd.grad(loss, [leaves[n] for n in names])
        updates, state = opt.update(dict(zip(names, grads)), state, params)
        params = pf.apply_updates(params, updates)
        losses.append(float(loss))
        assert math.isfinite(losses[-1])
        assert all(torch.isfinite(p).all() for p in params.values())
        for n, r in radius.items():
            torch.testing.assert_close(params[n].norm(), r, rtol=1e-5, atol=0)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, (losses[:10], losses[-10:])


def test_muon_chain_runs_through_compile_on_a_tiny_qwen3():
    model = _tiny_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = pf.muon(0.02, weight_decay=0.01, adam_lr=1e-3)
    flat = pf.compile(opt, jit=False)
    s_ref, s_flat = opt.init(params), flat.init(params)
    for i in range(3):
        g = {n: torch.randn_like(p) for n, p in params.items()}
        u_ref, s_ref = opt.update(g, s_ref, params)
        u_flat, s_flat = flat.update(g, s_flat, params)
        for n in params:
            torch.testing.assert_close(u_flat[n], u_ref[n], rtol=1e-5, atol=1e-7)
