"""Chunked backend: token losses without ever holding the [N, V] logits (docs/techniques/chunked_ce.md).

Forward walks the *valid* rows in chunks of ``chunk_size``.  For each chunk it builds the
fp32 logits z_k = softcap(H_k Wᵀ + b), the softmax, the token losses and statistics, and
at once the logit gradient

    ∂ℓ_i/∂z_i = g_i (p_i − e_{y_i}) + 2·z_loss·LSE_i·p_i        (g_i: the objective's gate)

times the softcap derivative 1 − (z/s)²; from it grad_h for the chunk's rows and the
chunk's share of grad_W = Σ_k Gₖᵀ H_k, added into one [V, D] buffer owned by the function.
Backward only scales those buffers by the incoming gradient, in place, and hands them to
autograd, so no second head-gradient buffer ever exists (a per-chunk
``torch.utils.checkpoint`` design holds two).  Peak extra memory: O(chunk · V) for the
chunk plus grad_h [N, D] and grad_W [V, D].

Deferred head gradient (``memory.defer_head_grad``, a ``pf.MemoryOptions``).  With tied embeddings the head weight is
also the embedding, whose own gradient arrives at the very end of backward; holding grad_W
from the loss's forward until then costs a V·D buffer through the whole backward (0.72 GiB at
Qwen3-4B).  Deferred, the forward keeps only what rebuilds G per chunk — the valid rows'
indices, gates and LSEs (a few bytes per token) and h — and backward hands autograd no
gradient for W; instead ``result.head_grad.add_to(W.grad)`` adds s·Σ_k Gₖᵀ H_k into the
gradient buffer the weight already has (from the embedding) when the caller decides, e.g.
in the tied weight's post-accumulate-grad hook (``GradientRelease.before_step``).  Cost:
one more head matmul per chunk (the logits are rebuilt, with the same Triton gradient pass as
the forward where it ran: the chunk in W's dtype, in place); one V·D gradient buffer, and only
at the end of backward.  Gradients equal the plain path's up to summation order.
``add_rows_to(out, r0, r1)`` adds only the vocabulary rows [r0, r1) (the slab's logits are
rebuilt, chunk × (r1 − r0)), for a tied weight stepped in row slabs with no V·D buffer at all.

Masked rows are dropped before chunking (one host sync for the count), so prompt tokens cost
nothing and a fully masked chunk never exists.  Gradients equal the dense backend's up to
floating-point summation order.
"""

from __future__ import annotations


import torch
from torch import Tensor

from pgs.func import kernels as K
from pgs.func.losses.head import add_chunk_head_grads, check_options, compute_dtype, flatten_inputs
from pgs.func.losses.objectives import CE, TokenObjective, TokenInputs, resolve_objective
from pgs.func.losses.result import TokenLossResult
from pgs.func.memory_options import NO_MEMORY_OPTIONS, MemoryOptions, memory_options


class _Plan:
    """Everything the autograd function needs besides the differentiable tensors."""

    def __init__(self, objective, inputs, ignore_index, softcap, z_loss, chunk_size,
                 accum_dtype, need_h, need_w, need_b, scale_in_place, deferred=None):
        self.objective = objective
        self.inputs = inputs
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.z_loss = z_loss
        self.chunk_size = int(chunk_size)
        self.accum_dtype = accum_dtype
        self.need_h, self.need_w, self.need_b = need_h, need_w, need_b
        self.scale_in_place = scale_in_place
        self.deferred = deferred  # a DeferredHeadGrad: grad_W is left to it, not to autograd


