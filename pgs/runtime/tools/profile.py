"""``pgs profile``: predict where a run's GPU memory goes, and (on CUDA) measure it.

``predict_memory(config, ...)`` returns bytes per category (docs/memory.md):

- ``weights``: every parameter and buffer of the model, counted from a model built on the
  meta device (exact: tied weights once, buffers such as rotary frequencies included).
- ``frozen_models``: the weights of the frozen models the spec's objective keeps on the device
  (``objective_memory``): a ``[preference]`` live reference (a copy of the policy, or
  ``reference_path``'s model), a ``[distill]`` teacher (in ``distill.teacher_dtype``).
- ``master_weights``: fp32 copies of low-precision trainable parameters (4 B each) when asked.
- ``optimizer_state``: the chain's real state, built by ``chain.init`` on meta parameters
  (one state per release group under gradient release, as ``GradientRelease`` builds it),
  or ``state_bytes_per_param × trainable parameters`` when no chain is given.  With
  ``offload_optimizer`` (release only) the state lives in pinned host memory (``host_state``,
  not part of ``total``/``peak``) and the device holds the staging slots (``offload.auto_slots``
  of them, ``offload.slot_size`` each: a group larger than a slot takes them all; leaves padded
  to 64 B);
  ``pcie_per_step`` is 2 × the host state (each group's state in and out once per step).
  With offloaded checkpoints the kept layer inputs wait in pinned host memory
  (``host_inputs``: checkpointed layers × the inputs each keeps × b·h per token, at their own
  size: ``pgs.runtime.pinned.HostPool``).
- ``gradients``: all trainable gradients (``bind``); under gradient release, the largest
  group's gradients (one decoder layer's, or the embedding's).
- ``activations``: what backward keeps, per decoder layer and token (``activation_bytes``
  has the formula), for checkpointing ``none`` / ``full`` / ``selective``.
- ``loss``: chunked loss: chunk × V × 4 B × 3 (fp32 logits, softmax, logit gradient) plus
  the head-gradient buffer V × D and grad_h N × D it holds from forward to backward; dense
  loss: N × V × (dtype + 4 + 4) B (logits, fp32 upcast, their gradient).
- ``temporaries``: two fp32 temporaries of the largest tensor's update (2 × 4 B × numel;
  the roughest category: it depends on the chain and on whether a fused kernel runs); 0 when
  gradient release steps with a fused in-place kernel (``fused_update``; 4 B × numel for the
  fp32 cast of the gradient with fp32 masters).
- With ``defer_head_grad`` (release, tied head, chunked loss) the loss holds grad_h, h and
  16 B per token instead of the V × D buffer; the head's gradient is rebuilt into the
  embedding's gradient at the end of backward (one chunk's work then).
- The head's loss is the one the spec's objective runs (``head_loss``): SFT's token loss
  (``loss.backend``), ``[preference]``'s sequence log-probs (chunked, deferred as SFT's: their
  backward holds one chunk's logits, b B per element with the Triton passes, like the chunked
  loss's forward), ``[distill]``'s chunked divergence (never deferred).
- With ``tied_slabs`` (release) the embedding's V × D gradient is replaced by one slab's
  (rows × D) plus the looked-up rows' gradients and their per-id sums, and the head's rebuilt
  chunk spans the slab's columns only (``predict_memory``'s ``tied_slabs``).

``total`` is their sum (an upper bound).  ``peak`` takes phases into account: static
(weights, frozen models, masters, state) plus the largest of (end of forward: kept
activations + the loss's held buffers + the larger of the loss's chunk and a frozen model's
no-grad forward), (backward of a recomputed layer: kept + recompute + held buffers +
gradients) and (the last update: gradients + temporaries); and, for the objectives that have
them, the on-policy sampling phase (static + KV cache + prefill), the reference cache's
scoring pass before the first step (weights + its forward) and a ``[preference]`` evaluation
(static + its forward of 8 rows).  ``peak_parts`` names what is live at the worst phase: it
sums to ``peak``, and the preflight's line names those parts.  Neither counts allocator slack
(a few tenths of a GiB: docs/performance.md, "Peers and ceilings") or the CUDA/NCCL context.

``measure_memory`` (``pgs profile --measure``) runs a few steps of the objective the spec
trains, through that objective's own ``prepare``/``forward`` (``Objective.for_profile`` builds
it with one synthetic micro-batch of the spec's shapes), and reports the peak per phase: the
caching allocator's on CUDA, ``TensorMeter``'s live tensor bytes elsewhere.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import pgs.func as pf
from pgs.errors import InvalidArgument
from pgs.runtime.common import auto_device, run_device
from pgs.func.losses import chunked
from pgs.func.plan import RELEASE, plan_for
from pgs.runtime.model.build import build_config, build_model, freeze, resolve_dtype as _dtype
from pgs.runtime.model.loading import load_tokenizer
from pgs.runtime.model.layers import apply_activation_checkpointing, frozen_prefix, skip_frozen_prefix
from pgs.runtime.model.tiled_mlp import apply_mlp_tiles
from pgs.runtime.optim.bound import bind
from pgs.runtime.optim.release import GradientRelease, group_of, group_parameters, refusal
from pgs.runtime.optim.config import checkpoint_offload, head_grad_wanted

CATEGORIES = ("weights", "frozen_models", "master_weights", "optimizer_state", "gradients", "activations", "loss",
              "temporaries", "kv_cache")
GiB = 1024**3
#: Bytes per [chunk, V] element the distillation loss holds at its fullest (``pgs.func.losses.distill``):
#: about ten fp32 tensors — both heads' logits, log-probabilities and probabilities, the JSD's
#: mixture, and the per-row divergence's and the gradient's temporaries (rough: the kind decides).
DISTILL_CHUNK_BYTES = 40


# ----------------------------------------------------------------------------- model shapes


def _hf_config(model_config):
    if isinstance(model_config, dict):
        return build_config(model_config)
    return model_config


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def meta_model(model_config, dtype=torch.bfloat16, trust_remote_code: bool = False):
    """The HF causal LM of ``model_config`` (a config or a ``{model_type = ...}`` table) on the
    meta device: shapes and dtypes, no memory."""
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(model_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=_dtype(dtype), trust_remote_code=trust_remote_code)


def model_bytes(model) -> int:
    """Bytes of every parameter (tied ones once) and buffer of ``model`` (meta or real)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------- activations


def activation_bytes(cfg, tokens: int, **kwargs) -> int:
    """``kept + recompute`` of ``activation_parts``: what backward holds at its fullest."""
    kept, recompute = activation_parts(cfg, tokens, **kwargs)
    return kept + recompute


