"""Sequential and sparse chunk-wise optimization of long rows (SeCO / SpaCO; Li et al., "Training
Long-Context LLMs Efficiently via Chunk-wise Optimization", arXiv 2505.16710).

A row of S tokens is cut into chunks ``[lo_c, hi_c)`` of ``chunk`` tokens.  The forward runs
chunk by chunk without autograd; each decoder layer's attention keeps the chunk's keys and
values (after RoPE) in a per-layer cache, which the later chunks attend to.  Only the cache
survives a chunk.  The backward then runs the chunks in reverse: chunk c is recomputed with
autograd on (its activations are the only ones alive), its loss is back-propagated, and the
gradient its attention sends into the cached keys/values of earlier chunks is accumulated:

    dK_j += ∂(Σ_{c'>j} L_{c'})/∂K_j      (per layer, for every j < c)

When chunk j is recomputed, its own keys/values K_j = f_j(θ, cache_{<j}) receive
``∂L_j/∂K_j + dK_j``, which is what the whole-row backward gives them: the row's loss
L = Σ_c L_c depends on K_j only through chunk j's own attention and the later chunks' attention,
so the parameter gradient Σ_c (collected in chunk c's local backward) equals ∂L/∂θ exactly.
Documents of a packed row keep to themselves across chunk boundaries: a query attends a cached
key only if both belong to the same document (the document ids come from the row's
``position_ids``, which restart at 0 at every document, as everywhere in pgs).

SpaCO (the sparse variant) runs chunk c's local backward only with probability ``p`` (a
Bernoulli draw per chunk, from its own generator) and scales what it sends (its loss seed and the
cache gradient it was handed) by the compensation factor ``1/p``; a chunk not drawn sends
nothing.  Every contribution to ∂L/∂θ is a path L_c → chunk c → chunk j₁ → … → chunk j_m (the
cache edges it crosses), kept only when every chunk on the path is drawn (probability p^{m+1},
the draws independent) and then scaled by (1/p)^{m+1}: the estimate is unbiased,
E[ĝ] = ∂L/∂θ, at the expected cost of p·C chunk backwards instead of C.  The loss value itself is
exact (the forward runs every chunk).

The attention of a chunk against the cache is a custom autograd function (:class:`_SpanAttention`):
its forward reads the keys/values from the cache buffers (no concatenated copy is saved), its
backward recomputes the chunk's attention against the cache span, adds the past part of dK/dV
into the accumulators and hands the chunk's own part, plus what the later chunks accumulated for
it, to the chunk's key/value projections.  Where CUDA's variable-length FlashAttention runs
(``torch.nn.attention.varlen``) each document of the chunk is one query segment against its keys
from the document's start (bottom-right causal alignment, checked once per device by a tiny
forward: ``_bottom_right``); elsewhere SDPA with the block-diagonal causal mask (the reference
path, what the CPU tests compare).

Refused where the chunking would change the result: models with layers that are not full
softmax attention (linear attention, sliding windows), attention dropout, MoE router losses.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import Tensor

from pgs.errors import SpecError
from pgs.runtime.documents import document_ids
from pgs.runtime.model.attention import varlen_call, varlen_suits

#: The attention implementation transformers is told while a chunk runs.
HF_NAME = "pgs_seco"
#: The state of the row being chunked (one at a time per process).
_ACTIVE: list = []


def refusal(config) -> str | None:
    """Why ``config``'s model cannot be trained chunk-wise (a sentence), or None."""
    why = varlen_suits(config)
    if why is not None:
        return why
    if getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0):
        return "it routes tokens to experts (the router's balancing loss is over the whole row)"
    return None