class DeferredHeadGrad:
    """The head's gradient s·Σ_k Gₖᵀ H_k, not yet computed (see the module docstring).

    Filled by the loss's forward (rows, gates, LSEs, h, W) and backward (the scale s: the
    gradient reaching ``loss_sum``); ``sequence_logps`` (deferring too) fills all of
    it in its backward (gates −∂L/∂logp_sum of each row's sequence, s = 1).  ``add_to(out)``
    adds it into ``out`` [V, D] (any float dtype; the chunk products are formed in W's dtype,
    as the plain path's), chunk by chunk, and then drops everything it holds; it may run once.
    ``ready`` says whether backward has reached the loss.
    """

    #: ``add_to`` rebuilds each chunk with the loss's Triton gradient pass where the forward ran
    #: it (the chunk is W's dtype, overwritten in place; ``pgs.runtime.tools.profile`` reads this).
    KERNEL_PASS = True

    def __init__(self):
        self._saved = None
        self.scale: torch.Tensor | None = None
        self.done = False
        self._inputs = None  # (kernels, per-chunk inputs) cached across add_rows_to calls

    @property
    def ready(self) -> bool:
        return self._saved is not None and self.scale is not None

    def save(self, h, W, bias, labels, rows_all, gates, lses, plan) -> None:
        self._saved = (h.detach(), W.detach(), None if bias is None else bias.detach(), labels, rows_all,
                       gates, lses, plan)
        self._inputs = None

    @torch.no_grad()
    def add_to(self, out: Tensor) -> Tensor:
        """Add the whole head gradient into ``out`` [V, D], then drop what is held (once)."""
        W = self._held()[1]
        self._accumulate(out, 0, W.shape[0])
        self._saved, self.scale, self.done, self._inputs = None, None, True, None
        return out

    @torch.no_grad()
    def add_rows_to(self, out: Tensor, r0: int, r1: int) -> Tensor:
        """Add rows ``[r0, r1)`` of the head gradient, s·Σ_k Gₖ[:, r0:r1]ᵀ H_k, into ``out``
        [r1 − r0, D]; keeps what it holds (call ``discard()`` after the last slab).

        The slab's logits ``H_k W[r0:r1]ᵀ`` are rebuilt per chunk and turned into G with the
        saved LSEs and gates by the same arithmetic as ``add_to`` (the Triton pass where it
        runs; a label outside the slab contributes no −gate), so the rows equal ``add_to``'s up
        to the order of the matmul's sums.  How gradient release with ``memory.tied_slabs``
        steps a tied weight slab by slab without a V×D gradient (docs/memory.md)."""
        W = self._held()[1]
        r0, r1 = int(r0), int(r1)
        if not (0 <= r0 <= r1 <= W.shape[0]) or tuple(out.shape) != (r1 - r0, W.shape[1]):
            raise ValueError(f"add_rows_to: rows [{r0}, {r1}) of a {tuple(W.shape)} head into {tuple(out.shape)}")
        return self._accumulate(out, r0, r1)

    def _held(self):
        if self.done or self._saved is None:
            raise RuntimeError("deferred head gradient: nothing to add (not saved, or already added)")
        if self.scale is None:
            raise RuntimeError("deferred head gradient: backward has not reached the loss yet")
        return self._saved

    def _chunk_inputs(self, kernels: bool, keep: bool) -> list:
        """Per loss chunk, what every slab's product needs and no slab changes: the chunk's
        hidden rows and labels (``index_select``), its gates and LSEs, and for the Triton pass
        the fp32 coefficients.  ``keep``: cache them for the next slabs (``add_rows_to`` runs
        once per slab: 5 slabs × 4 chunks rebuilt these 20 times per step at Qwen3-4B, ~8
        kernels each; they hold |rows|·D of W's dtype until ``discard``)."""
        cached = getattr(self, "_inputs", None)
        if cached is not None and cached[0] == kernels:
            return cached[1]
        h, W, bias, labels, rows_all, gates, lses, plan = self._saved
        out = []
        for start in range(0, rows_all.numel(), plan.chunk_size):
            rows = rows_all[start : start + plan.chunk_size]
            hc = h.index_select(0, rows)
            y = labels.index_select(0, rows)
            gate, lse = gates[start : start + rows.numel()], lses[start : start + rows.numel()]
            if kernels:  # s folded into the fp32 coefficients of the Triton pass
                s32, gate32, lse32 = self.scale.to(torch.float32), gate.float(), lse.float()
                out.append((hc, y, lse32, (gate32 + 2 * plan.z_loss * lse32) * s32, gate32 * s32))
            else:
                out.append((hc, y, lse, gate))
        if keep:
            self._inputs = (kernels, out)
        return out

    def _accumulate(self, out: Tensor, r0: int, r1: int) -> Tensor:
        """out += s·Σ_k Gₖ[:, r0:r1]ᵀ H_k, chunk by chunk (W's dtype for the products)."""
        h, W, bias, labels, rows_all, gates, lses, plan = self._saved
        whole = r0 == 0 and r1 == W.shape[0]
        Ws = W if whole else W[r0:r1]
        bs = bias if (whole or bias is None) else bias[r0:r1]
        scale = self.scale
        kernels = out.dtype == W.dtype and _use_kernels(h, W, plan, out)
        for chunk in self._chunk_inputs(kernels, keep=not whole):
            hc, y = chunk[0], chunk[1]
            y = y if whole else y - r0  # the slab's column of the label (may lie outside)
            if kernels:  # W's dtype, in place: s·(coef·p − gate·e_y), s folded into the fp32 rows
                from pgs.func.losses import triton_ce

                lse32, coef, gate_s = chunk[2], chunk[3], chunk[4]
                z = hc @ Ws.t()
                g = triton_ce.grad_in_place(z, y, bs, plan.softcap, lse32, coef, gate_s)
                add_chunk_head_grads(g, hc, Ws, None, None, out)
                del z, g
                continue
            lse, gate = chunk[2], chunk[3]
            g = logit_grad(chunk_logits(hc, Ws, bs, plan.softcap), lse, y, gate, plan, in_slab=not whole)
            g.mul_(scale.to(g.dtype))
            add_chunk_head_grads(g, hc, Ws, None, None, out)
            del g
        return out

    def discard(self) -> None:
        """Drop what is held (a step that will not run backward, or after the last slab)."""
        self._saved, self.scale, self.done, self._inputs = None, None, True, None