def activation_parts(cfg, tokens: int, *, dtype=torch.bfloat16, policy: str = "none", every: int = 1,
                     gqa_native: bool = True, offload: bool | int = False, mlp_tiles: int = 0, compiled: bool = False,
                     experts_eager: bool = False, cached_kv: bool = False, no_backward: int = 0) -> tuple[int, int]:
    """``(kept, recompute)``: bytes that forward leaves for backward for ``tokens`` tokens of a
    HF Qwen3/Llama-style decoder, and the extra bytes of one layer recomputed in backward.

    Per token and layer, with b the activation dtype's bytes, h hidden, I intermediate,
    q = n_q·d and k = n_kv·d (k' = k with native GQA in SDPA, q when keys are repeated):

        norm(x)      = 4h + 4 + b·h            (fp32 copy of x, 1/rms, normed x before ·w)
        qk_norm      = 4(q + k) + 4(n_q + n_kv) + b(q + k)
        A_none       = 2·norm + 2·b·h           (inputs of the q/k/v and gate/up matmuls)
                       + qk_norm + b(q + 2k')   (rotated q, k and v, saved by attention)
                       + b·q + 4·n_q            (attention output, also o_proj's input, and
                                                 its log-sum-exp)
                       + 4·b·I                  (gate, SiLU(gate), up, their product)
        A_full       = b·h                      (only the layer input is kept)
        A_selective  = b·h + b(q + 2k) + b·q + 4·n_q + 2·b·h + 2·b·I
                                                (matmul and attention outputs)

    ``recompute``: a checkpointed layer rebuilds its A_none in backward (A_none − A_kept more
    than it kept).  Layers that ``every`` skips keep A_none.  Outside the layers: the final norm
    and its output (the hidden state the loss reads), ``norm(x) + b·h``, and the rotary
    tables cos and sin, shared by all layers (2·b·d per token).  Without checkpointing the
    formula equals the bytes autograd saves for a HF Qwen3 in fp32 and bf16 exactly
    (tests/unit/test_profile.py); the working set of backward itself (activation gradients,
    ≈ one layer's A_none) is not included.  ``offload`` (``"full"`` only): the checkpointed
    layers' inputs live in host memory, so they keep 0 on the device; the recompute then also
    holds the input copied back (b·h), and with ``offload = d`` (``memory.offload_prefetch``) the
    d − 1 further inputs fetched ahead ((d − 1)·b·h).  ``mlp_tiles = k > 1`` (``pgs.runtime.model.tiled_mlp``): the
    MLP keeps none of its 4·b·I per token (its input is the second norm's output, counted
    above) and its backward holds one tile's tensors, ≈ 8·b·I for ⌈tokens / k⌉ tokens.
    ``"sublayer"``: each layer keeps two inputs (2·b·h; 0 offloaded) and backward recomputes
    one half at a time: max(attention half, MLP half), each ``norm + b·h`` plus its own terms.
    ``compiled`` (``compile_layers``): inductor's partitioner saves neither the norms' fp32
    copies of their inputs (4h each, and 4(q + k) in the q/k norms) nor one of the MLP's four
    [tokens, I] tensors (it recomputes them from what it keeps): A_none − 8h − 4(q + k) − b·I.
    Checked against inductor's saved tensors on the CPU within 5% (tests/unit/test_profile.py); the
    comparison with a GPU run is in docs/performance.md.

    ``cached_kv`` (a SeCO chunk, ``pgs.runtime.model.seco``): the chunk's attention saves only its
    queries; the rotated keys and values live in the row's cache (``seco_cache_bytes``) and the
    log-sum-exp is recomputed: A_none − 2·b·k' − 4·n_q.

    Mixture-of-experts layers (Qwen3-MoE, OLMoE, Mixtral: E experts, k per token, expert
    intermediate I_e) replace the MLP's 4·b·I with k·(4·b·I_e + 2·b·h) + (b + 4)·E + 4k: each of
    a token's k expert MLPs keeps its four [I_e] tensors, its gathered input and its output
    before the routing weight, and the router its logits, their fp32 softmax and the k
    weights.  That is what transformers' ``grouped_mm`` experts save (within 2% on the CPU,
    tests/unit/test_profile.py); its ``eager`` loop keeps one more k·b·h per token.

    Gated DeltaNet layers of a hybrid model (``layer_types`` entries ``"linear_attention"``)
    replace the attention terms with their mixer's (``_linear_mixer_bytes``).  Qwen3.5's and
    Qwen3-Next's RMSNorms keep their fp32 output (norm(x) = 8h + 4, qk_norm = 8(q + k) +
    4(n_q + n_kv)) and their attention a sigmoid output gate (3·b·q more).  ``no_backward``: the first
    layers that run without autograd (``layers.skip_frozen_prefix``), which keep nothing.
    """
    if policy not in ("none", "full", "selective", "sublayer"):
        raise InvalidArgument(f"activation_bytes: policy={policy!r} is not none, full or selective")
    c = _text_config(cfg)
    b = torch.empty((), dtype=_dtype(dtype)).element_size()
    h = c.hidden_size
    inter = c.intermediate_size
    n_layers = c.num_hidden_layers
    n_q = c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or n_q
    d = getattr(c, "head_dim", None) or h // n_q
    q, k = n_q * d, n_kv * d
    k_att = k if (gqa_native or n_kv == n_q) else q
    norm = 8 * h + 4 if _fp32_norm(c) else 4 * h + 4 + b * h
    qk_norm, gate = _qk_norm_and_gate(c, b, q, k, n_q, n_kv)
    tiled = mlp_tiles > 1
    if compiled:  # inductor recomputes the fp32 copies and one [tokens, I] tensor
        norm -= 4 * h
        qk_norm -= 4 * (q + k) if qk_norm else 0
    mlp = 0 if tiled else (3 if compiled else 4) * b * inter
    moe = _experts_shape(c)
    if moe is not None and not tiled:  # a routed MLP: k expert MLPs per token, their inputs, the router
        n_experts, top_k, inter_e = moe
        mlp = top_k * ((3 if compiled else 4) * b * inter_e + (3 if experts_eager else 2) * b * h)
        mlp += (b + 4) * n_experts + 4 * top_k
    a_none = 2 * norm + 2 * b * h + qk_norm + b * (q + 2 * k_att) + b * q + 4 * n_q + gate + mlp
    attn_half = norm + b * h + qk_norm + b * (q + 2 * k_att) + b * q + 4 * n_q + gate
    if cached_kv:  # chunk-wise training: the chunk's keys/values live in the row's cache
        a_none -= 2 * b * k_att + 4 * n_q
        attn_half -= 2 * b * k_att + 4 * n_q
    linear = _linear_mixer_bytes(c, b)
    a_kept = {"none": a_none, "full": b * h, "sublayer": 2 * b * h,
              "selective": b * h + b * (q + 2 * k) + b * q + 4 * n_q + 2 * b * h + 2 * b * inter}[policy]
    if offload and policy not in ("full", "sublayer"):
        raise InvalidArgument(f"activation_bytes: offload needs policy \"full\" or \"sublayer\", got {policy!r}")
    types = list(getattr(c, "layer_types", None) or [])
    final_norm = 8 * h + 4 if _fp32_norm(c) else 4 * h + 4 + b * h  # eager, also in compiled runs
    per_token, worst = final_norm + b * h + 2 * b * _rotary_dim(c, d), 0  # final norm and output; rotary cos, sin
    checkpointed = 0
    for i in range(n_layers):
        if i < no_backward:  # run without autograd: nothing kept, nothing recomputed
            continue
        mixer = linear if i < len(types) and types[i] == "linear_attention" and linear else None
        layer = a_none if mixer is None else 2 * norm + 2 * b * h + mixer + mlp
        half = attn_half if mixer is None else norm + b * h + mixer
        if policy == "none" or i % every:
            per_token += layer
            continue
        checkpointed += 1
        per_token += 0 if offload else a_kept
        if policy == "sublayer":  # one half recomputed at a time (+ its input copied back)
            worst = max(worst, max(half, norm + b * h + mlp) + (b * h if offload else 0))
        else:
            worst = max(worst, layer - (0 if offload else a_kept))
    recompute = worst * tokens
    if tiled:  # one tile's working set in the MLP's backward
        recompute += 8 * b * inter * -(-tokens // mlp_tiles)
    if offload and checkpointed:  # inputs fetched further ahead than the next one (offload_prefetch)
        recompute += (int(offload) - 1) * b * h * tokens
    return per_token * tokens, recompute


def seco_cache_bytes(cfg, tokens: int, chunk_tokens: int, *, dtype=torch.bfloat16) -> tuple[int, int]:
    """``(cache, span)`` of chunk-wise training (``memory.seco_chunk``, ``pgs.runtime.model.seco``)
    for ``tokens`` tokens of rows cut in chunks of ``chunk_tokens`` tokens (rows × chunk): the
    rotated keys and values of every layer, 2·L·n_kv·d·b per token, and their gradient
    accumulators over the tokens before the last chunk (as many bytes per token); ``span``: the
    gradient of one layer's cached keys/values that a chunk's attention backward builds at most
    (2·n_kv·d·b per token of the row).  Checked against ``RowState.cache_bytes`` and the saved
    tensors of a chunk's recompute on the CPU (tests/unit/test_seco_memory.py)."""
    c = _text_config(cfg)
    b = torch.empty((), dtype=_dtype(dtype)).element_size()
    n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * n_kv * d * b
    earlier = max(tokens - chunk_tokens, 0)
    return c.num_hidden_layers * per_token * (tokens + earlier), per_token * tokens


def offloaded_input_bytes(cfg, tokens: int, *, dtype=torch.bfloat16, policy: str = "full", every: int = 1,
                          no_backward: int = 0) -> int:
    """Host bytes of the checkpointed layers' inputs with ``offload_checkpoints``: each
    checkpointed layer keeps its input (``"full"``) or its two sublayers' inputs
    (``"sublayer"``), b·h per token each, all of a step's forward at once (the first
    ``no_backward`` layers, run without autograd, keep none)."""
    if policy not in ("full", "sublayer"):
        return 0
    c = _text_config(cfg)
    b = torch.empty((), dtype=_dtype(dtype)).element_size()
    layers = len([i for i in range(0, c.num_hidden_layers, every) if i >= no_backward])
    return layers * (2 if policy == "sublayer" else 1) * b * c.hidden_size * int(tokens)


#: Families whose RMSNorm returns ``normed·(1 + w)`` computed in fp32 (it keeps its fp32 output).
_ONE_PLUS_W_NORM = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def _fp32_norm(c) -> bool:
    return getattr(c, "model_type", "") in _ONE_PLUS_W_NORM


def _qk_norm_and_gate(c, b: int, q: int, k: int, n_q: int, n_kv: int) -> tuple[int, int]:
    """Bytes per token the q/k norms keep, and an output gate's.  Qwen3.5 and Qwen3-Next: (1 + w)
    norms that keep their fp32 input and output (in an fp32 model q's input is a view of q_proj's
    whole [q, gate] output), and ``o_proj(attention · sigmoid(gate))``: the sigmoid's output,
    the attention output reshaped for the product, and the product."""
    if _fp32_norm(c):
        return 8 * (q + k) + 4 * (n_q + n_kv) + (4 * q if b == 4 else 0), 3 * b * q
    return (4 * (q + k) + 4 * (n_q + n_kv) + b * (q + k) if _has_qk_norm(c) else 0), 0


def _rotary_dim(c, head_dim: int) -> int:
    """The rotated part of a head (``partial_rotary_factor``: Qwen3.5 rotates a quarter)."""
    rope = getattr(c, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) if isinstance(
        rope, dict) else getattr(c, "partial_rotary_factor", 1.0)
    return int(head_dim * float(factor or 1.0))


def _linear_mixer_bytes(c, b: int, kernels: bool = True) -> int:
    """Bytes per token a Gated DeltaNet mixer keeps through the fused path
    (``pgs.runtime.model.linear_attention``, flash-linear-attention's kernels); ``kernels=False``:
    only what autograd keeps around fla's two kernels; 0 for a config without linear-attention
    heads.  With HV value heads of d_v, H_k key heads, key_dim kd, value_dim vd and
    C = 2·kd + vd convolution channels:

        around the kernels = b·HV (β) + 8·HV (softplus's fp32 input and output of the decay)
                             + 12·vd + 4·HV + 2·b·vd (the gated norm: fp32 input, 1/rms, fp32
                             gate, SiLU(gate), normed and weighted output) + b·vd (o_proj's input)
        kernels            = b·C (the convolution's input) + b(2·kd + vd) + 8·H_k (normalized q
                             and k, their 1/‖·‖, v) + 4·HV (cumulated decay) + 64·b·HV (the
                             chunk's triangular system, 64-token chunks)

    (+ b·HV for OLMo-Hybrid's β ∈ [0, 2)).  The recurrent state is not kept: fla's backward
    recomputes it chunk by chunk."""
    heads_v = getattr(c, "linear_num_value_heads", None)
    if not heads_v:
        return 0
    heads_k = int(c.linear_num_key_heads)
    kd, vd = heads_k * int(c.linear_key_head_dim), int(heads_v) * int(c.linear_value_head_dim)
    around = b * heads_v + 8 * heads_v + 12 * vd + 4 * heads_v + 2 * b * vd + b * vd
    if getattr(c, "linear_allow_neg_eigval", False):
        around += b * heads_v
    channels = 2 * kd + vd  # the convolution's input; then q and k normalized, v made contiguous
    inside = b * channels + b * (2 * kd + vd) + 8 * heads_k + 4 * heads_v + 64 * b * heads_v
    return around + (inside if kernels else 0)


def _has_qk_norm(c) -> bool:
    return getattr(c, "model_type", "") in ("qwen3", "qwen3_moe", "qwen3_next", "olmo2", "olmoe", "gemma3",
                                            "gemma3_text")


def _experts_shape(c) -> tuple[int, int, int] | None:
    """``(experts, experts per token, expert intermediate size)`` of a mixture-of-experts
    config (Qwen3-MoE, OLMoE, Mixtral naming), or None for a dense one."""
    n = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    k = getattr(c, "num_experts_per_tok", None)
    if not n or not k:
        return None
    return int(n), int(k), int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)


