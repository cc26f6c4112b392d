"""The loss conformance registry: batched losses that ``test_loss_conformance.py`` checks.

The transform registry (``registry.py``) holds ``pf.Transform``s; a loss is another kind of
object (tensors in, tensors out, gradients to some inputs), so it registers here.  A
``LossEntry`` says how to draw inputs and how a batch splits into two parts whose outputs
combine into the whole batch's.  A new loss joins by appending an entry to ``ENTRIES``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pgs.func import MemoryOptions
from pgs.func.losses import (DISTILL_KINDS, PREFERENCE_KINDS, REFERENCE_FREE, distill_loss, kto_loss, preference_loss,
                             router_stats, sequence_logps)

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Inputs:
    """``fn(*args, **kwargs)``; ``grad``: the indices of ``args`` that get gradients."""

    args: tuple
    kwargs: dict
    grad: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LossEntry:
    """One loss under test.

    Attributes:
        name: unique id.
        fn: the loss; returns a tuple of tensors, the first differentiable.
        draw: ``draw(gen, n, dtype) -> Inputs`` for a batch of size n ≥ 1.
        split: ``split(inputs, k) -> (first, rest)``: the batch cut after item k (0 < k < n).
        combine: ``combine(out_first, out_rest) -> out``: what the whole batch returns.
        dtypes: input dtypes to try.
        covers: the public names this entry exercises (kinds included).
    """

    name: str
    fn: Callable
    draw: Callable[[torch.Generator, int, torch.dtype], Inputs]
    split: Callable[[Inputs, int], tuple[Inputs, Inputs]]
    combine: Callable[[tuple, tuple], tuple]
    dtypes: tuple = (F32, F64, BF16)
    covers: tuple[str, ...] = ()


# ---- preference_loss: one entry per kind; pairs are independent -------------------------------


def _preference_entry(kind: str, **hyper) -> LossEntry:
    free = kind in REFERENCE_FREE

    def draw(gen, n, dtype):
        c, r, rc, rr = ((-torch.rand(n, generator=gen, dtype=F64) * 40 - 0.1).to(dtype) for _ in range(4))
        lc, lr = torch.randint(1, 20, (n,), generator=gen), torch.randint(1, 20, (n,), generator=gen)
        args = (c, r) if free else (c, r, rc, rr)
        return Inputs(args, dict(kind=kind, chosen_lengths=lc, rejected_lengths=lr, **hyper), grad=(0, 1))

    def split(inp, k):
        def cut(sl):
            kw = {key: (v[sl] if isinstance(v, torch.Tensor) else v) for key, v in inp.kwargs.items()}
            return Inputs(tuple(a[sl] for a in inp.args), kw, inp.grad)

        return cut(slice(0, k)), cut(slice(k, None))

    def combine(a, b):
        return tuple(torch.cat([x, y]) for x, y in zip(a, b))

    name = ",".join([kind, *(f"{k}={v}" for k, v in hyper.items())])
    return LossEntry(f"preference_loss[{name}]", preference_loss, draw, split, combine,
                     covers=("preference_loss", kind))


# ---- sequence_logps: rows of a packed batch; sequences shared across the cut add up ----------


def _deferred_sequence_logps(h, W, labels, seq, num, **kwargs):
    """``sequence_logps(..., defer_head_grad=True)``'s tensors (its ``DeferredHeadGrad`` left out:
    W's gradient goes there, not to autograd; tests/unit/test_preference_losses.py checks it)."""
    logp, lengths, _ = sequence_logps(h, W, labels, seq, num, memory=MemoryOptions(defer_head_grad=True), **kwargs)
    return logp, lengths


def _sequence_entry(softcap, deferred: bool = False) -> LossEntry:
    V, D, S = 7, 4, 6

    def draw(gen, n, dtype):
        h = torch.randn(n, S, D, generator=gen, dtype=F64).to(dtype)
        W = torch.randn(V, D, generator=gen, dtype=F64).to(dtype)
        if deferred:  # a trainable head, so that the deferral engages
            W.requires_grad_()
        labels = torch.randint(0, V, (n, S), generator=gen)
        labels[torch.rand(n, S, generator=gen) < 0.3] = -100
        seq = torch.randint(-1, 3, (n, S), generator=gen)  # a sequence may span rows here
        return Inputs((h, W, labels, seq, 3), dict(chunk_size=5, softcap=softcap), grad=(0,) if deferred else (0, 1))

    def split(inp, k):
        h, W, labels, seq, num = inp.args
        return (Inputs((h[:k], W, labels[:k], seq[:k], num), inp.kwargs, inp.grad),
                Inputs((h[k:], W, labels[k:], seq[k:], num), inp.kwargs, inp.grad))

    def combine(a, b):
        return tuple(x + y for x, y in zip(a, b))

    if deferred:
        return LossEntry(f"sequence_logps[deferred, softcap={softcap}]", _deferred_sequence_logps, draw, split,
                         combine, covers=("sequence_logps",))
    return LossEntry(f"sequence_logps[softcap={softcap}]", sequence_logps, draw, split, combine,
                     covers=("sequence_logps",))