class ChunkedTokenLoss(torch.autograd.Function):
    """Σ_{i∈M} ℓ_i with gradients computed chunk by chunk during the forward pass.

    ``apply(h [N,D], W [V,D], bias [V] | None, labels [N], plan)`` returns
    ``(loss_sum, entropy_sum, target_prob_sum, z_loss_sum)``; only ``loss_sum`` is
    differentiable.  With ``plan.scale_in_place`` (the default of the public functions)
    backward scales the stored gradients in place and may run only once per forward.
    """

    @staticmethod
    def forward(ctx, h, W, bias, labels, plan):
        stats, grads = _forward_and_grads(h, W, bias, labels, plan)
        ctx.grads = grads
        ctx.scale_in_place = plan.scale_in_place
        ctx.deferred = plan.deferred
        ctx.mark_non_differentiable(*stats[1:])
        return stats

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if ctx.grads is None:
            raise RuntimeError(
                "chunked loss: backward ran twice on one forward; its gradients are computed "
                "in the forward pass and scaled in place, so retain_graph is not supported"
            )
        grads = ctx.grads
        ctx.grads = None if ctx.scale_in_place else grads  # drop our reference: autograd may steal
        if ctx.deferred is not None:
            ctx.deferred.scale = grad_loss.detach().clone()
        out = []
        for g in grads:
            if g is None:
                out.append(None)
            elif ctx.scale_in_place:
                out.append(g.mul_(grad_loss.to(g.dtype)))
            else:
                out.append(g * grad_loss.to(g.dtype))
        del grads
        return out[0], out[1], out[2], None, None


