"""SeCO / SpaCO (pgs.runtime.model.seco): the chunk-wise backward of a long row equals the whole-row
backward (float64, several chunk sizes, packed rows, tied embeddings), gradient release steps once
with the whole row's gradient, and SpaCO's estimate is unbiased."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import pgs.func as pf
from pgs.func.losses import token_loss
from pgs.runtime.model.seco import ChunkedRow, RowState
from pgs.runtime.optim.release import GradientRelease
from tests.tiny import tiny_model

VOCAB = 96


def _model(tied=True, seed=0):
    return tiny_model("qwen3", seed=seed, dtype=torch.float64, tie_word_embeddings=tied)


def _row(lengths: list[list[int]], seed=1):
    """Packed rows of documents with the given lengths: ids, position_ids, labels (next token of
    the same document, the last token of each document untrained)."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=g)
    pos = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), -100)
    for b, row in enumerate(lengths):
        at = 0
        for n in row:
            pos[b, at:at + n] = torch.arange(n)
            labels[b, at:at + n - 1] = ids[b, at + 1:at + n]
            at += n
        pos[b, at:] = torch.arange(width - at)  # the padding: one document of its own
    return ids, pos, labels


def _loss_fn(model, labels):
    W = model.get_output_embeddings().weight

    def fn(h, lo, hi):
        r = token_loss(h, W, labels[:, lo:hi], chunk_size=5)
        return r.loss_sum, r.entropy_sum.detach().reshape(1)

    return fn


def _whole(model, ids, pos, labels, count):
    h = model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    loss = _loss_fn(model, labels)(h, 0, ids.shape[1])[0]
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _chunked(model, ids, pos, labels, count, chunk, **kw):
    row = ChunkedRow(model, ids, pos, chunk, _loss_fn(model, labels), **kw)
    loss, stats = row.forward()
    (loss / count).backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, row


ROWS = {
    "one document": [[37]],
    "packed": [[5, 11, 3, 14, 4]],
    "packed, two rows": [[9, 16, 8], [20, 3, 2, 7]],
}


@pytest.mark.parametrize("rows", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.parametrize("chunk", [3, 7, 16])
def test_seco_gradients_equal_the_whole_row(rows, chunk):
    model = _model()
    ids, pos, labels = _row(rows)
    count = int((labels != -100).sum())
    loss, want = _whole(model, ids, pos, labels, count)
    got_loss, got, row = _chunked(model, ids, pos, labels, count, chunk)
    assert row.backwards == math.ceil(ids.shape[1] / chunk)
    torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=1e-12)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_seco_with_an_untied_head_and_a_chunk_without_trained_tokens():
    model = _model(tied=False)
    ids, pos, labels = _row([[6, 18, 6]])
    labels[:, 8:16] = -100  # the second chunk of 8 trains nothing: it still passes back what later chunks sent
    count = int((labels != -100).sum())
    _, want = _whole(model, ids, pos, labels, count)
    _, got, _ = _chunked(model, ids, pos, labels, count, 8)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_without_the_cache_gradient_the_result_differs():
    """The test above can fail: dropping what later chunks send to the earlier chunks' keys and
    values (a truncated backward) gives another gradient."""
    model = _model()
    ids, pos, labels = _row([[30]])
    count = int((labels != -100).sum())
    _, want = _whole(model, ids, pos, labels, count)
    original = RowState.accumulators

    def forgetful(self, layer):
        k, v = original(self, layer)
        return k.zero_(), v.zero_()

    RowState.accumulators = forgetful
    try:
        _, got, _ = _chunked(model, ids, pos, labels, count, 8)
    finally:
        RowState.accumulators = original
    far = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert far > 1e-6


def test_documents_across_a_chunk_boundary_stay_isolated():
    """A token of a later document changes no loss of an earlier one, across chunk boundaries."""
    model = _model()
    ids, pos, labels = _row([[10, 14]])
    count = int((labels != -100).sum())
    first = labels.clone()
    first[:, 10:] = -100  # the first document's loss alone
    a, ga, _ = _chunked(model, ids, pos, first, count, 4)
    ids2 = ids.clone()
    ids2[:, 12:] = (ids2[:, 12:] + 1) % VOCAB
    b, gb, _ = _chunked(model, ids2, pos, first, count, 4)
    assert a == b
    for n in ga:
        if "embed" not in n:
            torch.testing.assert_close(ga[n], gb[n], rtol=0, atol=0, msg=n)


def test_gradient_release_steps_once_with_the_whole_rows_gradient():
    ids, pos, labels = _row([[7, 12, 9]])
    count = int((labels != -100).sum())
    want_model, got_model = _model(), _model()
    _, grads = _whole(want_model, ids, pos, labels, count)
    with torch.no_grad():
        for n, p in want_model.named_parameters():
            p.sub_(0.1 * grads[n])
    release = GradientRelease(pf.sgd(0.1), got_model, track_grad_norm=False)
    row = ChunkedRow(got_model, ids, pos, 8, _loss_fn(got_model, labels), hold=release.accumulating)
    loss, _ = row.forward()
    (loss / count).backward()
    release.step()
    assert release.steps == 1 and release.counts() == {1}
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=n)


