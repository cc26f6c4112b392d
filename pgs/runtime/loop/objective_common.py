"""What the objectives (``sft.py``, ``preference.py``, ``distill.py``) share: the rows a rank
reads, steps for a number of rows, whether a forward may defer the tied head's gradient, the
random documents of ``for_profile``, and the input-embedding noise.  The objectives import it;
it imports none of them (``objective.py``, the protocol and the registry, imports them).
"""

from __future__ import annotations

import math

import torch

import pgs.func as pf
from pgs.runtime.data.packing import Document


def rank_and_world(ctx, context: int = 1) -> tuple[int, int]:
    """``(rank, world size)`` of the data-parallel group a process reads rows for (``(0, 1)`` on
    one process); ``context`` ranks that split each row (``[parallel] context``) read the same rows."""

    if ctx is None or not ctx.distributed:
        return 0, 1
    return ctx.rank // context, ctx.world_size // context


def steps_for(rows: int, batch_size: int) -> int:
    """Optimizer steps of ``rows`` sequences at ``batch_size`` a step (at least one)."""

    return max(1, math.ceil(rows / batch_size))


def tied_head_deferrable(run, weight) -> bool:
    """Whether a forward may hand the head's gradient to the optimizer (``run.bound.before_step``
    with a ``DeferredHeadGrad``) instead of to autograd: gradient release on one process (the
    binder steps inside backward and takes contributions), ``defer_head_grad`` on in the binder's
    memory options (``run.bound.memory``, made by ``MemorySpec.options()``: ``"auto"`` with
    checkpointing or tied slabs), and a trainable head that is the input embedding's weight
    (tied), so its gradient joins the embedding's own right before that weight steps (whole, or
    slab by slab with ``tied_slabs``): no V×D gradient through backward.  The objectives'
    ``defers_head_grad`` start here."""

    if not (run.bound.in_backward and run.bound.defers_contributions and run.bound.memory.defer_head_grad
            and weight.requires_grad):
        return False
    embed = run.model.get_input_embeddings()
    return embed is not None and embed.weight is weight


def loss_memory(run, defer: bool) -> pf.MemoryOptions:
    """The memory options a forward hands its loss (``memory=``): the binder's (``run.bound.memory``,
    the run's ``[memory]`` made once by ``MemorySpec.options()``), deferring the head's gradient
    exactly where the objective's ``defers_head_grad`` said it may (``defer``)."""

    memory = run.bound.memory
    return memory if memory.defer_head_grad == defer else memory.evolve(defer_head_grad=defer)


def random_document(length: int, prompt: int, vocab: int, generator: torch.Generator):
    """A ``Document`` of ``length`` random token ids below ``vocab`` whose first ``prompt`` tokens
    are not trained (the rest are): the synthetic data of ``Objective.for_profile``."""

    ids = torch.randint(0, max(1, int(vocab)), (max(0, int(length)),), generator=generator).tolist()
    keep = min(max(0, int(prompt)), len(ids))
    return Document(tuple(ids), (False,) * keep + (True,) * (len(ids) - keep), "pgs profile")


# -- embedding noise (NEFTune, SymNoise), shared by the objectives that train on token embeddings
def embedding_noise_generator(spec, device: torch.device) -> dict[str, torch.Generator]:
    """``{"noise": generator}`` when the spec adds input-embedding noise (``loss.neftune_alpha``
    or ``loss.symnoise_alpha`` > 0; seeded by ``train.seed``), else ``{}``."""

    if spec.loss.embedding_noise() is None:
        return {}
    return {"noise": torch.Generator(device=device).manual_seed(spec.train.seed)}


def embedding_noise_hook(spec, generators: dict[str, torch.Generator], batch, device: torch.device):
    """The embedding hook that adds the spec's embedding noise to a batch's embeddings, scaled by
    each row's length: NEFTune (arXiv 2310.05914, ``pgs.func.losses.neftune``) or SymNoise
    (``pgs.func.losses.symnoise``); None without ``"noise"``."""

    gen = generators.get("noise")
    if gen is None:
        return None
    noise, alpha = spec.loss.embedding_noise()
    lengths = torch.tensor([int(c[-1]) for c in batch.cu_seqlens], device=device)
    return lambda e: noise(e, alpha, generator=gen, training=True, lengths=lengths)


__all__ = ["embedding_noise_generator", "embedding_noise_hook", "loss_memory", "random_document", "rank_and_world",
           "steps_for", "tied_head_deferrable"]
