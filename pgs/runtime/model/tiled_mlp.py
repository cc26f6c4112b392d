"""Sequence-tiled gated MLP: the MLP's [tokens, intermediate] tensors never exist whole.

The gated MLP of a HF decoder, ``down(act(gate(x)) · up(x))``, is the largest part of a layer's
working set: four ``[tokens, I]`` tensors (gate, act(gate), up, their product) and, in backward,
their gradients, with I ≈ 3.8·h.  Under full activation checkpointing that working set is
what a recomputed layer's backward adds on top of weights, optimizer state and the kept layer
inputs, so it sets the peak once the rest is lean (Qwen3-4B, 1×4096: ≈0.3 GiB of the ≈0.7 GiB a
recomputed layer holds).  Tiling the MLP along the tokens (as ALST's TiledMLP, Bekman et al.,
"Arctic Long Sequence Training", arXiv 2506.13996) keeps one tile's tensors at a time:

    forward:   y[t] = W_d (act(W_g x[t]) ⊙ W_u x[t])                     for each tile t
    backward:  g = W_g x[t],  u = W_u x[t],  a = act(g),  h = a ⊙ u       (recomputed per tile)
               dh = dy[t] W_d,   dW_d += dy[t]ᵀ h
               du = dh ⊙ a,      dg = act'(g) ⊙ (dh ⊙ u)
               dW_g += dgᵀ x[t], dW_u += duᵀ x[t],  dx[t] = dg W_g + du W_u

Only the input x (and the weights) is saved; backward recomputes each tile's gate and up
(the recompute of a checkpointed layer stops once x is saved, so the MLP's forward is not
run twice: ``tiled_gated_mlp``).  The weight gradients are accumulated tile by tile in place (``addmm_``) in
the weights' dtype and returned once, so gradient release's per-parameter hook fires once per
backward, as without tiling.  Cost: for bf16 weights the weight gradients are rounded to bf16
after each tile instead of once (k roundings; fp32 weights are exact to summation order); without
activation checkpointing the gate and up matmuls run a second time in backward.

Applies to MLP modules with ``gate_proj``, ``up_proj``, ``down_proj`` (bias-free linears) and
``act_fn`` (Llama, Qwen2/3, Mistral and their likes); other modules are refused.  The tiled
function runs outside ``torch.compile`` (a graph break around the MLP: the rest of the layer
stays compiled).  With SiLU (SwiGLU: Llama, Qwen, Mistral) the gating of each tile is one fused
in-place pass forward and one backward (``pgs.func.kernels.swiglu``: fp32 arithmetic, rounded
once; no [tile, I] buffer beyond gate, up and dh); other activations take their own autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pgs.errors import InvalidArgument
from pgs.runtime.model.layers import decoder_layers

_ORIGINAL = "_pgs_forward_before_mlp_tiles"


def is_silu(act) -> bool:
    """SiLU as transformers and torch spell it (``nn.SiLU``, ``SiLUActivation``, ``F.silu``)."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def _tiles(n: int, tiles: int) -> list[slice]:
    size = -(-n // tiles)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _gate_backward(act, g: Tensor, u: Tensor, dh: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, du, dg)`` of ``h = act(g)·u`` for any activation, through its own autograd."""
    with torch.enable_grad():
        g = g.detach().requires_grad_(True)
        a = act(g)
    du = dh * a.detach()
    dg, = torch.autograd.grad(a, g, dh * u)
    return a.detach() * u, du, dg


class _TiledMLPGrad(torch.autograd.Function):
    """Saves ``x`` and the weights and owns the MLP's whole backward; returns ``x`` (an alias
    that only ``_TiledMLPOut`` consumes, so the gradient reaching it is the MLP output's)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act, tiles: int) -> Tensor:
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.act, ctx.tiles = act, tiles
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        flat = x.reshape(-1, x.shape[-1])
        dflat = dy.reshape(-1, dy.shape[-1]).to(x.dtype)
        dx = torch.empty_like(flat) if need_x else None
        dw = [None, None, None]  # gate, up, down
        silu = is_silu(ctx.act)
        if silu:  # imported where a tile runs: the kernel module imports Triton
            from pgs.func.kernels.swiglu import swiglu_backward_
        for i, s in enumerate(_tiles(flat.shape[0], ctx.tiles)):
            xt, dyt = flat[s], dflat[s]
            if silu:  # one fused pass, in place: dh ← h, u ← du, g ← dg (pgs.func.kernels.swiglu)
                h, du, dg = swiglu_backward_(F.linear(xt, w_gate), F.linear(xt, w_up), dyt @ w_down)
            else:
                h, du, dg = _gate_backward(ctx.act, F.linear(xt, w_gate), F.linear(xt, w_up), dyt @ w_down)
            # the weight gradients summed over the tiles in place, and this tile's dx
            for j, (left, right, need) in enumerate(((dg, xt, need_g), (du, xt, need_u), (dyt, h, need_d))):
                if need:
                    dw[j] = left.t() @ right if i == 0 else dw[j].addmm_(left.t(), right)
            del h
            if need_x:
                torch.mm(dg, w_gate, out=dx[s])
                dx[s].addmm_(du, w_up)
        dx = dx.view_as(x) if need_x else None
        return dx, dw[0], dw[1], dw[2], None, None


class _TiledMLPOut(torch.autograd.Function):
    """The tiled forward; saves nothing, and hands the output's gradient to ``_TiledMLPGrad``."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: tuple, act, tiles: int) -> Tensor:
        w_gate, w_up, w_down = weights
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape[0], w_down.shape[0])
        silu = is_silu(act)
        if silu:
            from pgs.func.kernels.swiglu import swiglu_forward_
        for s in _tiles(flat.shape[0], tiles):
            xt = flat[s]
            if silu:
                h = swiglu_forward_(F.linear(xt, w_gate), F.linear(xt, w_up))
            else:
                h = act(F.linear(xt, w_gate)) * F.linear(xt, w_up)
            torch.mm(h, w_down.t(), out=out[s])
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        return dy, None, None, None