def _pattern_gradients(model, ids, pos, labels, count, chunk, keep, monkeypatch):
    """SpaCO's estimate for every pattern of drawn chunks (``ChunkedRow.draws`` forced)."""
    n = math.ceil(ids.shape[1] / chunk)
    out = {}
    for bits in itertools.product([False, True], repeat=n):
        monkeypatch.setattr(ChunkedRow, "draws", lambda self, bits=bits: list(bits))
        out[bits] = _chunked(model, ids, pos, labels, count, chunk, keep=keep)[1]
    monkeypatch.undo()
    return out


def _flat(d, names):
    return torch.cat([d[n].reshape(-1) for n in names])


def test_spaco_is_unbiased(monkeypatch):
    """SpaCO's expectation over its draws is the exact gradient: computed over every pattern of
    drawn chunks (each weighted by its probability), and estimated from 400 draws of its own
    generator, whose mean lies within 4.5 standard errors (from the sample variance) of the exact
    gradient in every coordinate of a fixed projection.  Both fail for the estimate without the
    compensation factor (checked below with the same statistics)."""
    model = _model()
    ids, pos, labels = _row([[5, 7]])
    count = int((labels != -100).sum())
    keep = 0.4
    _, exact = _whole(model, ids, pos, labels, count)
    names = list(exact)
    patterns = _pattern_gradients(model, ids, pos, labels, count, 4, keep, monkeypatch)
    assert not any(bool(v.abs().sum()) for v in patterns[(False, False, False)].values())
    expected = {n: sum(math.prod(keep if b else 1 - keep for b in bits) * g[n] for bits, g in patterns.items())
                for n in names}
    for n in names:  # up to float32 rounding: transformers' RMSNorm computes in float32 in a float64 model
        assert float((expected[n] - exact[n]).norm()) <= 1e-6 * float(exact[n].norm()), n

    proj = torch.randn(8, _flat(exact, names).numel(), generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)
    target = proj @ _flat(exact, names)
    by_pattern = {bits: proj @ _flat(g, names) for bits, g in patterns.items()}
    row = ChunkedRow(model, ids, pos, 4, _loss_fn(model, labels), keep=keep,
                     generator=torch.Generator().manual_seed(3))
    samples = torch.stack([by_pattern[tuple(row.draws())] for _ in range(400)])
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(samples.shape[0])
    assert bool((se > 0).all())
    assert float(((mean - target).abs() / se).max()) < 4.5
    # without the compensation (the drawn chunks' backwards at weight 1): the same statistic rejects it
    plain = {bits: proj @ _flat(g, names)
             for bits, g in _pattern_gradients(model, ids, pos, labels, count, 4, 1.0, monkeypatch).items()}
    biased = torch.stack([plain[tuple(row.draws())] for _ in range(400)])
    assert float(((biased.mean(0) - target).abs() / (biased.std(0) / 20)).max()) > 4.5


@pytest.mark.parametrize("policy, offload", [("full", 1), ("sublayer", False), ("selective", False)])
def test_seco_composes_with_activation_checkpointing_and_mlp_tiles(policy, offload):
    """The checkpointed layers recompute their chunk's attention inside the chunk's backward, with
    the same cache and the same routing of its gradient."""
    from pgs.runtime.model.layers import apply_activation_checkpointing
    from pgs.runtime.model.tiled_mlp import apply_mlp_tiles

    ids, pos, labels = _row([[6, 13, 9]])
    count = int((labels != -100).sum())
    _, want = _whole(_model(), ids, pos, labels, count)
    model = _model()
    apply_mlp_tiles(model, 2)
    apply_activation_checkpointing(model, policy, offload=offload)
    _, got, _ = _chunked(model, ids, pos, labels, count, 8)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_seco_on_cuda_equals_the_whole_row(dtype):
    """On CUDA in bf16 the chunk attends through the variable-length FlashAttention kernel (each
    document of the chunk a query segment against its keys from the document's start,
    bottom-right causal): its output against the block-diagonal SDPA reference within bf16
    error, and the row's gradients against the whole-row backward (relative norm 2e-2; float32,
    the masked SDPA path: 1e-4)."""
    from pgs.runtime.model import seco

    dev = torch.device("cuda")
    model = tiny_model("qwen3", seed=0, dtype=dtype).to(dev)
    ids, pos, labels = (t.to(dev) for t in _row([[9, 30, 5, 20], [50, 14]]))
    count = int((labels != -100).sum())
    _, want = _whole(model, ids, pos, labels, count)
    _, got, row = _chunked(model, ids, pos, labels, count, 16)
    assert row.backwards == 4
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for n in want:
        err = float((got[n].float() - want[n].float()).norm() / want[n].float().norm().clamp_min(1e-12))
        assert err < tol, (n, err)
    if dtype == torch.bfloat16 and seco.varlen_call() is not None:  # the kernel aligns segments bottom-right
        assert seco._bottom_right(seco.varlen_call(), dev)
    # the kernel path itself against the masked reference, for a chunk in the middle of documents
    state = seco.RowState(pos, 16)
    state.enter(2)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, device=dev, dtype=dtype)
    k, v = (torch.randn(2, 64, 2, 8, generator=g, device=dev, dtype=dtype) for _ in range(2))
    span = slice(state.span, state.hi)
    out = seco._attend(state, q, k[:, span], v[:, span], None)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k[:, span].float().transpose(1, 2), v[:, span].float().transpose(1, 2), attn_mask=state.mask(),
        enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
