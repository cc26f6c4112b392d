"""Mixture-of-experts models in a run: router telemetry and the optional auxiliary losses.

transformers' MoE causal LMs (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE, ...) add their router
load-balancing loss inside ``ForCausalLM.forward``; pgs runs the base model and its own
chunked loss (``build.final_hidden``), so that loss never appears.  This module gets the
routers' logits back without ``output_router_logits`` (which would keep every layer's
``[tokens, E]`` logits alive to the end of forward): a forward hook on each router module
(the class transformers records as ``router_logits``) reduces the logits at once to the token
sums of :func:`pgs.func.losses.router_stats` (``[E]`` vectors and scalars), masking out the
padding of the packed batch.

The loop drives one :class:`RouterTap` per run (docs/moe.md):

* ``begin_step(batches)``: the step's router token count over all ranks (the denominator of
  the auxiliary losses, so that they are losses of the *global* batch);
* ``begin_micro(batch)`` before a micro-batch's forward, ``end_micro()`` after it: the
  micro-batch's share of the auxiliary losses (a tensor with its graph, added to what
  backward differentiates and never to the logged loss, which stays the token loss alone and
  comparable with a dense run);
* ``step_values()``: the step window's telemetry as device tensors (``moe/lb_loss``,
  ``moe/z_loss``, ``moe/max_vio``, ``moe/max_vio_worst``, ``moe/max_vio_layer``,
  ``moe/utilization``, ``moe/utilization_worst``, ``moe/dead_frac``, ``moe/dead_frac_worst``,
  ``moe/router_entropy``, ``moe/tokens``), read by the loop with the step's other metrics one
  step later: no host read of its own.

Global-batch load balance (Qiu et al. 2025, "Demons in the Detail", arXiv:2501.11873): the
load ``f`` is counted over every rank and micro-batch of the optimizer step, not per
micro-batch (a per-micro-batch ``f`` pushes each small batch to be uniform, which narrow
post-training data cannot be).  ``f`` is only known once the last micro-batch has routed, so
micro-batch ``m`` uses the counts of micro-batches ``1..m`` over all ranks (one all-reduce of
an ``[L, E]`` tensor per micro-batch, only with ``load_balance > 0`` on several processes):
exact with one micro-batch per step, and for the last one otherwise.  ``P`` is exact: each
micro-batch adds its probability sums divided by the step's global token count, and FSDP sums
the ranks' gradients.  The reported ``moe/lb_loss`` is the exact global value of the window.

Defaults are 0 for both coefficients (a pretrained router already balances its
pretraining distribution, and narrow post-training data legitimately skews expert use); the
telemetry is on whenever the model has routers.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from torch import Tensor

from pgs.errors import SpecError
from pgs.func.losses import (RouterStats, dead_fraction, load_balance_loss, load_utilization, max_violation,
                             router_stats, router_z_loss)
from pgs.runtime.process import all_reduce_sum, is_distributed

#: The telemetry keys of a step record, in this order.
METRIC_KEYS = ("moe/lb_loss", "moe/z_loss", "moe/max_vio", "moe/max_vio_worst", "moe/max_vio_layer",
               "moe/utilization", "moe/utilization_worst", "moe/dead_frac", "moe/dead_frac_worst",
               "moe/router_entropy", "moe/tokens")


def causal_lm_class(config) -> type | None:
    """The transformers causal-LM class of ``config`` (None where transformers' own mapping does
    not know it, e.g. a folder's remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def has_experts(model_class: type) -> bool:
    """Whether transformers can switch the expert implementation of ``model_class`` (its
    modelling code runs its experts through ``@use_experts_implementation``)."""
    can = getattr(model_class, "_can_set_experts_implementation", None)
    return bool(can()) if can is not None else False


def experts_implementation(name: str, config) -> str | None:
    """What to hand transformers for ``model.experts_implementation = name``: None for
    ``"auto"`` (transformers' own default: ``grouped_mm`` where the model supports it, else
    ``eager``), else ``name``.

    ``eager`` runs HF's loop over the experts that received tokens (one small matmul pair per
    expert); ``grouped_mm`` sorts the token-expert pairs by expert and runs each projection as
    one ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` over all experts;
    ``batched_mm`` gathers each pair's expert weights and runs one batched matmul (memory grows
    with tokens x top-k).  A ``SpecError`` naming the field when this transformers has no
    selectable expert implementations or lacks ``name``, or when the model (``config``'s
    causal-LM class) has no experts to run another way."""
    if name == "auto":
        return None
    import transformers

    field = f"model.experts_implementation: {name!r}"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        raise SpecError(f"{field} needs a transformers with selectable expert implementations; "
                        f"{transformers.__version__} has none (leave it \"auto\")") from None
    if name != "eager" and name not in ALL_EXPERTS_FUNCTIONS.valid_keys():
        raise SpecError(f"{field} is not an expert implementation of transformers {transformers.__version__} "
                        f"(it has eager, {', '.join(sorted(ALL_EXPERTS_FUNCTIONS.valid_keys()))})")
    cls = causal_lm_class(config)
    if cls is not None and not has_experts(cls):
        raise SpecError(f"{field}: {cls.__name__} has no mixture-of-experts layers "
                        "(leave it \"auto\")")
    return name


def check_experts_implementation(model, name: str | None) -> None:
    """After the build: the model runs its experts through ``name`` (a model whose class
    ``experts_implementation`` could not look up, such as remote code, is checked here)."""
    if name is None:
        return
    if not any(has_experts(type(m)) for m in model.modules()):
        raise SpecError(f"model.experts_implementation: {name!r}: {type(model).__name__} "
                        "has no mixture-of-experts layers "
                        "(leave it \"auto\")")
    used = getattr(model.config, "_experts_implementation", None)
    if used != name:
        raise SpecError(f"model.experts_implementation: {name!r} asked for, but transformers built "
                        f"{type(model).__name__} with {used!r}")


def _router_classes(model) -> tuple[type, ...]:
    """The classes transformers hooks for ``output_router_logits`` (``_can_record_outputs``)."""
    found = []
    for cls in type(model).__mro__:
        recorders = vars(cls).get("_can_record_outputs") or {}
        rec = recorders.get("router_logits")
        target = getattr(rec, "target_class", rec)
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            found.append(target)
    return tuple(found)


def _layer_index(name: str, fallback: int) -> int:
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(match.group(1)) if match else fallback


def find_routers(model) -> list[tuple[int, str, torch.nn.Module]]:
    """``(layer index, name, router module)`` of every router of a HF MoE model (empty for a
    dense one).  A router must say its ``top_k``."""
    classes = _router_classes(model)
    if not classes:
        return []
    out = []
    for name, module in model.named_modules():
        if isinstance(module, classes):
            if not isinstance(getattr(module, "top_k", None), int):
                raise SpecError(f"moe: the router {name} ({type(module).__name__}) has no integer top_k; "
                                "pgs cannot count its expert choices")
            out.append((_layer_index(name, len(out)), name, module))
    return out


def _in_backward() -> bool:
    """True while autograd's engine runs (a checkpointed layer's recompute): not a new forward."""
    return torch._C._current_graph_task_id() != -1


class RouterTap:
    """Forward hooks on a model's routers; see the module docstring.

    ``load_balance``, ``router_z_loss``: the coefficients of the auxiliary losses (0: the loss
    is neither computed with a graph nor added).  ``telemetry``: compute ``step_values``.
    """

    def __init__(self, routers: Sequence[tuple[int, str, torch.nn.Module]], *, load_balance: float = 0.0,
                 router_z_loss: float = 0.0, telemetry: bool = True):
        if not routers:
            raise SpecError("moe: the model has no mixture-of-experts router")
        self.layers = [i for i, _, _ in routers]
        self.names = [n for _, n, _ in routers]
        self.top_k = [int(m.top_k) for _, _, m in routers]
        self.load_balance = float(load_balance)
        self.z_coef = float(router_z_loss)
        self.telemetry = bool(telemetry)
        self._slot = {id(m): j for j, (_, _, m) in enumerate(routers)}
        self._handles = [m.register_forward_hook(self._hook) for _, _, m in routers]
        self._active = False
        self._mask: Tensor | None = None
        self._masks: dict[torch.dtype, Tensor] = {}  # the mask in each statistics dtype, cast once per micro-batch
        self._top_k: Tensor | None = None  # top_k as a device tensor ([L]), made once
        self._layer_ids: Tensor | None = None  # the layers' indices as a device tensor ([L]), made once
        self._parts: list[list[RouterStats]] = [[] for _ in routers]
        self._window: Tensor | None = None  # [L, 2E + 3] detached sums of the step (this rank)
        self._seen: Tensor | None = None  # [L, E + 1] counts and tokens so far, all ranks (load balance)
        self._step_tokens: Tensor | float = 1.0  # router tokens of the step, all ranks
        self._denominator = 1.0  # the loop's loss denominator (begin_step)

    @property
    def aux(self) -> bool:
        return self.load_balance > 0 or self.z_coef > 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks

    def _hook(self, module, inputs, output):
        recording = self._active and not _in_backward()
        if not (recording or (self.aux and _in_backward())):
            return None  # eval, reference and no-grad forwards are not counted
        logits = output[0] if isinstance(output, (tuple, list)) else output
        selected = None
        if isinstance(output, (tuple, list)) and len(output) >= 3 and isinstance(output[2], Tensor) \
                and not output[2].is_floating_point():
            selected = output[2]  # the model's own choice (a router with a bias or groups may differ)
        logits = logits.reshape(-1, logits.shape[-1])
        mask = self._mask_for(logits) if self._mask is not None and self._mask.numel() == logits.shape[0] else None
        j = self._slot[id(module)]
        # the same ops in forward and in a checkpointed recompute (torch.utils.checkpoint checks that
        # the recompute saves what forward saved); only the forward's result is kept
        with torch.enable_grad() if self.aux else torch.no_grad():
            stats = router_stats(logits if self.aux else logits.detach(), self.top_k[j],
                                 selected=None if selected is None else selected.reshape(-1, selected.shape[-1]),
                                 mask=mask)
        if recording:
            self._parts[j].append(stats)
        return None

    def _mask_for(self, logits: Tensor) -> Tensor:
        """The micro-batch's mask in the dtype ``router_stats`` sums ``logits`` in, cast once
        for all the routers (the cast is then no op of theirs)."""
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        mask = self._masks.get(dtype)
        if mask is None:
            mask = self._masks[dtype] = self._mask.to(device=logits.device, dtype=dtype)
        return mask

    def _per_layer(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(top_k, layer index)`` of every router as ``[L]`` float64 tensors on ``device``,
        copied there once."""
        if self._top_k is None or self._top_k.device != device:
            both = torch.tensor([self.top_k, self.layers], dtype=torch.float64).to(device)
            self._top_k, self._layer_ids = both[0], both[1]
        return self._top_k, self._layer_ids

    # ------------------------------------------------------------------ the loop's calls

    def begin_step(self, batches: Sequence[Any], device: torch.device, loss_denominator: int = 1) -> None:
        """The step's router token count over all ranks (non-padding tokens; a device value).
        ``loss_denominator``: what the loop divides each micro-batch's summed loss by before
        backward (the step's valid tokens, all ranks); ``end_micro`` returns the auxiliary loss
        multiplied by it, so that it enters backward at its own scale."""
        self._denominator = float(max(int(loss_denominator), 1))
        local = float(sum(int(b.num_tokens) for b in batches))
        if self.aux and is_distributed():
            self._step_tokens = all_reduce_sum(torch.tensor([local], dtype=torch.float64, device=device))[0]
        else:
            self._step_tokens = local
        self._seen = None

    def begin_micro(self, batch, device: torch.device) -> None:
        """Count the router calls of the next forward, padding excluded.  The mask is made where
        the batch lives: a row's length is the last of its ``cu_seqlens`` (on the device after the
        loader's copy), never read on the host (a read there would wait for the device)."""
        mask = getattr(batch, "token_mask", None)  # a context-parallel shard says which of its tokens are real
        if mask is None:
            rows = batch.cu_seqlens
            lengths = torch.stack([c[-1] if len(c) else c.new_zeros(()) for c in rows]).to(device, non_blocking=True)
            width = batch.input_ids.shape[-1]
            mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
        self._mask = mask.reshape(-1).to(device, non_blocking=True)
        self._masks = {}
        self._parts = [[] for _ in self.layers]
        self._active = True

    def _collect(self) -> RouterStats | None:
        """The micro-batch's stats per router, stacked ``[L, ...]`` (None if no router ran)."""
        if not any(self._parts):
            return None
        missing = [self.names[j] for j, p in enumerate(self._parts) if not p]
        if missing:
            raise RuntimeError(f"moe: routers {missing[:3]} did not run in this forward")
        per_layer = []
        for parts in self._parts:
            first = parts[0]
            per_layer.append(first if len(parts) == 1 else RouterStats(*(sum(x) for x in zip(*parts))))
        return RouterStats(*(torch.stack(list(x)) for x in zip(*per_layer)))

    def end_micro(self) -> Tensor | None:
        """Stop counting; the micro-batch's share of the auxiliary losses times the loop's loss
        denominator (``begin_step``), or None without auxiliary losses."""
        self._active = False  # the mask stays: a checkpointed recompute replays the same ops
        stats = self._collect()
        self._parts = [[] for _ in self.layers]
        if stats is None:
            return None
        detached = torch.cat([stats.counts, stats.prob_sum.detach(), stats.z_sum[:, None].detach(),
                              stats.entropy_sum[:, None], stats.tokens[:, None]], dim=1).double()
        if self.telemetry:
            self._window = detached if self._window is None else self._window + detached
        if not self.aux:
            return None
        layers = len(self.layers)
        n = self._step_tokens
        n = n if isinstance(n, Tensor) else torch.tensor(n, dtype=torch.float64, device=detached.device)
        n = n.to(stats.prob_sum.dtype).expand(layers)
        aux = stats.prob_sum.new_zeros(())
        if self.load_balance > 0:
            experts = stats.counts.shape[-1]
            seen = torch.cat([stats.counts.double(), stats.tokens[:, None].double()], dim=1)
            if is_distributed():
                seen = all_reduce_sum(seen)
            self._seen = seen if self._seen is None else self._seen + seen
            counts = self._seen[:, :experts].to(stats.prob_sum.dtype)
            count_tokens = self._seen[:, experts].to(stats.prob_sum.dtype)
            top_k, _ = self._per_layer(counts.device)
            per_router = load_balance_loss(counts, stats.prob_sum, n, top_k, count_tokens)
            aux = aux + self.load_balance * per_router.mean()
        if self.z_coef > 0:
            aux = aux + self.z_coef * router_z_loss(stats.z_sum, n).mean()
        return aux * self._denominator

    def step_values(self) -> dict[str, Tensor]:
        """The window's telemetry over all ranks (device tensors; empty without telemetry or
        without a recorded forward).  Starts the next window."""
        window, self._window = self._window, None
        if window is None or not self.telemetry:
            return {}
        if is_distributed():
            window = all_reduce_sum(window)
        experts = (window.shape[1] - 3) // 2
        counts, prob_sum = window[:, :experts], window[:, experts:2 * experts]
        z_sum, entropy_sum, tokens = window[:, 2 * experts], window[:, 2 * experts + 1], window[:, 2 * experts + 2]
        top_k, layer_ids = self._per_layer(window.device)
        lb = load_balance_loss(counts, prob_sum, tokens, top_k)  # every layer at once
        vio = max_violation(counts)
        util = load_utilization(counts)
        dead = dead_fraction(counts)
        return {
            "moe/lb_loss": lb.mean(),
            "moe/z_loss": router_z_loss(z_sum, tokens).mean(),
            "moe/max_vio": vio.mean(),
            "moe/max_vio_worst": vio.max(),
            # a tensor index: no host read
            "moe/max_vio_layer": layer_ids.gather(0, vio.argmax().reshape(1)).reshape(()),
            "moe/utilization": util.mean(),
            "moe/utilization_worst": util.min(),
            "moe/dead_frac": dead.mean(),
            "moe/dead_frac_worst": dead.max(),
            "moe/router_entropy": entropy_sum.sum() / tokens.sum().clamp_min(1),
            "moe/tokens": tokens.max(),
        }


def router_tap(model, spec) -> RouterTap | None:
    """The run's :class:`RouterTap` from ``[moe]`` (``spec``: a ``MoESpec``), or None for a
    dense model.  Nonzero coefficients on a model without routers are refused (``SpecError``)."""
    routers = find_routers(model)
    if not routers:
        if spec.load_balance > 0 or spec.router_z_loss > 0:
            raise SpecError(f"moe.load_balance / moe.router_z_loss: {type(model).__name__} has no "
                            "mixture-of-experts router (set them to 0 or remove [moe])")
        return None
    if not spec.telemetry and not (spec.load_balance > 0 or spec.router_z_loss > 0):
        return None
    return RouterTap(routers, load_balance=spec.load_balance, router_z_loss=spec.router_z_loss,
                     telemetry=spec.telemetry)
