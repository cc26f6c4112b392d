"""pgs's research stack, adagc → mona → lion8bit → hyperball, on the flat layout.

``pf.compile`` runs the whole chain as one graph over flat buffers: the elementwise stages
fuse, the per-tensor norms of adagc and hyperball are segmented reductions over the layout's
blocks, and the 8-bit moments are quantized over the same blocks.  It must equal the
per-parameter reference path.
"""

import pytest
import torch

import pgs.func as pf


def _stack():
    return pf.chain(pf.adagc(warmup_steps=2), pf.mona(), pf.scale_by_lion8bit(min_8bit_size=1024), pf.hyperball(1e-2))


@pytest.mark.parametrize("jit", [False, True], ids=["flat-eager", "flat-compiled"])
def test_whole_stack_on_flat_layout_equals_reference(jit):
    torch.manual_seed(0)
    params = {"a.weight": torch.randn(64, 96), "b.weight": torch.randn(128, 64), "n.weight": torch.ones(64),
              "e.weight": torch.randn(100, 64)}
    chain = _stack()
    fast = pf.compile(chain, jit=jit)
    s_ref, s_fast = chain.init(params), fast.init(params)
    p_ref, p_fast = dict(params), dict(params)
    for _ in range(4):
        g = {k: torch.randn_like(v) for k, v in params.items()}
        u, s_ref = chain.update(g, s_ref, p_ref)
        p_ref = pf.apply_updates(p_ref, u)
        u, s_fast = fast.update(g, s_fast, p_fast)
        p_fast = pf.apply_updates(p_fast, u)
    for k in params:
        torch.testing.assert_close(p_fast[k], p_ref[k], rtol=0, atol=2e-6)
        if params[k].ndim >= 2:  # hyperball: every matrix stays on its initial sphere
            torch.testing.assert_close(p_fast[k].norm(), params[k].norm(), rtol=1e-5, atol=0)
    assert all(not torch.equal(p_fast[k], params[k]) for k in params)