# ---- router_stats: token sums of a mixture-of-experts router; tokens are independent ---------


def _router_entry(top_k: int, masked: bool) -> LossEntry:
    E = 6

    def draw(gen, n, dtype):
        logits = (torch.randn(n, E, generator=gen, dtype=F64) * 3).to(dtype)
        kwargs = {"mask": torch.rand(n, generator=gen) < 0.7} if masked else {}
        return Inputs((logits, top_k), kwargs, grad=(0,))

    def split(inp, k):
        def cut(sl):
            kw = {key: v[sl] for key, v in inp.kwargs.items()}
            return Inputs((inp.args[0][sl], top_k), kw, inp.grad)

        return cut(slice(0, k)), cut(slice(k, None))

    def combine(a, b):
        return tuple(x + y for x, y in zip(a, b))

    return LossEntry(f"router_stats[k={top_k},masked={masked}]", router_stats, draw, split, combine,
                     covers=("router_stats",))


# ---- distill_loss: sums over the masked tokens of rows; rows add up -------------------------


def _distill_entry(kind: str, **hyper) -> LossEntry:
    V, D, Dt, S = 9, 4, 6, 5

    def draw(gen, n, dtype):
        hs = torch.randn(n, S, D, generator=gen, dtype=F64).to(dtype)
        Ws = torch.randn(V, D, generator=gen, dtype=F64).to(dtype)
        ht = torch.randn(n, S, Dt, generator=gen, dtype=F64).to(dtype)
        Wt = torch.randn(V, Dt, generator=gen, dtype=F64).to(dtype)
        mask = torch.rand(n, S, generator=gen) < 0.6
        return Inputs((hs, Ws, ht, Wt, mask), dict(kind=kind, chunk_size=4, **hyper), grad=(0, 1))

    def split(inp, k):
        hs, Ws, ht, Wt, mask = inp.args
        return (Inputs((hs[:k], Ws, ht[:k], Wt, mask[:k]), inp.kwargs, inp.grad),
                Inputs((hs[k:], Ws, ht[k:], Wt, mask[k:]), inp.kwargs, inp.grad))

    def combine(a, b):
        return tuple(x + y for x, y in zip(a, b))

    name = ",".join([kind, *(f"{k}={v}" for k, v in hyper.items())])
    return LossEntry(f"distill_loss[{name}]", distill_loss, draw, split, combine, covers=("distill_loss", kind))


# ---- kto_loss: examples are independent given the reference point z_ref (an argument) ----------


def _kto_entry(**hyper) -> LossEntry:
    def draw(gen, n, dtype):
        logps, ref = ((-torch.rand(n, generator=gen, dtype=F64) * 40 - 0.1).to(dtype) for _ in range(2))
        desirable = torch.rand(n, generator=gen) < 0.5
        z = (torch.rand((), generator=gen, dtype=F64) * 3).to(dtype)
        return Inputs((logps, ref, desirable, z), dict(hyper), grad=(0,))

    def split(inp, k):
        logps, ref, desirable, z = inp.args
        return (Inputs((logps[:k], ref[:k], desirable[:k], z), inp.kwargs, inp.grad),
                Inputs((logps[k:], ref[k:], desirable[k:], z), inp.kwargs, inp.grad))

    def combine(a, b):
        return (*(torch.cat([x, y]) for x, y in zip(a[:3], b[:3])), a[3])

    name = ",".join(f"{k}={v}" for k, v in hyper.items())
    return LossEntry(f"kto_loss[{name}]", kto_loss, draw, split, combine, covers=("kto_loss", "kto"))


ENTRIES = [
    _preference_entry("dpo"),
    _preference_entry("dpo", label_smoothing=0.1, beta=0.5),
    _preference_entry("ipo", beta=0.05),
    _preference_entry("hinge", beta=0.2),
    _preference_entry("dpop", lam=5.0),
    _preference_entry("simpo", beta=2.0, gamma=0.5),
    _preference_entry("orpo", nll_weight=0.1),
    _kto_entry(),
    _kto_entry(beta=0.5, desirable_weight=1.33, undesirable_weight=0.75),
    _sequence_entry(None),
    _sequence_entry(3.0),
    _sequence_entry(None, deferred=True),
    _sequence_entry(3.0, deferred=True),
    _router_entry(1, False),
    _router_entry(2, True),
    _distill_entry("forward_kl"),
    _distill_entry("reverse_kl", temperature=2.0),
    _distill_entry("jsd"),
    _distill_entry("jsd", beta=0.1, temperature=0.7),
]

#: The names that must be covered: every loss entry point and every kind.
REQUIRED = ("preference_loss", "sequence_logps", *PREFERENCE_KINDS, "kto_loss", "kto", "distill_loss", *DISTILL_KINDS, "router_stats")
