"""Context parallelism: one packed row split along the sequence over ranks, with ring attention.

Every layer of a decoder except attention works token by token (embeddings, norms, MLPs,
routers, the head and the token loss), so a row of ``S`` tokens can be cut into ``W`` shards
of ``S/W`` tokens, one per rank, and only attention has to see the other ranks' tokens.  Ring
attention (Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", arXiv:2310.01889) keeps each rank's queries in place and passes the key/value blocks
around a ring of ranks: after ``W - 1`` hops every query block has met every key block, and
the partial results merge exactly with the online softmax (Milakov & Gimelshein,
arXiv:1805.02867; the running max / running sum of FlashAttention, arXiv:2205.14135)::

    m' = max(m, max_j s_j),   l' = l·e^{m - m'} + Σ_j e^{s_j - m'},   o' = o·e^{m - m'} + Σ_j e^{s_j - m'} v_j

Backward recomputes each block's probabilities from the saved log-sum-exp ``lse = m + log l``
(``p = e^{s - lse}``), so nothing of size ``S/W × S`` is kept: the key/value block travels
again, carrying its gradient accumulators ``dK, dV``, and after ``W`` hops the accumulators are
back at the rank that owns the block.

Why not ``torch.distributed.tensor.experimental.context_parallel``: on torch 2.13 its SDPA
path dispatches the CUDA kernels only (``_scaled_dot_product_flash/efficient/cudnn_attention``,
nothing for the CPU op) and knows ``is_causal`` but no document mask, and its flex-attention
path needs compiled flex attention; packed-document isolation and the gloo/CPU tests need
neither restriction.  The exchange here is ``torch.distributed`` point-to-point
(``batch_isend_irecv``), which gloo and NCCL both support.

Packed documents stay isolated: the mask of a (query block, key block) pair is computed from
the *global* token indices of both blocks and the global document ids of the row (a new
document wherever ``position_ids`` restarts at 0: ``pgs.runtime.documents``), ``allowed = same
document and key index <= query index``.  Causal balance: with the ``"zigzag"`` layout
(default) the row is cut into ``2W`` chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r``,
so every rank has the same number of unmasked (query, key) pairs of a causal row; ``"contiguous"``
gives rank ``r`` the ``r``-th ``S/W`` tokens.

Use: :func:`shard_rows` cuts ``input_ids``/``position_ids``/``labels`` (``[B, S]``, ``S`` a
multiple of ``2W``; :func:`pad_width` says how far to pad) into this rank's shard; a model built
with ``attn_implementation = HF_NAME`` (:func:`register`) runs its attention through
:func:`ring_attention` inside ``with sequence_parallel(shard, position_ids):`` (the full rows'
positions, for the document ids), or between ``begin_rows`` and ``end_rows`` (the training loop:
a checkpointed layer's recompute in backward must see the same rows).  Outside that block the same attention function computes the
ordinary packed attention of the whole local row (evaluation, one process).  The loss is the
sum of the shards' token losses over the global valid-token count, and the ranks' gradients
are summed (FSDP2's reduce-scatter over the same ranks does exactly that).
"""

from __future__ import annotations

import contextlib
import math

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from pgs.errors import SpecError
from pgs.runtime.documents import document_ids

#: The name under which :func:`register` makes the ring attention known to transformers.
HF_NAME = "pgs_ring"
LAYOUTS = ("zigzag", "contiguous")


@attrs.frozen
class SequenceShard:
    """Which tokens of a row this rank holds: ``world`` ranks of ``group`` (None: the default group)."""

    rank: int
    world: int
    layout: str = "zigzag"
    group: object = None

    def __attrs_post_init__(self):
        if self.layout not in LAYOUTS:
            raise SpecError(f"context parallelism: layout {self.layout!r} is not one of {LAYOUTS}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside {self.world} ranks")

    @property
    def multiple(self) -> int:
        """The row width must be a multiple of this."""
        return 2 * self.world if self.layout == "zigzag" else self.world

    def indices(self, width: int, rank: int | None = None, device=None) -> Tensor:
        """The global token indices (ascending) of ``rank``'s shard of a row of ``width`` tokens."""
        r = self.rank if rank is None else rank
        if width % self.multiple:
            raise ValueError(f"context parallelism: a row of {width} tokens does not split into "
                             f"{self.multiple} equal chunks (pad it: pad_width)")
        if self.layout == "contiguous":
            n = width // self.world
            return torch.arange(r * n, (r + 1) * n, device=device)
        c = width // (2 * self.world)
        first = torch.arange(r * c, (r + 1) * c, device=device)
        last = torch.arange((2 * self.world - 1 - r) * c, (2 * self.world - r) * c, device=device)
        return torch.cat([first, last])


def pad_width(width: int, shard: SequenceShard) -> int:
    """The smallest row width >= ``width`` that ``shard`` splits."""
    return math.ceil(width / shard.multiple) * shard.multiple