def chunk_logits(hc: Tensor, W: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """``head_logits`` without its temporaries: the epilogue runs in place (no autograd here)."""
    z = (hc @ W.t()).to(compute_dtype(hc))
    if bias is not None:
        z.add_(bias)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _use_kernels(h: Tensor, W: Tensor, plan: _Plan, grad_w: Tensor | None) -> bool:
    """Whether the two-pass Triton kernels (``triton_ce``) serve this call.

    On CUDA for fp32/bf16/fp16 logits, unless a bias gradient is needed (the kernels do not
    reduce over rows) or grad_W accumulates in another dtype than W (the kernels round the
    logit gradient to the logits' dtype).  On the CPU only under the Triton interpreter with
    ``KernelConfig.triton_on_cpu`` (tests).  ``KernelConfig.ce_kernels=False`` turns them off
    (``pgs.func.kernels.CONFIG``).
    """
    if not K.CONFIG.ce_kernels or plan.need_b:
        return False
    if W.dtype not in (torch.float32, torch.bfloat16, torch.float16) or h.dtype != W.dtype:
        return False
    if grad_w is not None and grad_w.dtype != W.dtype:
        return False
    if not W.is_cuda and not K.triton_on_cpu():
        return False
    try:
        import pgs.func.losses.triton_ce  # noqa: F401
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    return True


def _kernel_chunk(hc, W, bias, y, rows, plan: _Plan, sums, grad_h, grad_w):
    """One chunk through ``triton_ce``: the logits stay in W's dtype and are read twice.

    Adds the chunk's statistics into ``sums`` and its gradients into ``grad_h``/``grad_w``;
    returns the rows' (gate, LSE)."""
    from pgs.func.losses import triton_ce

    z = hc @ W.t()
    lse, entropy, collision, logp_y = triton_ce.row_stats(z, y, bias, plan.softcap)
    obj = plan.objective
    loss, gate = obj.terms(logp_y, collision if obj.needs_collision else None, plan.inputs.rows(rows))
    if plan.z_loss:
        loss = loss + plan.z_loss * lse.square()
    sums += torch.stack([loss.sum(), entropy.sum(), logp_y.exp().sum(), lse.square().sum()]).to(sums.dtype)
    if plan.need_h or plan.need_w:
        gates = torch.as_tensor(gate, dtype=lse.dtype, device=lse.device).expand(lse.shape)
        g = triton_ce.grad_in_place(z, y, bias, plan.softcap, lse, gates + 2 * plan.z_loss * lse, gates)
        add_chunk_head_grads(g, hc, W, rows, grad_h, grad_w)
    return gate, lse


def _torch_chunk(hc, W, bias, y, rows, plan: _Plan, sums, grad_h, grad_w, grad_b):
    """One chunk by torch ops (any device, fp64 included, bias gradient, fp32 grad_W of bf16).

    Same contract as ``_kernel_chunk``: statistics into ``sums``, gradients into the buffers;
    returns the rows' (gate, LSE)."""
    obj = plan.objective
    z = chunk_logits(hc, W, bias, plan.softcap)
    lse = torch.logsumexp(z, dim=-1)
    logp_y = z.gather(1, y[:, None]).squeeze(1) - lse
    p = (z - lse[:, None]).exp_()
    entropy = lse - torch.linalg.vecdot(p, z)
    collision = torch.linalg.vecdot(p, p) if obj.needs_collision else None
    loss, gate = obj.terms(logp_y, collision, plan.inputs.rows(rows))
    if plan.z_loss:
        loss = loss + plan.z_loss * lse.square()
    sums += torch.stack([loss.sum(), entropy.sum(), logp_y.exp().sum(), lse.square().sum()])
    if not (plan.need_h or plan.need_w or plan.need_b):
        return gate, lse
    g = logit_grad(z, lse, y, gate, plan, p=p)
    del z
    if plan.need_b:
        grad_b += g.sum(0)
    add_chunk_head_grads(g, hc, W, rows, grad_h, grad_w)
    return gate, lse


def _forward_and_grads(h, W, bias, labels, plan: _Plan):
    cdtype = compute_dtype(h)
    V, D = W.shape
    rows_all = (labels != plan.ignore_index).nonzero().squeeze(1)
    grad_h = torch.zeros_like(h) if plan.need_h else None
    grad_w = torch.zeros(V, D, dtype=plan.accum_dtype or W.dtype, device=W.device) if plan.need_w else None
    grad_b = torch.zeros(V, dtype=cdtype, device=W.device) if plan.need_b else None
    sums = torch.zeros(4, dtype=cdtype, device=h.device)  # loss, entropy, p_y, LSE²
    gates: list[Tensor] = []
    lses: list[Tensor] = []
    kernels = _use_kernels(h, W, plan, grad_w)
    for start in range(0, rows_all.numel(), plan.chunk_size):
        rows = rows_all[start : start + plan.chunk_size]
        hc = h.index_select(0, rows)
        y = labels.index_select(0, rows)
        if kernels:
            gate, lse = _kernel_chunk(hc, W, bias, y, rows, plan, sums, grad_h, grad_w)
        else:
            gate, lse = _torch_chunk(hc, W, bias, y, rows, plan, sums, grad_h, grad_w, grad_b)
        if plan.deferred is not None:
            gates.append(torch.as_tensor(gate, dtype=cdtype, device=h.device).expand(rows.numel()).detach())
            lses.append(lse)
    # Separate tensors (not views of ``sums``): autograd outputs must not alias each other.
    stats = (sums[0].clone(), *(s.float().clone() for s in sums[1:].unbind()))
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    if plan.deferred is not None:
        empty = torch.zeros(0, dtype=cdtype, device=h.device)
        plan.deferred.save(h, W, bias, labels, rows_all, torch.cat(gates) if gates else empty,
                           torch.cat(lses) if lses else empty, plan)
    return stats, (grad_h, grad_w, grad_b)


def logit_grad(z: Tensor, lse: Tensor, y: Tensor, gate, plan: _Plan, p: Tensor | None = None,
                in_slab: bool = False) -> Tensor:
    """G = ((g + 2 z_loss LSE) p − g e_y) · softcap′ for one chunk, in place in p's (or z's) storage.

    ``z`` is the chunk's softcapped logits (overwritten when a softcap is on), ``p`` its
    softmax (rebuilt from ``z`` and ``lse`` when not given).  ``in_slab``: ``z`` holds a slab
    of the vocabulary's columns and ``y`` the labels' columns in it; rows whose label lies
    outside get no −g (``gate`` is then a per-row tensor)."""
    if p is None:
        p = (z - lse[:, None]).exp_()
    g = p.mul_((gate + 2 * plan.z_loss * lse)[:, None])
    if in_slab:  # no host sync (nonzero would size by the data): rows outside subtract 0 at column 0
        inside = (y >= 0) & (y < g.shape[1])
        g[torch.arange(y.numel(), device=g.device), torch.where(inside, y, 0)] -= \
            torch.where(inside, gate, 0).to(g.dtype)
    else:
        g[torch.arange(y.numel(), device=g.device), y] -= gate
    if plan.softcap is not None:
        g.mul_(z.div_(plan.softcap).square_().neg_().add_(1))  # dz/dz_raw = 1 − tanh²
    return g


def target_logprobs(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> Tensor:
    """log p_{i,y} for every token (0 at ignored ones), detached, in O(chunk · V) memory.

    fp32 (fp64 for fp64 h).

    The pre-pass for objectives that need a statistic of the whole call before any gradient
    (Cayley's p̄, CADFT's sample likelihoods); also how a runtime scores targets with a frozen
    reference model for InfoSFT's ``q_source="reference"``.
    """
    out = torch.zeros(labels.shape, dtype=compute_dtype(h), device=h.device)
    flat = out.view(-1)
    for rows, z, y in _target_chunks(h, W, labels, bias, softcap, ignore_index, chunk_size):
        flat.index_copy_(0, rows, z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1))
    return out


def _target_chunks(h, W, labels, bias, softcap, ignore_index, chunk_size):
    """``(rows, z, y)`` per chunk of the valid rows of the flattened call: the rows' indices,
    their logits [rows, V] (no autograd) and their targets; the shapes checked first."""
    check_options(softcap, 0.0, chunk_size)
    h, labels, _ = flatten_inputs(h, W, labels, bias)
    rows_all = (labels != ignore_index).nonzero().squeeze(1)
    with torch.no_grad():
        for start in range(0, rows_all.numel(), chunk_size):
            rows = rows_all[start : start + chunk_size]
            yield rows, chunk_logits(h.index_select(0, rows), W, bias, softcap), labels.index_select(0, rows)


def token_nll_entropy(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Per-token NLL and full-vocabulary entropy of the head, detached, in O(chunk · V) memory.

    nll_i = LSE(z_i) − z_{i,y_i};  H_i = − Σ_v p_i(v) log p_i(v) = LSE(z_i) − Σ_v p_i(v) z_{i,v}
    (nats), with z = softcap(h Wᵀ + b) and p = softmax(z).  Both are 0 at ignored positions.
    fp32 (fp64 for fp64 h).  The scores ``pgs prepare`` records per sample (familiarity = mean
    NLL, mean entropy, HES, docs/techniques/hes.md) come from here, so that scoring never holds the
    ``[N, V]`` logits of a whole batch.
    """
    nll = torch.zeros(labels.shape, dtype=compute_dtype(h), device=h.device)
    entropy = torch.zeros_like(nll)
    nll_flat, entropy_flat = nll.view(-1), entropy.view(-1)
    for rows, z, y in _target_chunks(h, W, labels, bias, softcap, ignore_index, chunk_size):
        lse = torch.logsumexp(z, dim=-1)
        nll_flat.index_copy_(0, rows, lse - z.gather(1, y[:, None]).squeeze(1))
        entropy_flat.index_copy_(0, rows, (lse - (torch.softmax(z, dim=-1) * z).sum(-1)).clamp_min_(0))
    return nll, entropy


def chunked_token_loss(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    objective: str | TokenObjective = "ce",
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype | None = None,
    p_bar: Tensor | float | None = None,
    ref_logprobs: Tensor | None = None,
    doc_ids: Tensor | None = None,
    compat: Tensor | None = None,
    memory: MemoryOptions = NO_MEMORY_OPTIONS,
    _scale_in_place: bool = True,
) -> TokenLossResult:
    """Σ_{i∈M} ℓ_i for any objective in O(chunk_size · V) extra memory (docs/techniques/chunked_ce.md).

    Arguments as ``token_loss``; ``accum_dtype`` is the dtype of the grad_W buffer (default
    W's dtype, as Liger does; ``torch.float32`` trades V·D·2 more bytes for exact accumulation
    of bf16 chunks).  ``memory.defer_head_grad`` (``memory``: a ``pf.MemoryOptions``): autograd gets
    no gradient for W; ``result.head_grad.add_to(buffer)`` adds it later (see the module docstring).
    """
    check_options(softcap, z_loss, chunk_size)
    obj = resolve_objective(objective)
    h, labels, extra = flatten_inputs(
        h, W, labels, bias, ref_logprobs=ref_logprobs, doc_ids=doc_ids, compat=compat
    )
    valid = labels != ignore_index

    def prepass() -> Tensor:
        return target_logprobs(
            h, W, labels, bias=bias, softcap=softcap, ignore_index=ignore_index, chunk_size=chunk_size
        )

    inputs: TokenInputs = obj.prepare(
        prepass, valid, p_bar=p_bar, ref_logprobs=extra["ref_logprobs"],
        doc_ids=extra["doc_ids"], compat=extra["compat"],
    )
    grad_on = torch.is_grad_enabled()
    plan = _Plan(
        obj, inputs, ignore_index, softcap, z_loss, chunk_size, accum_dtype,
        need_h=grad_on and h.requires_grad,
        need_w=grad_on and W.requires_grad,
        need_b=grad_on and bias is not None and bias.requires_grad,
        scale_in_place=_scale_in_place,
    )
    if memory_options(memory, "chunked_token_loss").defer_head_grad and plan.need_w:
        plan.need_w = False
        plan.deferred = DeferredHeadGrad()
    loss_sum, entropy_sum, p_sum, lse_sq_sum = ChunkedTokenLoss.apply(h, W, bias, labels, plan)
    return TokenLossResult(
        loss_sum=loss_sum,
        num_valid=valid.sum(),
        entropy_sum=entropy_sum,
        target_prob_sum=p_sum,
        z_loss_sum=lse_sq_sum,
        head_grad=plan.deferred,
    )


def chunked_cross_entropy(
    h: Tensor,
    W: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype | None = None,
) -> TokenLossResult:
    """Cross-entropy summed over valid tokens without materializing [N, V] logits (docs/techniques/chunked_ce.md).

    L_sum = Σ_k Σ_{i∈chunk k} (LSE(z_i) − z_{i,y}),  z_k = (H_k Wᵀ + b) in fp32, softcapped;
    the runtime divides by the global |M|, never by a chunk's count.  Gradients are computed in
    the forward pass (one grad_W buffer), equal to ``cross_entropy``'s up to summation order.
    Chunking as in Liger's fused linear cross-entropy and torchtune's chunked CE; no paper.

    Example:
        >>> h = torch.randn(10, 8, requires_grad=True)
        >>> W = torch.randn(50, 8, requires_grad=True)
        >>> labels = torch.randint(0, 50, (10,))
        >>> r = chunked_cross_entropy(h, W, labels, chunk_size=4)
        >>> (r.loss_sum / r.num_valid).backward()
    """
    return chunked_token_loss(
        h, W, labels, objective=CE(), bias=bias, softcap=softcap, ignore_index=ignore_index,
        z_loss=z_loss, chunk_size=chunk_size, accum_dtype=accum_dtype,
    )