def register() -> str:
    """Make :data:`HF_NAME` known to transformers (the chunk attention and a mask function that
    builds no mask: the chunk attention masks itself)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_NAME, seco_attention)
    AttentionMaskInterface.register(HF_NAME, lambda *a, **k: None)
    return HF_NAME


class RowState:
    """One row batch's chunk-wise pass: the per-layer key/value cache, the gradient accumulators
    of the cache, the document id of every token and the chunk now running."""

    def __init__(self, position_ids: Tensor, chunk: int):
        self.batch, self.width = position_ids.shape
        self.chunk = chunk
        self.docs = document_ids(position_ids)  # a document id per token, unique over the batch
        self.bounds = [(lo, min(lo + chunk, self.width)) for lo in range(0, self.width, chunk)]
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.grad_keys: dict[int, Tensor] = {}
        self.grad_values: dict[int, Tensor] = {}
        self.lo = self.hi = 0
        self.span = 0  # where the keys any query of this chunk may read begin
        self.weight = 1.0  # SpaCO's compensation for the chunk's backward
        self._segments = None

    def enter(self, index: int, weight: float = 1.0) -> None:
        self.lo, self.hi = self.bounds[index]
        self.weight = weight
        # the earliest key a query of the chunk may read: the start of the document of its first token
        docs = self.docs[:, self.lo]
        first = (self.docs == docs[:, None]).float().argmax(1)
        self.span = int(first.min())
        self._segments = None

    # -- the cache ---------------------------------------------------------------------------
    def store(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Write the chunk's keys/values ``[B, Hkv, C, D]`` into the layer's cache ``[B, S, Hkv, D]``."""
        if layer not in self.keys:
            b, h, _, d = key.shape
            self.keys[layer] = key.new_empty(b, self.width, h, d)
            self.values[layer] = value.new_empty(b, self.width, h, d)
        self.keys[layer][:, self.lo:self.hi].copy_(key.detach().transpose(1, 2))
        self.values[layer][:, self.lo:self.hi].copy_(value.detach().transpose(1, 2))

    def accumulators(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's dK/dV over the tokens before the last chunk (what later chunks send back)."""
        if layer not in self.grad_keys:
            length = self.bounds[-1][0]
            k = self.keys[layer]
            self.grad_keys[layer] = k.new_zeros(k.shape[0], length, *k.shape[2:])
            self.grad_values[layer] = k.new_zeros(k.shape[0], length, *k.shape[2:])
        return self.grad_keys[layer], self.grad_values[layer]

    def release_accumulators(self) -> None:
        self.grad_keys.clear()
        self.grad_values.clear()

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values, self.grad_keys, self.grad_values)
                   for t in d.values())

    # -- the attention of the chunk against its span -------------------------------------------
    def mask(self) -> Tensor:
        """``[B, 1, C, L]``: query i of the chunk may read key j of the span (same document, j ≤ i)."""
        q = torch.arange(self.lo, self.hi, device=self.docs.device)
        k = torch.arange(self.span, self.hi, device=self.docs.device)
        same = self.docs[:, self.lo:self.hi, None] == self.docs[:, None, self.span:self.hi]
        return (same & (k[None, :] <= q[:, None])[None])[:, None]

    def segments(self) -> tuple[Tensor, Tensor, int, int, list]:
        """The varlen kernel's view of the chunk: ``cu_q``, ``cu_k`` (int32), the longest query and
        key segment, and per row the key range ``(start, hi)`` laid end to end.  Each document
        of the chunk is a query segment; its keys run from the document's start to the chunk's end
        (bottom-right causal alignment)."""
        if self._segments is None:
            cu_q, cu_k, rows = [0], [0], []
            for b in range(self.batch):
                docs = self.docs[b, self.span:self.hi]
                start = self.span + int((docs == self.docs[b, self.lo]).float().argmax())
                rows.append((start, self.hi))
                ids = self.docs[b, start:self.hi]
                change = torch.nonzero(ids[1:] != ids[:-1]).flatten().add(1).tolist()
                cuts = [0, *change, self.hi - start]
                for a, e in zip(cuts[:-1], cuts[1:]):
                    cu_k.append(cu_k[-1] + e - a)
                    cu_q.append(cu_q[-1] + e - max(a, self.lo - start))
            dev = self.docs.device
            lq = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
            lk = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
            self._segments = (torch.tensor(cu_q, dtype=torch.int32, device=dev),
                              torch.tensor(cu_k, dtype=torch.int32, device=dev), lq, lk, rows)
        return self._segments


#: CUDA device index -> whether the varlen kernel aligns a shorter query segment with the end of
#: its key segment (bottom-right causal), found once per device by :func:`_bottom_right`.
_ALIGNED: dict[int, bool] = {}