def shard_rows(x: Tensor, shard: SequenceShard, dim: int = 1) -> Tensor:
    """This rank's tokens of ``x`` along ``dim`` (the sequence axis)."""
    idx = shard.indices(x.shape[dim], device=x.device)
    return x.index_select(dim, idx)


def unshard_rows(parts: list[Tensor], shard: SequenceShard, dim: int = 1) -> Tensor:
    """The whole rows from every rank's shard (``parts[r]``: rank r's), the inverse of :func:`shard_rows`."""
    width = sum(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[dim] = width
    out = parts[0].new_empty(shape)
    for r, p in enumerate(parts):
        out.index_copy_(dim, shard.indices(width, r, device=p.device), p)
    return out


@attrs.frozen
class ShardedBatch:
    """This rank's shard of a ``PackedBatch`` (the fields the training step reads), with what
    the shard's forward needs of the whole rows: ``full_position_ids`` (document ids for the
    ring) and ``token_mask`` (the shard's non-padding tokens).  Counts are the shard's own, so
    that their sums over all ranks are the global batch's."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    full_position_ids: Tensor
    token_mask: Tensor
    cu_seqlens: list
    num_docs: int
    num_trained_tokens: int
    num_tokens: int


def shard_batch(batch, shard: SequenceShard) -> ShardedBatch:
    """``batch`` (a ``PackedBatch``, ``[B, S]``) padded to a width ``shard`` splits and cut to this
    rank's tokens.  The added padding is one more document per row (positions from 0, label
    -100), which no real token attends to."""
    ids, labels, pos = batch.input_ids, batch.labels, batch.position_ids
    rows, width = ids.shape
    lengths = torch.tensor([int(c[-1]) if len(c) else 0 for c in batch.cu_seqlens], dtype=torch.long)
    wide = pad_width(width, shard)
    if wide > width:
        extra = wide - width
        ids = torch.cat([ids, ids.new_zeros(rows, extra)], dim=1)
        labels = torch.cat([labels, labels.new_full((rows, extra), -100)], dim=1)
        pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype).expand(rows, -1)], dim=1)
    real = torch.arange(wide)[None, :] < lengths[:, None]
    mine_labels = shard_rows(labels, shard)
    mine_real = shard_rows(real, shard)
    return ShardedBatch(input_ids=shard_rows(ids, shard), labels=mine_labels, position_ids=shard_rows(pos, shard),
                        full_position_ids=pos, token_mask=mine_real.reshape(-1), cu_seqlens=batch.cu_seqlens,
                        num_docs=batch.num_docs, num_trained_tokens=int((mine_labels != -100).sum()),
                        num_tokens=int(mine_real.sum()))


def begin_rows(batch, shard: SequenceShard | None, device) -> None:
    """Make the ring attention of the next forward *and of its backward* (a checkpointed layer
    recomputes its attention there) run over ``shard`` for :class:`ShardedBatch` ``batch``; it
    stays in force until the next ``begin_rows`` or :func:`end_rows`.  A no-op for other batches."""
    if shard is None or not isinstance(batch, ShardedBatch):
        return
    _ACTIVE[:] = [(shard, document_ids(batch.full_position_ids.to(device, non_blocking=True)))]


def end_rows() -> None:
    """Leave :func:`begin_rows`' rows (evaluation then attends within each rank's own rows)."""
    _ACTIVE.clear()


def make_shard(rank: int, world: int, context: int, layout: str = "zigzag") -> SequenceShard:
    """This rank's place in its context-parallel group: groups of ``context`` adjacent ranks
    (every rank must call this: it creates every group's process group)."""
    if world % context:
        raise SpecError(f"parallel.context: {context} ranks per sequence do not divide {world} processes")
    group = None
    if context < world:
        for start in range(0, world, context):
            g = dist.new_group(list(range(start, start + context)))
            if start <= rank < start + context:
                group = g
    return SequenceShard(rank % context, context, layout, group)


# ------------------------------------------------------------------------------- the ring


def _peers(shard: SequenceShard) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the ring."""
    nxt, prev = (shard.rank + 1) % shard.world, (shard.rank - 1) % shard.world
    if shard.group is None:
        return nxt, prev
    return dist.get_global_rank(shard.group, nxt), dist.get_global_rank(shard.group, prev)


def _shift(x: Tensor, shard: SequenceShard) -> Tensor:
    """Send ``x`` to the next rank of the ring and receive the previous rank's (same shape)."""
    nxt, prev = _peers(shard)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), nxt, shard.group),
           dist.P2POp(dist.irecv, out, prev, shard.group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _allowed(doc: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
    """``[B, Sq, Sk]``: same document and key index <= query index."""
    same = doc[:, q_idx][:, :, None] == doc[:, k_idx][:, None, :]
    return same & (k_idx[None, None, :] <= q_idx[None, :, None])


def _expand(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_expand`: sum each group of query heads back onto its KV head."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, shard, scale):
        dtype = _compute_dtype(q)
        groups = q.shape[1] // k.shape[1]
        width = q.shape[2] * shard.world
        q_idx = shard.indices(width, device=q.device)
        qf = q.to(dtype)
        b, h, sq, _ = q.shape
        m = torch.full((b, h, sq), -math.inf, dtype=dtype, device=q.device)
        l = torch.zeros((b, h, sq), dtype=dtype, device=q.device)
        o = torch.zeros((b, h, sq, v.shape[-1]), dtype=dtype, device=q.device)
        kv = torch.stack([k, v])
        for t in range(shard.world):
            src = (shard.rank - t) % shard.world
            ke, ve = _expand(kv[0].to(dtype), groups), _expand(kv[1].to(dtype), groups)
            allowed = _allowed(doc, q_idx, shard.indices(width, src, device=q.device))[:, None]
            s = (qf @ ke.transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - safe[..., None])  # masked pairs: exp(-inf) = 0
            alpha = torch.exp(m - safe)
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + p @ ve
            m = m_new
            if t < shard.world - 1:
                kv = _shift(kv, shard)
        out = o / l[..., None]  # every query sees at least itself: l > 0
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, doc, out, lse)
        ctx.shard, ctx.scale = shard, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, doc, out, lse = ctx.saved_tensors
        shard, scale = ctx.shard, ctx.scale
        dtype = out.dtype
        groups = q.shape[1] // k.shape[1]
        width = q.shape[2] * shard.world
        q_idx = shard.indices(width, device=q.device)
        qf, do = q.to(dtype), grad_out.to(dtype)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        for t in range(shard.world):
            src = (shard.rank - t) % shard.world
            ke, ve = _expand(kv[0].to(dtype), groups), _expand(kv[1].to(dtype), groups)
            allowed = _allowed(doc, q_idx, shard.indices(width, src, device=q.device))[:, None]
            s = (qf @ ke.transpose(-1, -2)) * scale
            p = torch.exp(s.masked_fill(~allowed, -math.inf) - lse[..., None])
            dv = p.transpose(-1, -2) @ do
            ds = p * (do @ ve.transpose(-1, -2) - delta[..., None])
            dq = dq + (ds @ ke) * scale
            dk = (ds.transpose(-1, -2) @ qf) * scale
            dkv = dkv + torch.stack([_fold(dk, groups), _fold(dv, groups)])
            # the block and its gradient move on; after W hops the gradient is home
            if t < shard.world - 1:
                kv = _shift(kv, shard)
            if shard.world > 1:
                dkv = _shift(dkv, shard)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, doc: Tensor, shard: SequenceShard,
                   scale: float | None = None) -> Tensor:
    """Causal, document-isolated attention of this rank's queries over every rank's keys.

    ``q`` ``[B, Hq, S/W, D]``, ``k``/``v`` ``[B, Hkv, S/W, D]`` (``Hkv`` divides ``Hq``): this
    rank's shard (``shard.indices``) of rows of ``S`` tokens; ``doc`` ``[B, S]``: the document
    ids of the whole rows (``pgs.runtime.documents.document_ids``; only ids of one row are
    compared).  Returns ``[B, Hq, S/W, D]``.  Every rank of ``shard`` must call it (the exchange
    is collective).  Softmax in fp32 (fp64 for fp64).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {k.shape[1]} key heads do not divide {q.shape[1]} query heads")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, doc, shard, scale)


# ------------------------------------------------------------------------------- transformers


_ACTIVE: list = []  # (shard, doc) of the enclosing sequence_parallel block


@contextlib.contextmanager
def sequence_parallel(shard: SequenceShard, position_ids: Tensor):
    """Run the enclosed forward's ring attention over ``shard``'s ranks.  ``position_ids``: the
    *whole* rows' positions ``[B, S]`` (every rank the same), which give the document ids."""
    _ACTIVE.append((shard, document_ids(position_ids)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def ring_attention_hf(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (``attn_implementation = HF_NAME``): ring attention inside
    :func:`sequence_parallel`, else the packed attention of the local rows (one rank's view of
    the whole rows: the same kernel with a ring of one).  Returns ``([B, S, Hq, D], None)``."""
    if dropout:
        raise SpecError("context parallelism: attention dropout is not supported (set attention_dropout = 0)")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise SpecError("context parallelism: sliding-window and softcapped attention are not supported")
    if attention_mask is not None or key.shape[2] != query.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if _ACTIVE:
        shard, doc = _ACTIVE[-1]
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(query.shape[2], device=query.device).expand(query.shape[0], -1)
        shard, doc = SequenceShard(0, 1, "contiguous"), document_ids(position_ids.expand(query.shape[0], -1))
    out = ring_attention(query, key, value, doc.to(query.device), shard, scaling)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """No mask for a packed forward (the ring masks by document); SDPA's otherwise."""
    from transformers.masking_utils import sdpa_mask

    full = kwargs.get("attention_mask") is None and not kwargs.get("kv_offset") and not kwargs.get("q_offset")
    return None if full else sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make ``attn_implementation = HF_NAME`` known to transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_NAME, ring_attention_hf)
    AttentionMaskInterface.register(HF_NAME, _no_mask)
    return HF_NAME