# ----------------------------------------------------------------------------- prediction


def _trainable(model, trainable: Callable[[str], bool] | None) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad and (trainable is None or trainable(n)):
            out[n] = p.detach()
    return out


def chunk_work_bytes(rows: int, vocab: int, b: int, kernels: bool) -> tuple[int, int]:
    """(forward, rebuild) bytes one chunk of the chunked loss holds (``pgs.func.losses.chunked``).

    Forward: with the Triton passes (CUDA) only the chunk's logits in the weights' dtype,
    overwritten in place by their gradient (b B per element); the torch path holds fp32
    logits, softmax and a product temporary (12 B).  Rebuild (the deferred head gradient,
    ``DeferredHeadGrad.add_to``, at the end of backward): b B per element when it runs the
    same Triton pass (``DeferredHeadGrad.KERNEL_PASS``), else fp32 logits and softmax (8 B).
    """

    elements = int(rows) * int(vocab)
    forward = elements * (b if kernels else 12)
    rebuild = elements * (b if kernels and getattr(chunked.DeferredHeadGrad, "KERNEL_PASS", False) else 8)
    return forward, rebuild


def _staging_bytes(sizes: list[int], slots: int | None) -> int:
    """Device bytes of ``OffloadedRelease``'s staging slots for group states of ``sizes`` bytes
    (``slots`` None: the release's own choice, ``offload.auto_slots``)."""
    from pgs.runtime.optim.offload import auto_slots, slot_size

    n = auto_slots(sizes) if slots is None else int(slots)
    return n * slot_size(sizes, n)


def predict_memory(
    model_config,
    *,
    dtype=torch.bfloat16,
    chain: pf.Transform | None = None,
    state_bytes_per_param: float | None = None,
    gradient_release: bool = False,
    release_groups: str = "layer",
    master_weights: str | None = None,
    activation_checkpointing: str = "none",
    checkpoint_every: int = 1,
    checkpoint_offload: bool | int = False,
    micro_batch_tokens: int = 4096,
    loss: str = "chunked",
    loss_chunk: int = 1024,
    vocab: int | None = None,
    trainable: Callable[[str], bool] | None = None,
    gqa_native: bool = True,
    model=None,
    fused_update: bool | None = None,
    defer_head_grad: bool | str | None = None,
    loss_kernels: bool | None = None,
    tied_slabs: int | None = None,
    mlp_tiles: int = 0,
    compiled_layers: bool = False,
    experts_eager: bool = False,
    offload_optimizer: bool = False,
    offload_slots: int | None = None,
    frozen_weights: int = 0,
    frozen_forward: int = 0,
    frozen_held: int = 0,
    sampling: int = 0,
    scoring_pass: int = 0, eval_pass: int = 0, seco_chunk_tokens: int = 0,
    ranks: int = 1,
) -> dict[str, int]:
    """Bytes per category (``CATEGORIES``) plus ``total`` and ``peak``.  See the module docstring.

    Args:
        model_config: a ``transformers`` config or a ``{model_type = ..., ...}`` table.
        dtype: the parameters' (and activations') dtype.
        chain: the optimizer chain (its real state is sized on meta tensors); or give
            ``state_bytes_per_param`` (e.g. 8 for fp32 AdamW, 1.02 for Lion8bit).
        gradient_release: size gradients and state as ``GradientRelease`` holds them.
        master_weights: ``"fp32"`` adds 4 B per low-precision trainable parameter.
        activation_checkpointing, checkpoint_every, checkpoint_offload: as
            ``apply_activation_checkpointing`` (``offload``).
        micro_batch_tokens: tokens in one forward (micro-batch × sequence length).
        loss: ``"chunked"`` (any backend that never holds [N, V]) or ``"dense"``.
        experts_eager: ``eager`` expert loop of a mixture-of-experts model (one more [tokens·k, hidden] per layer).
        loss_chunk: rows per chunk of the chunked loss.
        vocab: overrides the config's vocabulary size.
        trainable: ``name -> bool``; None trains every parameter.
        model: a (meta or real) model to size instead of building one from the config.
        fused_update: release steps with an in-place fused kernel (None: when the chain has
            one — ``pgs.func.plan.plan_for(chain, RELEASE)``).
        defer_head_grad: ``memory.defer_head_grad``: the tied head's gradient joins the
            embedding's at the end of backward, where ``pgs run`` can defer it (release, a
            chunked loss, a trainable tied head).  ``"auto"`` (or None): with checkpointing or
            tied slabs; True: always there; False: never.
        loss_kernels: the chunked loss runs its two Triton passes (CUDA; ``chunk_work_bytes``
            has what each path holds per chunk).  None: ``pgs.func.kernels.CONFIG.ce_kernels`` —
            the prediction is for a CUDA run even where it is made on a CPU.
        tied_slabs: rows per slab (``memory.tied_slabs``, release only):
            the embedding's V×D gradient is replaced by a slab's working set at the end of
            backward — the slab's gradient (rows·D·b), the looked-up rows' gradients and their
            sums (N·D·b each; N·D·8 more while summed in fp32), and the head's rebuilt chunk
            for the slab's columns (chunk × rows).
        mlp_tiles: the decoder MLPs computed in that many token slices (``activation_parts``).
        compiled_layers: the decoder layers are ``torch.compile``d (``activation_parts``' ``compiled``).
        offload_optimizer: the state in pinned host memory, ``offload_slots`` staging buffers on the device
            (None: as many as ``OffloadedRelease`` takes, ``offload.auto_slots``; needs
            ``gradient_release``): adds ``host_state`` and ``pcie_per_step`` (bytes) to the result.
        frozen_weights, frozen_forward, frozen_held, sampling, scoring_pass, eval_pass: what the
            objective adds (``objective_memory``): its frozen models' weights on the device (a live
            reference, a teacher: ``frozen_models``), their no-grad forward and what it leaves for
            the loss (at the end of the policy's forward), the on-policy sampling phase (KV cache,
            prefill), the reference cache's scoring pass before the first step (weights only, no
            state yet), ``[preference]``'s evaluation (8 rows a no-grad forward, the state beside).
        seco_chunk_tokens: ``memory.seco_chunk``'s tokens per chunk forward (``_activation_memory``).
        ranks: FSDP2 processes: the state is one rank's, ``state_total`` all ranks' (``sharded_state_bytes``).

    Example::

        predict_memory({"model_type": "qwen3", "hidden_size": 2560, ...},
                       chain=pf.lion8bit(1e-5), gradient_release=True,
                       activation_checkpointing="full", micro_batch_tokens=4096)
    """
    cfg = _hf_config(model_config)
    if vocab is not None:
        cfg.vocab_size = int(vocab)
    dt = _dtype(dtype)
    model = meta_model(cfg, dt) if model is None else model
    params, c = _trainable(model, trainable), _text_config(cfg)
    out = {**dict.fromkeys(CATEGORIES, 0), "weights": model_bytes(model), "frozen_models": int(frozen_weights)}
    binder = binder_memory(model, params, chain=chain, state_bytes_per_param=state_bytes_per_param,
                           gradient_release=gradient_release, release_groups=release_groups,
                           master_weights=master_weights, offload_optimizer=offload_optimizer,
                           offload_slots=offload_slots, tied_slabs=tied_slabs, fused_update=fused_update,
                           head_shape=(c.vocab_size, c.hidden_size), ranks=int(ranks))
    out.update({k: binder[k] for k in ("master_weights", "optimizer_state", "gradients", "temporaries")})
    kept, recompute, forward_tokens = _activation_memory(
        out, cfg, params, dt, micro_batch_tokens, seco_chunk_tokens, gradient_release, policy=activation_checkpointing,
        every=checkpoint_every, gqa_native=gqa_native, offload=checkpoint_offload, mlp_tiles=int(mlp_tiles or 0),
        compiled=bool(compiled_layers), experts_eager=experts_eager, no_backward=(skipped := frozen_prefix(model)))
    head = head_memory(cfg, model, dt, forward_tokens, loss=loss, loss_chunk=loss_chunk,
                       loss_kernels=loss_kernels, defer_head_grad=defer_head_grad,
                       gradient_release=gradient_release, activation_checkpointing=activation_checkpointing,
                       tied_slabs=tied_slabs, slab_names=binder["slab_names"])
    out["loss"], out["total"] = head["loss"], sum(out[k] for k in CATEGORIES if k != "loss") + head["loss"]
    parts = _peak(out, binder, head, kept=kept, recompute=recompute, tokens=forward_tokens, hidden=c.hidden_size,
                  b=torch.empty((), dtype=dt).element_size(), sampling=int(sampling), passes=(scoring_pass, eval_pass),
                  gradient_release=gradient_release and not out["kv_cache"], frozen=(frozen_held, frozen_forward))
    out.update(peak_parts=parts, peak=sum(parts.values()))  # what is live at the worst phase, and its sum
    if binder["host_state"] is not None:
        out.update(host_state=binder["host_state"], pcie_per_step=2 * binder["host_state"])
    out.update(binder["sharded"])  # ranks > 1: ``ranks`` and ``state_total`` (every rank's state)
    if checkpoint_offload:
        out["host_inputs"] = offloaded_input_bytes(cfg, forward_tokens, dtype=dt, policy=activation_checkpointing,
                                                   every=checkpoint_every, no_backward=skipped)
    return out