def _bottom_right(call, device: torch.device) -> bool:
    """Whether ``varlen_attn``'s causal mask on ``device`` lets query i of a segment of n queries
    against m ≥ n keys read keys ≤ i + m − n (what a chunk's attention needs): one tiny forward
    against the masked reference, asked once per device.  Where it does not (or fails), the chunk
    attention takes the masked SDPA path, which is correct everywhere."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ALIGNED:
        try:
            fn, causal = call
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(n, 1, 64, generator=g, device=device, dtype=torch.bfloat16) for n in (3, 7, 7))
            cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, 7], dtype=torch.int32, device=device)
            out = fn(q, k, v, cu_q, cu_k, 3, 7, **causal)
            mask = torch.arange(7, device=device)[None, :] <= torch.arange(4, 7, device=device)[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=mask)
            _ALIGNED[index] = bool(torch.allclose(out.float(), ref.transpose(0, 1), atol=2e-2, rtol=2e-2))
        except Exception:  # noqa: BLE001 - any failure: the masked path
            _ALIGNED[index] = False
    return _ALIGNED[index]


def _attend(state: RowState, q: Tensor, k: Tensor, v: Tensor, scaling: float | None) -> Tensor:
    """Attention of the chunk's queries ``q`` ``[B, Hq, C, D]`` against the span's keys/values
    ``k``/``v`` ``[B, L, Hkv, D]`` (L = hi − span) → ``[B, C, Hq, D]``."""
    batch, hq, width, d = q.shape
    hkv = k.shape[2]
    call = varlen_call() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if call is not None and not _bottom_right(call, q.device):
        call = None
    if call is not None:
        fn, causal = call
        cu_q, cu_k, lq, lk, rows = state.segments()
        off = state.span
        qf = q.transpose(1, 2).reshape(batch * width, hq, d)
        if batch == 1:  # the row's keys from its first document's start: a view of the cache
            kf, vf = k[0, rows[0][0] - off:], v[0, rows[0][0] - off:]
        else:
            kf = torch.cat([k[b, a - off:e - off] for b, (a, e) in enumerate(rows)])
            vf = torch.cat([v[b, a - off:e - off] for b, (a, e) in enumerate(rows)])
        out = fn(qf, kf, vf, cu_q, cu_k, lq, lk, scale=scaling, **causal)
        return out.view(batch, width, hq, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=state.mask(), scale=scaling, enable_gqa=hkv != hq)
    return out.transpose(1, 2)


class _SpanAttention(torch.autograd.Function):
    """The chunk's attention against its cache span, with the cache's gradients routed (see the
    module docstring).  Inputs: the chunk's queries/keys/values ``[B, H, C, D]``; the keys/values
    are already in the cache (``RowState.store``), which the forward reads."""

    @staticmethod
    def forward(ctx, q, k, v, state: RowState, layer: int, scaling):
        ctx.state, ctx.layer, ctx.scaling = state, layer, scaling
        ctx.bounds = (state.span, state.lo, state.hi, state.weight)
        ctx.save_for_backward(q)
        span = slice(state.span, state.hi)
        return _attend(state, q, state.keys[layer][:, span], state.values[layer][:, span], scaling)

    @staticmethod
    def backward(ctx, grad_out):
        (q,) = ctx.saved_tensors
        state, layer = ctx.state, ctx.layer
        span, lo, hi, weight = ctx.bounds
        with torch.enable_grad():
            qq = q.detach().requires_grad_()
            kk = state.keys[layer][:, span:hi].detach().requires_grad_()
            vv = state.values[layer][:, span:hi].detach().requires_grad_()
            out = _attend(state, qq, kk, vv, ctx.scaling)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad_out)
        past = lo - span
        last = state.bounds[-1][0]
        if past or lo < last:
            acc_k, acc_v = state.accumulators(layer)
            if past:  # what this chunk's queries send to the earlier chunks' keys/values
                acc_k[:, span:lo] += dk[:, :past]
                acc_v[:, span:lo] += dv[:, :past]
            dk, dv = dk[:, past:], dv[:, past:]
            if lo < last:  # what the later chunks sent to this chunk's keys/values, compensated
                dk = dk + acc_k[:, lo:hi] * weight if weight != 1.0 else dk + acc_k[:, lo:hi]
                dv = dv + acc_v[:, lo:hi] * weight if weight != 1.0 else dv + acc_v[:, lo:hi]
        return dq, dk.transpose(1, 2), dv.transpose(1, 2), None, None, None


def seco_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float | None = None,
                   dropout: float = 0.0, **kwargs):
    """transformers attention function (:data:`HF_NAME`): the chunk's ``query`` ``[B, Hq, C, D]``
    and ``key``/``value`` ``[B, Hkv, C, D]`` (after RoPE) against the row's cache → (``[B, C, Hq, D]``, None)."""
    if not _ACTIVE:
        raise SpecError("memory.seco_chunk: the chunk attention ran outside a chunk-wise pass")
    if dropout:
        raise SpecError("memory.seco_chunk: attention dropout is not supported "
                        "(set the model's attention_dropout to 0)")
    state: RowState = _ACTIVE[-1]
    layer = module.layer_idx
    state.store(layer, key, value)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _SpanAttention.apply(query, key, value, state, layer, scaling), None
    span = slice(state.span, state.hi)
    return _attend(state, query, state.keys[layer][:, span], state.values[layer][:, span], scaling), None


@contextlib.contextmanager
def _chunk_attention(model, state: RowState):
    """The model's attention is :func:`seco_attention` reading ``state`` while inside."""
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = HF_NAME
    _ACTIVE.append(state)
    try:
        yield
    finally:
        _ACTIVE.pop()
        config._attn_implementation = before