def tiled_gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act, tiles: int) -> Tensor:
    """``y = W_d (act(W_g x) ⊙ W_u x)``, ``tiles`` token slices at a time (see the module doc).

    Two autograd functions: the first saves ``x`` and the weights and computes every gradient
    in its backward; the second computes ``y`` and saves nothing, passing ``dy`` straight
    through to the first (its input is the first's output and nothing else reads it, so the
    gradient that arrives there is ``dy``; the MLP maps hidden to hidden, so the shapes agree).
    The order matters under activation checkpointing: the recompute of a layer stops as soon
    as the last saved tensor is rebuilt, which is the first function's, before the second
    runs, so backward never computes the MLP's forward a second time.
    """
    if w_down.shape[0] != x.shape[-1]:
        raise InvalidArgument(f"tiled_gated_mlp: the MLP maps {x.shape[-1]} features to {w_down.shape[0]}; "
                              "tiling needs hidden -> hidden")
    handle = _TiledMLPGrad.apply(x, w_gate, w_up, w_down, act, tiles)
    return _TiledMLPOut.apply(handle, (w_gate, w_up, w_down), act, tiles)


def _gated_parts(mlp) -> tuple | None:
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts):
        return None
    if not callable(getattr(mlp, "act_fn", None)):
        return None
    return tuple(parts)


def _tiled_forward(mlp, original, tiles: int):
    gate, up, down = _gated_parts(mlp)

    @torch.compiler.disable
    def tiled(x):
        return tiled_gated_mlp(x, gate.weight, up.weight, down.weight, mlp.act_fn, tiles)

    def forward(x, *args, **kwargs):
        if args or kwargs or not (torch.is_grad_enabled() and mlp.training):
            return original(x, *args, **kwargs)
        return tiled(x)

    forward._pgs_mlp_tiles = tiles
    return forward


def apply_mlp_tiles(model, tiles: int) -> int:
    """Tile every decoder layer's gated MLP along the tokens (``tiles`` slices); returns how many.

    ``tiles <= 1`` removes the tiling.  Refuses a model whose MLPs are not gated
    ``gate_proj``/``up_proj``/``down_proj`` modules with bias-free linears (e.g. after Liger's
    SwiGLU patch, or a mixture of experts).
    """

    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 0:
        raise InvalidArgument(f"apply_mlp_tiles: tiles={tiles!r} must be an int >= 0")
    layers = decoder_layers(model)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    for i, mlp in enumerate(mlps):
        if mlp is None or _gated_parts(mlp) is None:
            raise InvalidArgument(f"mlp_tiles: decoder layer {i}'s MLP ({type(mlp).__name__}) is not a gated "
                                  "gate_proj/up_proj/down_proj MLP with bias-free linears; set mlp_tiles = 0")
    for mlp in mlps:
        if _ORIGINAL in mlp.__dict__:  # undo a previous tiling first
            original = mlp.__dict__.pop(_ORIGINAL)
            if original is None:
                mlp.__dict__.pop("forward", None)
            else:
                mlp.forward = original
        if tiles > 1:
            mlp.__dict__[_ORIGINAL] = mlp.__dict__.get("forward")
            mlp.forward = _tiled_forward(mlp, mlp.forward, tiles)
    return len(mlps) if tiles > 1 else 0