def binder_memory(model, params: dict, *, chain, state_bytes_per_param, gradient_release: bool, release_groups: str,
                  master_weights, offload_optimizer: bool, offload_slots, tied_slabs, fused_update,
                  head_shape: tuple[int, int], ranks: int = 1) -> dict[str, Any]:
    """The optimizer binder's bytes (``pgs.runtime.optim``): fp32 masters, the chain's state (on the
    device, or in host memory with device staging slots under ``offload_optimizer``; one rank's
    with ``ranks`` > 1, ``sharded_state_bytes``), the gradients it holds at once (all of them, or
    one release group's), its update's temporaries; and the release groups and tied-slab names
    the peak's phases need."""
    master = 0
    if master_weights == "fp32":
        master = sum(4 * p.numel() for p in params.values() if p.dtype in (torch.bfloat16, torch.float16))
    elif master_weights is not None:
        raise InvalidArgument(f"predict_memory: master_weights={master_weights!r} is not None or \"fp32\"")
    groups = (group_parameters(list(params), release_groups, sizes={n: p.numel() for n, p in params.items()})
              if gradient_release else {"all": list(params)})
    if offload_optimizer and not gradient_release:
        raise InvalidArgument("predict_memory: offload_optimizer needs gradient_release")
    if ranks > 1:
        state, host_state, state_total = sharded_state_bytes(params, chain, state_bytes_per_param, ranks,
                                                             gradient_release, offload_optimizer, offload_slots)
    else:
        state, host_state = _state_bytes(params, groups, chain, state_bytes_per_param, master_weights,
                                         offload_optimizer, offload_slots)
        state_total = None
    group_bytes = {g: sum(params[n].numel() * params[n].element_size() for n in names) for g, names in groups.items()}
    embed = model.get_input_embeddings()
    embed_names = {n for n, p in model.named_parameters() if embed is not None and p is embed.weight}
    slab_names = set()
    if tied_slabs and gradient_release:
        slab_names = embed_names & set(params)
        for g, names in groups.items():
            if slab_names & set(names):  # the weight steps alone; its group holds one slab's gradient
                group_bytes[g] = sum(min(int(tied_slabs), params[n].shape[0]) * params[n][0].numel()
                                     * params[n].element_size() for n in names)
    biggest = max((p.numel() for n_, p in params.items() if n_ not in slab_names), default=0)
    if slab_names:
        v, h = head_shape
        biggest = max(biggest, min(int(tied_slabs), v) * h)
    if fused_update is None:
        fused_update = bool(gradient_release and chain is not None and plan_for(chain, RELEASE) is not None)
    temporaries = 2 * 4 * biggest
    if gradient_release and fused_update:
        temporaries = 4 * biggest if master_weights == "fp32" else 0
    return {"master_weights": master, "optimizer_state": state, "host_state": host_state,
            "sharded": {"ranks": ranks, "state_total": state_total} if ranks > 1 else {},
            "gradients": max(group_bytes.values(), default=0), "temporaries": temporaries, "groups": groups,
            "group_bytes": group_bytes, "embed_names": embed_names, "slab_names": slab_names}


def _state_bytes(params: dict, groups: dict, chain, state_bytes_per_param, master_weights, offload_optimizer: bool,
                 offload_slots) -> tuple[int, int | None]:
    """The chain's state on the device (its staging slots when offloaded) and in host memory (None:
    not offloaded), sized on the parameters (meta tensors) as each release group's ``chain.init``."""

    def as_state_param(p):  # the chain sees fp32 masters when they exist
        return p.float() if (master_weights == "fp32" and p.dtype in (torch.bfloat16, torch.float16)) else p

    if chain is not None:
        inits = [chain.init({n: as_state_param(params[n]) for n in names}) for names in groups.values()]
        if not offload_optimizer:
            return sum(pf.state_bytes(s) for s in inits), None
        from pgs.runtime.optim.offload import StateLayout

        sizes = [StateLayout(s).nbytes for s in inits]
        return _staging_bytes(sizes, offload_slots), sum(sizes)
    if state_bytes_per_param is None:
        raise InvalidArgument("predict_memory: give chain= (sized exactly) or state_bytes_per_param=")
    state = int(round(state_bytes_per_param * sum(p.numel() for p in params.values())))
    if not offload_optimizer:
        return state, None
    sizes = [int(round(state_bytes_per_param * sum(params[n].numel() for n in names))) for names in groups.values()]
    return _staging_bytes(sizes, offload_slots), state