def _chunk_hidden(model, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    return model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state


#: ``loss_fn(h, lo, hi) -> (loss_sum, stats)``: the summed loss of the chunk's final hidden
#: states ``h`` ``[B, hi − lo, D]`` (tokens ``lo … hi−1`` of the rows), and detached statistics.
LossFn = Callable[[Tensor, int, int], tuple[Tensor, Tensor]]


class ChunkedRow:
    """One batch of rows trained chunk-wise: :meth:`forward` returns the rows' summed loss, whose
    backward (``loss.backward()``, scaled as the caller's loss is) runs the reverse sweep.

    ``keep`` (SpaCO): the probability that a chunk's backward runs (1: SeCO, exact); ``generator``
    draws which.  ``hold``: a context manager entered around the sweep's local backwards (gradient
    release holds its steps there, the gradients accumulate in ``.grad``; see
    ``GradientRelease.accumulating``)."""

    def __init__(self, model, input_ids: Tensor, position_ids: Tensor, chunk: int, loss_fn: LossFn, *,
                 keep: float = 1.0, generator: torch.Generator | None = None, hold=None):
        if chunk < 1:
            raise SpecError(f"memory.seco_chunk: {chunk} is not a positive number of tokens")
        self.model, self.ids, self.pos = model, input_ids, position_ids
        self.loss_fn, self.keep, self.generator = loss_fn, keep, generator
        self.hold = hold or contextlib.nullcontext
        self.state = RowState(position_ids, chunk)
        self.backwards = 0  # chunk backwards the last sweep ran

    def forward(self) -> tuple[Tensor, Tensor]:
        """The rows' loss sum (its backward runs the sweep) and the summed statistics (detached)."""
        anchor = torch.zeros((), device=self.ids.device, requires_grad=True)
        loss, stats = _Sweep.apply(anchor, self)
        return loss, stats

    def _forward(self) -> tuple[Tensor, Tensor]:
        total, stats = None, None
        with torch.no_grad(), _chunk_attention(self.model, self.state):
            for i, (lo, hi) in enumerate(self.state.bounds):
                self.state.enter(i)
                h = _chunk_hidden(self.model, self.ids[:, lo:hi], self.pos[:, lo:hi])
                loss, s = self.loss_fn(h, lo, hi)
                del h
                total = loss.detach().clone() if total is None else total + loss.detach()
                stats = s.detach().clone() if stats is None else stats + s.detach()
        return total, stats

    def draws(self) -> list[bool]:
        """Which chunks' backwards run (every one for SeCO; Bernoulli(keep) each for SpaCO)."""
        n = len(self.state.bounds)
        if self.keep >= 1.0:
            return [True] * n
        u = torch.rand(n, generator=self.generator, device=self.generator.device if self.generator else "cpu")
        return (u < self.keep).tolist()

    def _backward(self, scale: Tensor) -> None:
        state = self.state
        weight = 1.0 if self.keep >= 1.0 else 1.0 / self.keep
        drawn = self.draws()
        self.backwards = 0
        try:
            with _chunk_attention(self.model, state), self.hold():
                for i in reversed(range(len(state.bounds))):
                    if not drawn[i]:
                        continue
                    lo, hi = state.bounds[i]
                    state.enter(i, weight)
                    with torch.enable_grad():
                        h = _chunk_hidden(self.model, self.ids[:, lo:hi], self.pos[:, lo:hi])
                        loss, _ = self.loss_fn(h, lo, hi)
                        if loss.requires_grad:
                            torch.autograd.backward(loss, scale * weight)
                        else:  # nothing trained here: the chunk still hands back what later chunks sent
                            torch.autograd.backward(h, torch.zeros_like(h))
                    del h, loss
                    self.backwards += 1
        finally:
            state.release_accumulators()
            state.keys.clear()
            state.values.clear()


class _Sweep(torch.autograd.Function):
    """Forward: the chunk-wise no-grad pass (the loss value); backward: the reverse sweep, with
    the loss's incoming gradient as the scale of every chunk's loss."""

    @staticmethod
    def forward(ctx, anchor, row: ChunkedRow):
        ctx.row = row
        loss, stats = row._forward()
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        row, ctx.row = ctx.row, None
        if grad_loss is not None:
            row._backward(grad_loss)
        return None, None


def chunk_count(width: int, chunk: int) -> int:
    return math.ceil(width / chunk)


__all__ = ["HF_NAME", "ChunkedRow", "RowState", "chunk_count", "refusal", "register", "seco_attention"]