def sharded_state_bytes(params: dict, chain, state_bytes_per_param, ranks: int, gradient_release: bool,
                        offload_optimizer: bool, offload_slots) -> tuple[int, int | None, int]:
    """``(device, host, every rank's)`` bytes of the chain's state with FSDP2 over ``ranks``
    processes: rank 0's (the largest shards: ⌈rows/ranks⌉ rows of every parameter) on the device
    (its staging slots under ``offload_optimizer``) and in host memory (None: not offloaded),
    and the state of all ranks together.  Sized as the sharded binders build it: ``chain.init``
    of the local shards, fp32 where the model is in low precision (FSDP2's sharded masters),
    one state per FSDP unit under gradient release (``ShardedGradientRelease``: each decoder
    layer; the root: the parameters outside them), one for all otherwise."""

    def shard(p, rank: int):
        rows = p.shape[0] if p.dim() else 1
        chunk = -(-rows // ranks)
        mine = max(0, min(rows, (rank + 1) * chunk) - min(rows, rank * chunk))
        dtype = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype
        return torch.empty((mine, *p.shape[1:]), dtype=dtype, device="meta")

    from pgs.runtime.optim.sharded_release import ROOT_GROUP

    units: dict[str, list[str]] = {}
    for n in params:
        units.setdefault((group_of(n) if group_of(n) != n else ROOT_GROUP) if gradient_release else "all", []).append(n)
    per_rank = []
    for rank in range(ranks):
        if chain is None:
            if state_bytes_per_param is None:
                raise InvalidArgument("predict_memory: give chain= (sized exactly) or state_bytes_per_param=")
            sizes = [int(round(state_bytes_per_param * sum(shard(params[n], rank).numel() for n in names)))
                     for names in units.values()]
        else:
            inits = [chain.init({n: shard(params[n], rank) for n in names}) for names in units.values()]
            if offload_optimizer:
                from pgs.runtime.optim.offload import StateLayout

                sizes = [StateLayout(s).nbytes for s in inits]
            else:
                sizes = [int(pf.state_bytes(s)) for s in inits]
        per_rank.append(sizes)
    mine = per_rank[0]
    if not offload_optimizer:
        return sum(mine), None, sum(sum(x) for x in per_rank)
    return _staging_bytes(mine, offload_slots), sum(mine), sum(sum(x) for x in per_rank)


def head_memory(cfg, model, dt, tokens: int, *, loss: str, loss_chunk: int, loss_kernels, defer_head_grad,
                gradient_release: bool, activation_checkpointing: str, tied_slabs, slab_names: set) -> dict[str, Any]:
    """The output head and loss's bytes (the objective's head, ``pgs.func.losses``): one chunk's
    working set (``work``), the head part rebuilt at the end of backward when its gradient is
    deferred (``rebuild``), what the loss's forward holds into backward (``held``); ``loss`` is
    the category's figure."""
    c = _text_config(cfg)
    v, h = c.vocab_size, c.hidden_size
    b = torch.empty((), dtype=dt).element_size()
    n = int(tokens)
    if defer_head_grad is not False:  # where pgs run can defer, as the setting asks
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        tied = head is not None and embed is not None and head.weight is embed.weight
        wanted = head_grad_wanted("auto" if defer_head_grad is None else defer_head_grad, activation_checkpointing,
                                  tied_slabs)
        defer_head_grad = bool(gradient_release and loss == "chunked" and tied and head.weight.requires_grad
                               and wanted)
    deferred = loss == "chunked" and defer_head_grad
    if loss_kernels is None:
        from pgs.func import kernels

        loss_kernels = kernels.CONFIG.ce_kernels
    if loss == "chunked":
        work, rebuild = chunk_work_bytes(min(loss_chunk, n), v, b, loss_kernels)
        if deferred:  # grad_h, the saved h, and rows/gates/LSEs (8 B index + 2 × 4 B per token)
            held = 2 * n * h * b + 16 * n
        else:
            held = v * h * b + n * h * b  # grad_W and grad_h, from the loss's forward into backward
    elif loss == "distill":  # both heads' fp32 chunk logits and their softmax terms; grad_W and grad_h
        work, rebuild, held = DISTILL_CHUNK_BYTES * min(loss_chunk, n) * v, 0, v * h * b + n * h * b
    elif loss == "dense":
        work, rebuild, held = n * v * (b + 4 + 4), 0, 0
    else:
        raise InvalidArgument(f"predict_memory: loss={loss!r} is not \"chunked\", \"distill\" or \"dense\"")
    if slab_names:  # the head part is rebuilt per slab: a chunk × slab-columns block, not chunk × V
        slab_cols = min(int(tied_slabs), v)
        rebuild = chunk_work_bytes(min(loss_chunk, n), slab_cols, b, loss_kernels)[1] if deferred else 0
    return {"work": work, "rebuild": rebuild, "held": held, "deferred": deferred,
            "loss": max(work, rebuild if deferred else 0) + held}


def _activation_memory(out: dict, cfg, params: dict, dt, tokens: int, seco_chunk_tokens: int, gradient_release: bool,
                       **parts) -> tuple[int, int, int]:
    """``(kept, recompute, tokens of one forward)``: ``activation_parts`` for ``predict_memory``,
    which sets ``out["activations"]``.  Chunk-wise training (``seco_chunk_tokens`` < ``tokens``):
    one chunk's activations (``cached_kv``) and one layer's cache gradient in its backward,
    ``out["kv_cache"]`` the row's keys/values and their gradient (``seco_cache_bytes``), and with
    gradient release every gradient (they accumulate through the sweep)."""
    seco = bool(seco_chunk_tokens) and seco_chunk_tokens < tokens
    forward_tokens = int(seco_chunk_tokens) if seco else int(tokens)
    kept, recompute = activation_parts(cfg, forward_tokens, dtype=dt, cached_kv=seco, **parts)
    if seco:
        out["kv_cache"], span = seco_cache_bytes(cfg, tokens, forward_tokens, dtype=dt)
        recompute += span
        if gradient_release:
            out["gradients"] = sum(p.numel() * (p.element_size() if p.is_floating_point() else 0)
                                   for p in params.values())
    out["activations"] = kept + recompute
    return kept, recompute, forward_tokens


def _peak(out: dict, binder: dict, head: dict, *, kept: int, recompute: int, tokens: int, hidden: int, b: int,
          gradient_release: bool, frozen: tuple[int, int], sampling: int, passes: tuple[int, int]) -> dict[str, int]:
    """What is live together at the worst phase of a step (forward's end, a layer's backward, the
    last group's update), on top of what lives all the time (weights, masters, state); or of the
    objective's own phases (on-policy sampling, a cached reference's scoring pass, an evaluation
    whose batches are larger than the step's: ``passes``).  Returns that phase's parts, named as
    ``CATEGORIES`` where they are one (a part of a category: its bytes live then), whose sum is
    the peak."""
    n, h = tokens, hidden
    loss_held, loss_work, rebuild, deferred = head["held"], head["work"], head["rebuild"], head["deferred"]
    frozen_held, frozen_forward = (int(x) for x in frozen)
    static = {k: out[k] for k in ("weights", "frozen_models", "master_weights", "optimizer_state")}
    grads = out["gradients"]
    # end of the policy's forward: its kept activations and the loss's held buffers, then the larger
    # of the loss's chunk and a frozen model's no-grad forward (what that forward leaves for the loss too)
    if frozen_forward > loss_work:
        forward_end = {"activations": kept, "loss": loss_held, "frozen forward": frozen_held + frozen_forward}
    else:
        forward_end = {"activations": kept, "loss": loss_held + loss_work, "frozen forward": frozen_held}
    if gradient_release:
        groups, group_bytes = binder["groups"], binder["group_bytes"]
        # inside the layers' backward only a layer's gradients exist; the embedding's (often the
        # largest group) comes last, when the kept activations are gone
        late = {g for g, names in groups.items() if binder["embed_names"] & set(names)}
        grads_mid = max((v for g, v in group_bytes.items() if g not in late), default=0)
        last = {"gradients": grads, "temporaries": out["temporaries"],
                "loss": loss_held + rebuild if deferred else loss_held}
        if binder["slab_names"]:
            # first the looked-up rows' gradients (N·D·b, kept by the embedding's backward) are summed
            # per id: an fp32 copy of the rows and fp32 sums, then the sums in W's dtype; then the
            # slabs, one at a time: the sums + a slab's gradient + its update's temporaries + the
            # head's rebuilt chunk for the slab's columns
            slab_grads = max(group_bytes[g] for g in late)
            last = max(({"loss": loss_held, "gradients": 2 * n * h * b + 8 * n * h},
                        {"loss": loss_held + rebuild, "gradients": n * h * b + slab_grads,
                         "temporaries": out["temporaries"]}), key=lambda p: sum(p.values()))
        phases = (forward_end,  # end of forward: the loss's chunk
                  {"activations": kept + recompute, "loss": loss_held, "gradients": grads_mid},  # a recomputed layer
                  last)  # last group's update (the embedding; with deferral the head's rebuilt chunk)
    else:
        phases = (forward_end, {"activations": kept + recompute, "loss": loss_held, "gradients": grads},
                  {"gradients": grads, "temporaries": out["temporaries"]})
    worst = max(phases, key=lambda p: sum(p.values()))  # the first of equals: forward's end
    parts = {**static, "kv_cache": out["kv_cache"], **worst}
    if sampling and sum(static.values()) + sampling > sum(parts.values()):
        parts = {**static, "sampling": sampling}  # on-policy sampling: no graph, no gradients; KV cache, prefill
    scoring_pass, eval_pass = (int(x) for x in passes)
    if eval_pass and sum(static.values()) + eval_pass > sum(parts.values()):  # no graph, no gradients
        parts = {**static, "evaluation": eval_pass}
    if scoring_pass and out["weights"] + out["frozen_models"] + scoring_pass > sum(parts.values()):
        # before the first step, before the optimizer's state exists
        parts = {"weights": out["weights"], "frozen_models": out["frozen_models"], "scoring pass": scoring_pass}
    return {k: v for k, v in parts.items() if v}


# ----------------------------------------------------------------------------- the CLI


def memory_options(spec) -> dict[str, Any]:
    """Gradient release and checkpointing settings of a spec's ``[memory]``:
    ``gradient_release``, ``activation_checkpointing``, ``checkpoint_every``, ``master_weights``
    (None for ``"none"``), ``offload_checkpoints``, ``offload_prefetch``, ``offload_optimizer``.
    (``tied_slabs`` is read by ``plan_from_spec``.)
    """
    mem = spec.memory
    return {"gradient_release": mem.gradient_release, "activation_checkpointing": mem.activation_checkpointing,
            "checkpoint_every": mem.checkpoint_every,
            "master_weights": None if mem.master_weights == "none" else mem.master_weights,
            "offload_checkpoints": mem.offload_checkpoints, "offload_prefetch": mem.offload_prefetch,
            "offload_optimizer": mem.offload_optimizer}


def _spec_model_config(spec):
    m = spec.model
    if m.config is not None:
        table = dict(m.config)
        if not table.get("vocab_size"):  # as pgs run builds it: the tokenizer's vocabulary

            table["vocab_size"] = len(load_tokenizer(m.tokenizer or m.path))
        return _hf_config(table)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(m.path, local_files_only=True, trust_remote_code=m.trust_remote_code)


def head_loss(spec) -> dict[str, Any]:
    """``predict_memory``'s ``loss`` and ``defer_head_grad`` for the objective the spec selects,
    as ``pgs run`` computes its head: SFT's token loss with ``loss.backend`` (deferred only with
    the chunked backend, when asked); ``[preference]``'s sequence log-probs, chunked whatever the
    backend, deferred as ``memory.defer_head_grad`` says (``PreferenceObjective.defers_head_grad``);
    ``[distill]``'s chunked divergence (``loss="distill"``: both heads' logits per chunk), whose
    head gradient goes through autograd."""
    if spec.preference is not None:
        return {"loss": "chunked", "defer_head_grad": spec.memory.defer_head_grad}
    if spec.distill is not None:
        return {"loss": "distill", "defer_head_grad": False}
    backend = spec.loss.backend
    return {"loss": "dense" if backend == "dense" else "chunked",
            "defer_head_grad": spec.memory.defer_head_grad if backend == "chunked" else False}


def layer_working_bytes(cfg, tokens: int, dtype) -> int:
    """What a frozen model's no-grad forward over ``tokens`` tokens holds at its fullest (a
    reference's, a teacher's, a cached reference's scoring pass, a sampling prefill), its
    weights and final hidden state aside.  Under ``no_grad`` a layer frees its temporaries as it
    goes, so a dense attention layer (Qwen3/Llama-style) holds, per token, with b the dtype's
    bytes, h hidden, I intermediate, q = n_q·d, k = n_kv·d:

        outside    = b·h + 2·b·d                     (the input embeddings, which the base
                                                      model's forward keeps to its end; the
                                                      rotary tables cos and sin)
        norm       = b·h + 8h                        (the layer input; its fp32 copy and square)
        attention  = 2·b·h + b(q + 2k) + max(8q, 3·b·q, b·q + 3·b·k) + 4·n_q
                                                     (input, normed input; q, k, v; the q norm's
                                                      fp32 copy and square, or the rotary's
                                                      q·cos, rotate_half(q) and its product, or
                                                      k's three with rotated q; the output and its
                                                      log-sum-exp within that)
        mlp        = 3·b·h + 3·b·I                   (input, the attention's residual sum, the
                                                      normed input; SiLU(gate), up, their product)
        layer      = outside + max(norm, attention, mlp, 4·b·h)

    (the MLP's term is what ``TensorMeter`` counts for a HF Qwen3 in fp32 and bf16 to the byte,
    tests/unit/test_profile_objective.py).  Families this does not describe (mixture-of-experts
    MLPs, Gated DeltaNet mixers, the fp32 (1 + w) norms of Qwen3.5/Qwen3-Next) are bounded by what
    a layer would keep for backward, ``activation_parts``' A_none, plus its input: about twice
    the dense figure."""
    c = _text_config(cfg)
    b = torch.empty((), dtype=_dtype(dtype)).element_size()
    h, n = c.hidden_size, int(tokens)
    if _experts_shape(c) is not None or _linear_mixer_bytes(c, b) or _fp32_norm(c):
        _, recompute = activation_parts(cfg, n, dtype=dtype, policy="full")  # (A_none − b·h) · tokens
        return recompute + b * h * n
    n_q = c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or n_q
    d = getattr(c, "head_dim", None) or h // n_q
    q, k = n_q * d, n_kv * d
    outside = b * h + 2 * b * _rotary_dim(c, d)
    attention = 2 * b * h + b * (q + 2 * k) + max(8 * q, 3 * b * q, b * q + 3 * b * k) + 4 * n_q
    layer = max(b * h + 8 * h, attention, 3 * b * h + 3 * b * c.intermediate_size, 4 * b * h)
    return (outside + layer) * n


def _teacher_config(spec, vocab: int):
    d = spec.distill
    if d.teacher_config is not None:
        table = {k: v for k, v in d.teacher_config.items() if not (k == "vocab_size" and not v)}
        cfg = _hf_config(table)
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(d.teacher_path, local_files_only=True)
    _text_config(cfg).vocab_size = int(vocab)  # load_teacher builds it with the tokenizer's vocabulary
    return cfg


def objective_memory(spec, cfg, model, dtype, rows: int, seq_len: int, chunk: int) -> dict[str, int]:
    """``predict_memory``'s objective terms of the spec's objective (its ``frozen_*``, ``sampling``,
    ``scoring_pass`` and ``eval_pass``; ``loss_chunk`` where the loss covers fewer rows than a chunk), for
    ``rows`` × ``seq_len`` tokens per micro-batch.

    SFT adds nothing.  ``[preference]`` packs a pair's two arms into one row of ``seq_len``
    (``PreferenceStream``), so its tokens are SFT's; a ``"live"`` reference adds its weights (a
    copy of the policy, or ``reference_path``'s model) and its no-grad forward after the
    policy's (a layer's working set, then its final hidden state and one chunk's logits); a
    ``"cached"`` one adds the scoring pass before the first step (``score_pairs``: 8 rows a
    forward, no optimizer state yet) and a [pairs, 2] table; with held-out pairs (``data.eval``,
    ``train.eval_every`` > 0) the evaluation's no-grad forward of 8 rows (``eval_batches``) beside
    the weights and the state, the same working set as the scoring pass.  ``[distill]`` adds the teacher's
    weights (``distill.teacher_dtype``), its no-grad forward with its final hidden state held
    into the divergence, and with ``on_policy`` > 0 the sampling phase: the student's KV cache for
    the longest prompts a row can hold (``seq_len − 1`` tokens, one trained token after them) and
    ``max_new_tokens`` samples, plus a prefill layer's working set."""
    c = _text_config(cfg)
    n = rows * seq_len
    b = torch.empty((), dtype=_dtype(dtype)).element_size()
    out: dict[str, int] = {}
    pref = spec.preference
    from pgs.func import kernels

    # a forward's log-probs: one chunk's, as the policy's (chunk_work_bytes)
    chunk_logits = chunk_work_bytes(min(chunk, n), c.vocab_size, b, kernels.CONFIG.ce_kernels)[0]
    scored = 8 * seq_len  # score_pairs and evaluate_pairs: eval_batches of 8 rows
    eight_rows = max(layer_working_bytes(cfg, scored, dtype), b * c.hidden_size * scored
                     + chunk_work_bytes(min(chunk, scored), c.vocab_size, b, kernels.CONFIG.ce_kernels)[0])
    if pref is not None and spec.data.eval and spec.train.eval_every > 0:
        out["eval_pass"] = eight_rows
    if pref is not None and pref.uses_reference:
        if pref.reference == "live":
            ref_cfg, ref = cfg, model
            if pref.reference_path is not None:
                from transformers import AutoConfig

                ref_cfg = AutoConfig.from_pretrained(pref.reference_path, local_files_only=True)
                _text_config(ref_cfg).vocab_size = c.vocab_size
                ref = meta_model(ref_cfg, dtype)
            out["frozen_weights"] = model_bytes(ref)
            # its layers one at a time, then its final hidden state and one chunk of its log-probs
            out["frozen_forward"] = max(layer_working_bytes(ref_cfg, n, dtype),
                                        b * _text_config(ref_cfg).hidden_size * n + chunk_logits)
        else:
            out["scoring_pass"] = eight_rows
    distill = spec.distill
    if distill is not None:
        t_cfg = _teacher_config(spec, c.vocab_size)
        t_dtype = _dtype(distill.teacher_dtype)
        tb = torch.empty((), dtype=t_dtype).element_size()
        out["frozen_weights"] = model_bytes(meta_model(t_cfg, t_dtype))
        out["frozen_forward"] = layer_working_bytes(t_cfg, n, t_dtype)
        out["frozen_held"] = tb * _text_config(t_cfg).hidden_size * n  # the teacher's final hidden state
        if distill.on_policy > 0:
            kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            new = int(distill.generation_settings()["max_new_tokens"])
            prompt = max(1, seq_len - 1)
            cache = rows * (prompt + new) * c.num_hidden_layers * 2 * kv_heads * head_dim * b
            out["sampling"] = cache + layer_working_bytes(cfg, rows * prompt, dtype) + rows * c.vocab_size * 16
        if distill.on_policy >= 1:  # every step trains on samples: the divergence covers their tokens only
            out["loss_chunk"] = min(chunk, rows * int(distill.generation_settings()["max_new_tokens"]))
    return out


def plan_from_spec(spec, ranks: int = 1, **overrides) -> dict[str, Any]:
    """Everything ``predict_memory`` needs, read from a checked spec (plus ``overrides``), for one
    of ``ranks`` processes (``pgs run --nproc``: its share of the global batch, of each row with
    context parallelism, and its shards' optimizer state)."""

    mem = spec.memory
    opts = {**memory_options(spec), "tied_slabs": mem.tied_slabs, "mlp_tiles": mem.mlp_tiles,
            "release_groups": mem.release_groups, "compile_layers": mem.compile_layers,
            **{k: v for k, v in overrides.items() if v is not None}}
    cfg = _spec_model_config(spec)
    dt = _dtype(spec.model.dtype)
    model = meta_model(cfg, dt, trust_remote_code=spec.model.trust_remote_code)
    freeze(model, spec.model.freeze)
    total = spec.train.steps or 1000
    chain = spec.build_chain(total_steps=total)
    notes = []
    if opts["gradient_release"]:
        why = refusal(chain, spec.train.grad_accum)
        if why:
            notes.append(f"gradient release would be refused: {why}")
    ranks = max(1, int(ranks))
    context = spec.parallel.context if ranks > 1 else 1
    micro = max(1, spec.train.batch_size // (spec.train.grad_accum * max(1, ranks // context)))
    tokens = micro * max(1, spec.data.max_seq_len // context)
    kwargs = dict(dtype=dt, chain=chain, gradient_release=bool(opts["gradient_release"]),
                  master_weights=opts["master_weights"],
                  activation_checkpointing=opts["activation_checkpointing"],
                  checkpoint_every=int(opts["checkpoint_every"]), micro_batch_tokens=tokens,
                  checkpoint_offload=checkpoint_offload(opts["offload_checkpoints"], opts["offload_prefetch"],
                                                        opts["offload_optimizer"]),
                  tied_slabs=int(opts["tied_slabs"]) or None, mlp_tiles=int(opts["mlp_tiles"]),
                  release_groups=opts["release_groups"], compiled_layers=opts["compile_layers"],
                  offload_optimizer=bool(opts["offload_optimizer"] and opts["gradient_release"]),
                  loss_chunk=spec.loss.chunk_size, model=model,
                  experts_eager=spec.model.experts_implementation == "eager", ranks=ranks,
                  seco_chunk_tokens=micro * min(mem.seco_chunk, spec.data.max_seq_len) if mem.seco_chunk else 0,
                  **head_loss(spec))
    kwargs.update(objective_memory(spec, cfg, model, dt, micro, spec.data.max_seq_len, spec.loss.chunk_size))
    return {"config": cfg, "kwargs": kwargs, "notes": notes, "micro_batch": micro,
            "seq_len": spec.data.max_seq_len, "options": opts}


def checkpoint_bytes(pred: dict) -> int:
    """One checkpoint's tensor bytes from ``predict_memory``'s figures: the weights, the fp32
    masters and the whole optimizer state (with ``offload_optimizer`` the host's copy, not the
    device's staging)."""
    if "state_total" in pred:  # several ranks: a checkpoint holds every rank's shards
        return pred["weights"] + pred["master_weights"] + pred["state_total"]
    return pred["weights"] + pred["master_weights"] + pred.get("host_state", pred["optimizer_state"])


@attrs.frozen
class Prediction:
    """One process's predicted peak memory and the bytes of one checkpoint, with the parts a
    message names."""

    peak: int
    checkpoint: int
    parts: dict
    tokens: str
    host: int = 0  # what the run keeps in host memory besides a CPU run's peak (offloaded state and inputs)
    memory: dict = attrs.field(factory=dict)  # predict_memory's figures (its categories, total, peak, host_*)
    plan: dict = attrs.field(factory=dict)  # profile.plan_from_spec's plan it was made from


def attention_matrix_bytes(cfg, rows: int, seq_len: int, *, dtype_bytes: int, implementation: str,
                           device_type: str, packed: bool, varlen_kernel: bool, checkpointing: str = "none",
                           every: int = 1) -> int:
    """Bytes of the sequence-squared buffers attention keeps for backward: 0 where a kernel
    runs without them (unpacked causal rows, or packed rows on the CUDA variable-length
    kernel).  With SDPA each layer that keeps its activations saves its own copy of the
    block-diagonal mask, ``rows·S²·b`` (SDPA converts transformers' boolean ``[B, 1, S, S]``
    mask to the query's dtype, per call); eager attention saves each layer's probabilities,
    ``rows·H·S²·b``, and holds one additive mask, ``rows·S²·b``.  Plus the boolean mask,
    ``rows·S²``, once.  Checkpointed layers hold theirs only while one is recomputed.  Equal
    to the tensors autograd saves for a packed Qwen3 forward on the CPU
    (tests/unit/test_preflight_resources.py)."""
    eager = implementation == "eager"
    if not eager and (not packed or varlen_kernel):
        return 0
    c = getattr(cfg, "text_config", None) or cfg
    layers = int(c.num_hidden_layers)
    heads = int(c.num_attention_heads)
    square = int(rows) * int(seq_len) ** 2
    per_layer = square * dtype_bytes * (heads if eager else 1)
    once = (square + (square * dtype_bytes if eager else 0)) if packed else 0
    kept = layers if checkpointing == "none" else layers - len(range(0, layers, every)) + 1
    return kept * per_layer + once


def predict(spec, device: torch.device, ranks: int = 1, **overrides) -> Prediction:
    """What one process of ``spec`` (one of ``ranks``, ``plan_from_spec``) needs at its peak on
    ``device``, and one checkpoint's bytes:
    the one estimate ``pgs validate``, ``pgs run``'s preflight and ``pgs profile`` show and check
    (``overrides``: ``pgs profile``'s, as ``plan_from_spec`` takes them).  Each part is its
    component's: the model's weights, the binder's masters, state and gradients
    (``profile.binder_memory``), the activations (``profile.activation_parts``), the head and
    loss (``profile.head_memory``), the objective's frozen models (``profile.objective_memory``),
    attention's masks (:func:`attention_matrix_bytes`) and each step-time service's own
    (``Service.memory_estimate``)."""
    from pgs.func import kernels
    from pgs.runtime.model.attention import varlen_available
    from pgs.runtime.loop.services import service_memory
    from pgs.runtime.model.build import resolve_dtype

    plan = plan_from_spec(spec, ranks, **overrides)
    kwargs = dict(plan["kwargs"])
    kwargs["loss_kernels"] = device.type == "cuda" and kernels.CONFIG.ce_kernels
    pred = predict_memory(plan["config"], **kwargs)
    dt = resolve_dtype(spec.model.dtype)
    impl = spec.model.attn_implementation
    varlen = impl in ("varlen", "auto") and device.type == "cuda" and varlen_available(device, dt)
    if impl == "auto":
        impl = "varlen" if varlen else "sdpa"
    opts = plan["options"]
    attention = attention_matrix_bytes(
        plan["config"], plan["micro_batch"], plan["seq_len"], dtype_bytes=torch.empty((), dtype=dt).element_size(),
        implementation=impl, device_type=device.type, packed=bool(spec.data.packing), varlen_kernel=varlen,
        checkpointing=opts["activation_checkpointing"], every=int(opts["checkpoint_every"]))
    parts = dict(pred["peak_parts"])  # what is live at the peak's phase: they sum to the peak
    parts["attention masks"] = attention
    services = service_memory(spec, plan)  # what the step-time services hold (loop/services.py)
    if services["device"]:
        parts["services"] = services["device"]
    checkpoint = checkpoint_bytes(pred)
    return Prediction(peak=pred["peak"] + attention + services["device"], checkpoint=checkpoint, parts=parts,
                      tokens=f"{plan['micro_batch']} rows × {plan['seq_len']} tokens per micro-batch",
                      host=int(pred.get("host_state") or 0) + int(pred.get("host_inputs") or 0) + services["host"],
                      memory=pred, plan=plan)


def profile(spec, measure: bool = False, spec_path: str | None = None, *, console=None, ranks: int = 1,
            **overrides) -> int:
    """``pgs profile SPEC [--measure] [--nproc N]``: print the predicted memory of the spec's
    objective's step for one of ``ranks`` processes (and, with ``measure``, the peaks measured
    while running that step on one process: ``measure_memory``)."""
    from rich.table import Table

    from pgs.runtime import output

    console = console or output.console()
    prediction = predict(spec, auto_device(spec.train.device), ranks, **overrides)  # the preflight's figure
    plan, pred = prediction.plan, prediction.memory
    opts = plan["options"]
    title = (f"predicted memory of the {objective_label(spec)} step: {plan['micro_batch']}×{plan['seq_len']} tokens, "
             f"release={'on' if opts['gradient_release'] else 'off'}, "
             f"checkpointing={opts['activation_checkpointing']}"
             + (f", one of {ranks} processes (FSDP2: the optimizer state is this process's shards')" if ranks > 1
                else ""))
    measured = None
    if measure:
        refused = [n for n in plan["notes"] if n.startswith("gradient release would be refused")]
        if refused:
            plan["notes"].append("--measure: not run (gradient release would be refused, as pgs run would refuse it)")
        else:
            measured = measure_memory(spec, plan)
    unit, scale = ("GiB", GiB) if prediction.peak >= GiB else ("MiB", 1024**2)  # a tiny model's figures stay readable
    table = Table(title=title)
    table.add_column("category")
    table.add_column(f"predicted {unit}", justify="right")
    attention, services = prediction.parts["attention masks"], prediction.parts.get("services", 0)
    for k in CATEGORIES:
        if k != "kv_cache" or pred[k]:  # the row's key/value cache: chunk-wise training only
            table.add_row(k, f"{pred[k] / scale:.3f}")
    table.add_row("attention masks", f"{attention / scale:.3f}")
    if services:
        table.add_row("services (averaging, health, ...)", f"{services / scale:.3f}")
    table.add_section()
    table.add_row("total (sum of the above, if all were live at once)",
                  f"{(pred['total'] + attention + services) / scale:.3f}")
    table.add_row("peak (what is live together at the worst phase)", f"{prediction.peak / scale:.3f}")
    if "host_state" in pred:
        table.add_section()
        each = f", per process of {ranks}" if ranks > 1 else ""
        table.add_row(f"host: optimizer state (pinned; offload_optimizer{each})", f"{pred['host_state'] / scale:.3f}")
        table.add_row("PCIe per step (state in + out)", f"{pred['pcie_per_step'] / scale:.3f}")
    host_rows = []
    if pred.get("host_inputs"):
        host_rows.append(("host: checkpointed inputs (pinned; offload_checkpoints)", pred["host_inputs"]))
    if spec.checkpoint.background:  # one checkpoint's tensors, kept for the run (pgs.runtime.store.background)
        host_rows.append(("host: checkpoint snapshot (checkpoint.background)", prediction.checkpoint))
    if host_rows and "host_state" not in pred:
        table.add_section()
    for label, nbytes in host_rows:
        table.add_row(label, f"{nbytes / scale:.3f}")
    console.print(table)
    console.print("the peak's phase: " + " + ".join(f"{k} {v / scale:.3f}" for k, v in prediction.parts.items() if v)
                  + f" = {prediction.peak / scale:.3f} {unit}", soft_wrap=True, highlight=False)
    console.print(f"vocabulary {_text_config(plan['config']).vocab_size:,}; the peak is the figure to compare with "
                  "a GPU (add allocator slack and the CUDA context)", soft_wrap=True, highlight=False)
    if measured is not None:
        where = "the CPU (live tensor bytes)" if measured.device == "cpu" else measured.device
        console.print(f"measured on {where}: the {measured.objective} step; one micro-batch of {measured.batch}",
                      soft_wrap=True, highlight=False)
        mt = Table(title="measured peak per phase")
        mt.add_column("phase")
        mt.add_column(f"peak allocated {unit}", justify="right")
        for k, val in measured.phases.items():
            mt.add_row(k, f"{val / scale:.3f}")
        mt.add_row("predicted peak", f"{prediction.peak / scale:.3f}")
        console.print(mt)
    for note in plan["notes"]:
        console.print(f"note: {note}")
    return 0


class CudaMeter:
    """Peak allocated bytes on a CUDA device, from its caching allocator's statistics."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "CudaMeter":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def current(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


class TensorMeter(TorchDispatchMode):
    """Live tensor bytes on a device whose allocator keeps no statistics (the CPU): every tensor
    an operator returns while the meter is active has its storage counted until that storage
    is freed (a ``weakref.finalize`` on it), tied and viewed tensors once.  What is counted is
    what CUDA's ``memory_allocated`` counts, without the allocator's rounding: storages
    that were alive when the meter started are its baseline (``current`` and ``peak`` are
    above it).  Slower than running bare (a Python call per operator)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self._live: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._now = 0
        self._peak = 0
        self._base = 0

    def __enter__(self) -> "TensorMeter":
        gc.collect()
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(): no __class__ property of a lazy module runs
                self._track(obj)
        self._base = self._now
        self._peak = self._now
        return super().__enter__()

    def __exit__(self, *exc):
        for f in self._finalizers.values():  # the storages outlive the meter: stop counting them
            f.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)

    def _free(self, key: int) -> None:
        self._now -= self._live.pop(key, 0)
        self._finalizers.pop(key, None)

    def _track(self, t: torch.Tensor) -> None:
        try:
            if t.device != self.device or t.is_meta:
                return
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage (a wrapper subclass)
            return
        key, size = id(storage), storage.nbytes()
        if not isinstance(size, int):  # a traced graph's fake tensor (symbolic size) that a compile left alive
            return
        old = self._live.get(key)
        if old is None:
            self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self._live[key] = size
        self._now += size - (old or 0)
        self._peak = max(self._peak, self._now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def current(self) -> int:
        return self._now - self._base

    def reset(self) -> None:
        self._peak = self._now

    def peak(self) -> int:
        return self._peak - self._base


@attrs.define
class Measured:
    """What ``measure_memory`` found: the objective it ran, what one micro-batch held, and peak
    bytes per phase (``static``, ``prepare`` where the objective rebuilds its batches, e.g.
    on-policy samples, then ``forward``, ``backward`` and ``step``)."""

    objective: str
    batch: str
    phases: dict[str, int]
    device: str


def objective_label(spec) -> str:
    """The objective the spec trains, in a few words (``pgs profile``'s prediction title)."""
    if spec.preference is not None:
        p = spec.preference
        return f"preference ({p.kind}, reference {p.reference if p.uses_reference else 'none'})"
    if spec.distill is not None:
        d = spec.distill
        return f"distill ({d.kind}, teacher in {d.teacher_dtype}, on_policy {d.on_policy:g})"
    return f"sft ({spec.build_token_loss().name})"


def _objective_text(spec, objective) -> str:
    """The objective as the measurement ran it, in a few words."""
    if objective.name == "preference":
        p = spec.preference
        return f"preference ({p.kind}, reference {objective.reference.mode})"
    if objective.name == "distill":
        d = spec.distill
        teacher = sum(t.numel() for t in objective.teacher.parameters())
        sampled = "every step on-policy" if d.on_policy > 0 else "off-policy"
        return f"distill ({d.kind}, teacher {teacher:,} parameters in {d.teacher_dtype}, {sampled})"
    return f"{objective.name} ({spec.build_token_loss().name})" if objective.name == "sft" else objective.name


def _batch_text(objective, batches, extra: dict) -> str:
    rows = sum(b.input_ids.shape[0] for b in batches)
    width = max(b.input_ids.shape[1] for b in batches)
    unit = "pairs" if objective.name == "preference" else "trained tokens"
    text = f"{rows} rows × {width} tokens, {objective.count(batches):,} {unit}"
    if extra.get("generated_tokens"):
        text += f", {int(extra['generated_tokens']):,} tokens sampled"
    return text


def measure_memory(spec, plan, *, steps: int = 3, device: torch.device | str | None = None) -> Measured:
    """Run ``steps`` training steps of ``spec``'s objective on random tokens; peak bytes per phase.

    The objective is the one ``pgs run`` trains (``objective_class``): its ``for_profile`` builds
    it with one micro-batch of the spec's shapes (pairs for ``[preference]``, prompts whose
    completions the student samples for ``[distill]``) and what it keeps on the device (a live
    reference, a teacher), then each step runs its ``prepare``, ``forward``, the backward of
    ``loss_sum / count`` and the optimizer step, as the loop does.  On CUDA the peaks are the
    allocator's (``max_memory_allocated``); elsewhere (the CPU) a ``TensorMeter`` counts live
    tensor storages.  Phases: ``static`` (the models and the optimizer state), ``prepare``
    (when the objective rebuilds the batches: on-policy generation), ``forward``, ``backward``
    (which includes the update under gradient release) and ``step``.
    """
    from pgs.runtime.loop.objective import objective_class
    from pgs.runtime.loop.run import Run

    opts = plan["options"]
    dev = run_device(spec.train.device) if device is None else torch.device(device)  # as pgs run picks it
    m = spec.model
    tokenizer = load_tokenizer(m.tokenizer or m.path)
    meter = CudaMeter(dev) if dev.type == "cuda" else TensorMeter(dev)
    with meter:
        with dev:  # random init on the device: minutes faster than on the host at 4B
            config = None if m.config is None else {**m.config, "vocab_size": _text_config(plan["config"]).vocab_size}
            model = build_model(path=m.path, config=config, dtype=m.dtype, attn_implementation=m.attn_implementation,
                                varlen_kernel=m.varlen_kernel, experts_implementation=m.experts_implementation,
                                init_seed=m.init_seed, trust_remote_code=m.trust_remote_code).to(dev)
        freeze(model, m.freeze)
        generator = torch.Generator().manual_seed(spec.train.seed)
        # as pgs run: the objective (its reference, its teacher) from the initial weights, before [memory]
        objective, batches = objective_class(spec).for_profile(spec, model=model, tokenizer=tokenizer, device=dev,
                                                               rows=plan["micro_batch"], seq_len=plan["seq_len"],
                                                               generator=generator)
        skip_frozen_prefix(model)  # as pgs run's apply_memory
        if opts["mlp_tiles"] > 1:
            apply_mlp_tiles(model, int(opts["mlp_tiles"]))
        apply_activation_checkpointing(model, opts["activation_checkpointing"], int(opts["checkpoint_every"]),
                                       offload=checkpoint_offload(opts["offload_checkpoints"], opts["offload_prefetch"],
                                                                  opts["offload_optimizer"]))
        chain = plan["kwargs"]["chain"]
        if opts["gradient_release"]:
            binder = GradientRelease
            if opts["offload_optimizer"]:
                from pgs.runtime.optim.offload import OffloadedRelease as binder
            # the spec's memory options (MemorySpec.options()) with what the overrides change
            memory = spec.memory.options().evolve(stochastic_rounding=spec.model.dtype == "bfloat16",
                                                  tied_slabs=int(opts["tied_slabs"] or 0))
            opt = binder(chain, model, memory=memory, master_weights=opts["master_weights"],
                         groups=opts["release_groups"])
        else:
            opt = bind(chain, model, compile=spec.optimizer.compile, jit=spec.optimizer.jit)
        run = Run(spec=spec, run_dir=spec.checkpoint.dir, device=dev, model=model, tokenizer=tokenizer, bound=opt,
                  objective=objective, total_steps=steps, micro_batch=plan["micro_batch"], skips=None)
        phases = {"static": meter.current()}
        peaks: dict[str, int] = {}

        def note(phase: str) -> None:
            peaks[phase] = max(peaks.get(phase, 0), meter.peak())
            meter.reset()

        extra: dict = {}
        prepared = batches
        for _ in range(steps):
            meter.reset()
            prepared, extra = objective.prepare(run, batches)
            if prepared is not batches:
                note("prepare")
            count = max(1, objective.count(prepared))
            for batch in prepared:
                meter.reset()
                loss_sum, _stats = objective.forward(run, batch, False)
                note("forward")
                (loss_sum / count).backward()
                del loss_sum, _stats
                note("backward")
            opt.step()
            opt.zero_grad()
            note("step")
        phases.update(peaks)
        measured = Measured(objective=_objective_text(spec, objective), batch=_batch_text(objective, prepared, extra),
                            phases=phases,
                            device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev))
        del run, model, opt, objective, batches, prepared
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def main(spec, measure: bool = False) -> int:
    """Entry point for the CLI (``pgs profile SPEC [--measure]``)."""
    return profile(spec, measure=measure)
