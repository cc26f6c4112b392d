"""The preference objective of a run with ``[preference]`` (docs/techniques/preference.md).

:class:`PreferenceObjective` is the run's objective (``pgs.runtime.loop.objective``): the
policy's summed log-probs of each pair's chosen and rejected completion
(``pgs.func.losses.sequence_logps``, chunked over the vocabulary, the two arms packed as
isolated documents of one row), the reference's (:class:`Reference`), and
``pgs.func.losses.preference_loss`` summed over the micro-batch's pairs; the step divides by
the step's number of pairs, so the gradient is that of one mean over the step's pairs.

The reference: ``preference.reference = "cached"`` (default) runs the frozen reference (the
initial policy, or ``preference.reference_path``) over every training and held-out pair once,
before the first step, and keeps the numbers in the run folder
(``pgs.runtime.store.reference``); a resumed run reads them back.  ``"live"`` keeps a frozen
copy on the device that scores each batch.  ``simpo`` and ``orpo`` need no reference.

Memory: with gradient release on one process and a tied head (``memory.defer_head_grad``, on by
``"auto"`` with checkpointing or ``tied_slabs``) the policy's sequence log-probs leave the head's
gradient to a ``DeferredHeadGrad`` that their backward fills (gates −∂L/∂logp_sum per token) and
the embedding's hook adds right before that weight steps, slab by slab with ``tied_slabs``: no
V×D head gradient through backward, as in SFT (docs/memory.md).

Several processes (FSDP2): each rank reads its share of every global batch of pairs
(``PreferenceStream(rank=, world_size=)``), the step divides by the global pair count, the
reference cache is read or computed by rank 0 before the model is sharded and read back from
the run folder by the other ranks, and every rank evaluates all held-out pairs.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import time
from typing import Any, Sequence

import attrs
import torch

from pgs.errors import PgsError
from pgs.func import NO_MEMORY_OPTIONS
from pgs.func.losses import preference_loss, sequence_logps
from pgs.runtime.data.packing import Document, pad_id
from pgs.runtime.data.preference import Pair, PreferenceBatch, PreferenceStream, collate_pairs, eval_batches, read_pairs
from pgs.runtime.dist import fsdp as D
from pgs.runtime.loop.objective_common import (embedding_noise_generator, embedding_noise_hook, random_document,
                                        loss_memory, rank_and_world, steps_for, tied_head_deferrable)
from pgs.runtime.model.build import build_model, final_hidden, output_head
from pgs.runtime.process import is_distributed
from pgs.runtime.store import reference as cache

#: The per-step sums the objective reports, in the order of its stats tensor.
STAT_KEYS = ("reward_chosen", "reward_rejected", "preference_accuracy", "logp_chosen", "logp_rejected")


def pair_logps(model, batch: PreferenceBatch, device: torch.device, chunk_size: int,
               embed_noise=None, memory_for=None) -> tuple:
    """Summed log-probs ``[P, 2]`` (fp32; column 0 chosen, 1 rejected) and completion lengths
    ``[P, 2]`` of the batch's pairs under ``model``.

    ``memory_for(weight) -> pf.MemoryOptions``: asked with the head's weight after the forward, the
    memory options of the sequence log-probs; where their ``defer_head_grad`` says so the head's
    gradient is left out of autograd.  With ``memory_for`` given the result has a third element:
    that ``DeferredHeadGrad``, or None."""
    h = final_hidden(model, batch.input_ids.to(device), batch.position_ids.to(device), embed_noise=embed_noise)
    weight, bias, softcap = output_head(model)
    memory = NO_MEMORY_OPTIONS if memory_for is None else memory_for(weight)
    out = sequence_logps(h, weight, batch.labels.to(device), batch.seq_ids.to(device), 2 * batch.num_pairs,
                         chunk_size=chunk_size, bias=bias, softcap=softcap, memory=memory)
    logps, lengths = out[0].view(-1, 2), out[1].view(-1, 2)
    if memory_for is None:
        return logps, lengths
    return logps, lengths, out[2] if memory.defer_head_grad else None


@torch.no_grad()
def score_pairs(model, pairs: Sequence[Pair], tokenizer, config, device: torch.device, chunk_size: int) -> torch.Tensor:
    """``[len(pairs), 2]`` summed log-probs of every pair, row ``i`` for the pair whose index is ``i``."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        for batch in eval_batches(pairs, tokenizer, config):
            sums, _ = pair_logps(model, batch, device, chunk_size)
            out[batch.pair_ids] = sums.float().cpu()
    finally:
        model.train(was_training)
    return out


@attrs.define
class Reference:
    """Reference log-probs: cached tensors (``train``/``eval``: ``[pairs, 2]``), or a live frozen model."""

    mode: str  # "cached", "live" or "none" (a reference-free kind)
    train: torch.Tensor | None = None
    eval: torch.Tensor | None = None
    model: Any = None
    path: str | None = None
    key: str | None = None  # the cache's fingerprint digest (cache.key): what a checkpoint records
    # the tables where the batches' pair ids live (the loader puts batches on the training
    # device): copied there once, so a step gathers on the device and reads nothing back
    _placed: dict = attrs.field(factory=dict)

    def logps(self, batch: PreferenceBatch, device: torch.device, chunk_size: int, *, split: str = "train"):
        """``[P, 2]`` reference log-probs of the batch's pairs (None without a reference)."""
        if self.mode == "none":
            return None
        if self.mode == "live":
            with torch.no_grad():
                return pair_logps(self.model, batch, device, chunk_size)[0].detach()
        ids = batch.pair_ids
        key = (split, ids.device)
        if key not in self._placed:
            self._placed[key] = (self.train if split == "train" else self.eval).to(ids.device)
        return self._placed[key][ids].to(device)


def _reference_model(spec, policy, tokenizer, device: torch.device):
    pref, m = spec.preference, spec.model
    if pref.reference_path is None:
        return policy
    return build_model(path=pref.reference_path, config=None, dtype=m.dtype, attn_implementation=m.attn_implementation,
                       varlen_kernel=m.varlen_kernel, experts_implementation=m.experts_implementation,
                       init_seed=m.init_seed, vocab_size=len(tokenizer), device=device,
                       trust_remote_code=m.trust_remote_code)


def prepare_reference(spec, policy, tokenizer, device: torch.device, train_pairs: Sequence[Pair],
                      eval_pairs: Sequence[Pair]) -> Reference:
    """The run's reference, before its first step (``policy`` still holds its initial weights,
    unsharded).

    ``cached``: the run folder's cache when its fingerprint matches (a stale one is refused),
    else computed now and written there; with several processes rank 0 does this and the other
    ranks read the file it wrote (or raise the error it raised).  ``live``: a frozen copy (or
    the reference folder's model) kept on the device of every rank."""
    pref = spec.preference
    if not pref.uses_reference:
        return Reference("none")
    if pref.reference == "live":
        ref = _reference_model(spec, policy, tokenizer, device)
        ref = copy.deepcopy(ref) if ref is policy else ref
        ref.requires_grad_(False)
        ref.eval()
        return Reference("live", model=ref)
    if not is_distributed():
        return _cached_reference(spec, policy, tokenizer, device, train_pairs, eval_pairs)
    reference, failure = None, None
    if D.rank() == 0:
        try:
            reference = _cached_reference(spec, policy, tokenizer, device, train_pairs, eval_pairs)
        except Exception as err:  # every rank must hear of it, not wait in the broadcast below
            failure = err
    shared = D.broadcast_object(_portable(failure))
    if failure is not None:
        raise failure
    if shared is not None:
        raise shared
    if reference is not None:
        return reference
    path = cache.cache_path(spec.run_dir)
    expected = cache.fingerprint(spec, tokenizer)
    found = cache.load(path, expected)
    if found is None:
        raise cache.StaleReference(f"{path}: rank 0 wrote the reference log-probs but this rank cannot read them "
                                   "(checkpoint.dir must be one folder that every process sees)")
    return Reference("cached", train=found["train"], eval=found["eval"], path=path, key=cache.key(expected))


def _portable(err: BaseException | None) -> BaseException | None:
    """``err`` as it can travel to the other ranks (pickled): itself, or a ``PgsError`` with its text."""
    if err is None:
        return None
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return PgsError(f"rank 0 could not prepare the reference log-probs: {type(err).__name__}: {err}")


def _cached_reference(spec, policy, tokenizer, device: torch.device, train_pairs: Sequence[Pair],
                      eval_pairs: Sequence[Pair]) -> Reference:
    """The run folder's cache, reused or computed and written (one process, or rank 0)."""
    path = cache.cache_path(spec.run_dir)
    expected = cache.fingerprint(spec, tokenizer)
    cache.remove_stale_temporaries(path)
    found = cache.load(path, expected)
    if found is not None:
        counts = {"train": len(train_pairs), "eval": len(eval_pairs)}
        wrong = [k for k, n in counts.items() if found[k].shape[0] != n]
        if wrong:
            raise cache.StaleReference(f"{path}: holds {', '.join(f'{found[k].shape[0]} {k}' for k in wrong)} "
                                       f"pairs, the data has {', '.join(f'{counts[k]}' for k in wrong)}; delete "
                                       "the file to recompute it")
        print(f"pgs: reference log-probs: reused {path} ({len(train_pairs)} pairs)", file=sys.stderr, flush=True)
        return Reference("cached", train=found["train"], eval=found["eval"], path=path, key=cache.key(expected))
    started = time.perf_counter()
    ref = _reference_model(spec, policy, tokenizer, device)
    chunk = spec.loss.chunk_size
    train = score_pairs(ref, train_pairs, tokenizer, spec.data, device, chunk)
    held = score_pairs(ref, eval_pairs, tokenizer, spec.data, device, chunk)
    if ref is not policy:
        del ref
    cache.save(path, {"train": train, "eval": held}, expected)
    print(f"pgs: reference log-probs: computed {len(train_pairs)} + {len(eval_pairs)} pairs in "
          f"{time.perf_counter() - started:.1f} s -> {path}", file=sys.stderr, flush=True)
    return Reference("cached", train=train, eval=held, path=path, key=cache.key(expected))


class PreferenceObjective:
    """The :class:`~pgs.runtime.loop.objective.Objective` of ``[preference]`` runs (see the
    module docstring): the loss of a micro-batch is the sum of its pairs' losses, the step
    divides by the step's number of pairs."""

    name = "preference"
    section = "preference"
    stat_keys = STAT_KEYS
    console_keys = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy", "logp_chosen",
                    "logp_rejected")
    loader_ahead = 2  # pairs are tokenized up front: their batches are cheap, no pack window to keep ahead of
    router_tap = False  # a [preference] run takes no router loss and logs no router statistics
    splits_rows = False  # a sequence's log-prob sums over the whole arm
    whole_rows_reason = ("a pair's loss is a nonlinear function of each arm's log-prob summed over all its tokens, "
                         "so ranks holding parts of an arm cannot each take a share of the loss or of its gradient "
                         "from their own tokens")

    def __init__(self, spec, reference: Reference, eval_pairs: Sequence[Pair], *, stream=None,
                 device: torch.device | None = None):
        self.spec = spec
        self.pref = spec.preference
        self.reference = reference
        self.eval_pairs = list(eval_pairs)
        self.stream = stream
        self._generators = embedding_noise_generator(spec, device) if device is not None else {}

    @classmethod
    def create(cls, spec, *, model, tokenizer, device: torch.device, ctx=None) -> "PreferenceObjective":
        """The pairs are read and tokenized once; the reference scores them with the initial weights."""
        rank, world = rank_and_world(ctx)
        stream = PreferenceStream(spec.data, tokenizer, rank=rank, world_size=world)
        eval_pairs = read_eval_pairs(spec, tokenizer)
        os.makedirs(spec.checkpoint.dir, exist_ok=True)
        reference = prepare_reference(spec, model, tokenizer, device, stream.pairs, eval_pairs)
        return cls(spec, reference, eval_pairs, stream=stream, device=device)

    @classmethod
    def for_profile(cls, spec, *, model, tokenizer, device: torch.device, rows: int, seq_len: int,
                    generator: torch.Generator) -> tuple["PreferenceObjective", list]:
        """``pgs profile --measure``'s preference step: ``rows`` rows of ``seq_len`` tokens, each one
        pair whose two arms (a shared prompt of a quarter of the row's half, then the arm's
        trained completion) fill the row, as ``PreferenceStream`` packs pairs; the reference as
        ``create`` makes it (``"live"``: a frozen copy on the device, or ``reference_path``'s
        model), a ``"cached"`` one a table of zeros for these pairs (the cache is not read or
        written: its scoring pass runs before the first step, not in it)."""
        vocab = model.get_input_embeddings().num_embeddings
        arm = max(2, seq_len // 2)
        prompt = arm // 4
        pairs = []
        for i in range(rows):
            shared = random_document(prompt, prompt, vocab, generator)
            chosen, rejected = (random_document(arm - prompt, 0, vocab, generator) for _ in range(2))
            arms = (Document(shared.input_ids + a.input_ids, shared.train_mask + a.train_mask, shared.origin)
                    for a in (chosen, rejected))
            pairs.append(Pair(*arms, i))
        pref = spec.preference
        if pref.uses_reference and pref.reference != "live":
            reference = Reference("cached", train=torch.zeros(rows, 2), eval=torch.zeros(0, 2))
        else:
            reference = prepare_reference(spec, model, tokenizer, device, [], [])
        batch = collate_pairs([[p] for p in pairs], pad_id(tokenizer, 0), seq_len=max(seq_len, 2 * arm))
        return cls(spec, reference, [], device=device), [batch]

    @classmethod
    def selects(cls, spec) -> bool:
        """Whether this class trains a spec with its section: the paired kinds (``kind = "kto"``
        is :class:`~pgs.runtime.loop.kto.KTOObjective`'s)."""
        return getattr(spec.preference, "kind", None) != "kto"

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_for(self.stream.rows_per_epoch(), batch_size)

    def prepare(self, run, batches: list) -> tuple[list, dict]:
        return batches, {}

    def count(self, batches: Sequence[PreferenceBatch]) -> int:
        return sum(b.num_pairs for b in batches)

    def loss(self, chosen, rejected, lengths, ref):
        p = self.pref
        ref_c, ref_r = (ref[:, 0], ref[:, 1]) if ref is not None else (None, None)
        return preference_loss(chosen, rejected, ref_c, ref_r, kind=p.kind, beta=p.beta,
                               label_smoothing=p.label_smoothing, gamma=p.gamma, lam=p.lam, nll_weight=p.nll_weight,
                               chosen_lengths=lengths[:, 0], rejected_lengths=lengths[:, 1])

    def forward(self, run, batch: PreferenceBatch, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ pair losses with its graph, detached sums [len(STAT_KEYS)])`` of one micro-batch."""
        chunk = self.spec.loss.chunk_size
        device = run.device
        noise = embedding_noise_hook(self.spec, self._generators, batch, device)
        logps, lengths, head_grad = pair_logps(run.model, batch, device, chunk, embed_noise=noise,
                                               memory_for=lambda w: loss_memory(run, self.defers_head_grad(run, w)))
        if head_grad is not None:  # joins the embedding's gradient in the tied weight's hook (filled by backward)
            run.bound.before_step(output_head(run.model)[0], head_grad)
        ref = self.reference.logps(batch, device, chunk)
        out = self.batch_loss(logps, lengths, ref, batch)
        loss_sum = out.loss.sum()
        if poison:
            loss_sum = loss_sum * float("nan")
        return loss_sum, self.sums(out, logps.detach())

    def batch_loss(self, logps: torch.Tensor, lengths: torch.Tensor, ref, batch: PreferenceBatch):
        """The per-pair losses of a micro-batch from its ``[P, 2]`` log-probs, lengths and reference."""
        return self.loss(logps[:, 0], logps[:, 1], lengths, ref)

    def defers_head_grad(self, run, weight) -> bool:
        """As SFT's (``objective.tied_head_deferrable``: gradient release on one process, a tied
        trainable head, ``memory.defer_head_grad``): the sequence log-probs' backward leaves the
        head's gradient to a ``DeferredHeadGrad``, added into the embedding's gradient right
        before that weight steps (slab by slab with ``tied_slabs``: no V×D gradient at all)."""
        return tied_head_deferrable(run, weight)

    @staticmethod
    def sums(out, logps: torch.Tensor) -> torch.Tensor:
        c, r = out.chosen_rewards.detach(), out.rejected_rewards.detach()
        return torch.stack([c.sum(), r.sum(), out.accuracy.sum(), logps[:, 0].sum(), logps[:, 1].sum()]).float()

    def step_metrics(self, stats: list[float], count: int, valid_tokens: int, extra: dict) -> dict:
        return {**step_values(stats, count), **extra}

    def after_step(self, run, record: dict) -> None:
        pass

    def evaluate(self, run) -> dict:
        """With several processes every rank scores every held-out pair (the same batches, so the
        sharded model's gathers match) and gets the same numbers; rank 0 logs them."""
        return self.evaluate_pairs(run.model, run.tokenizer, run.device)

    @torch.no_grad()
    def evaluate_pairs(self, model, tokenizer, device: torch.device) -> dict:
        """Held-out pairs: loss, preference accuracy (rewards of the chosen arm above the
        rejected one's; ties count half), reward margin and mean log-probs of both arms."""
        if not self.eval_pairs:
            return {}
        chunk = self.spec.loss.chunk_size
        total = torch.zeros(len(STAT_KEYS) + 1, dtype=torch.float64)
        was_training = model.training
        model.eval()
        try:
            for batch in eval_batches(self.eval_pairs, tokenizer, self.spec.data):
                logps, lengths = pair_logps(model, batch, device, chunk)
                ref = self.reference.logps(batch, device, chunk, split="eval")
                out = self.loss(logps[:, 0], logps[:, 1], lengths, ref)
                total[0] += float(out.loss.sum())
                total[1:] += self.sums(out, logps).double().cpu()
        finally:
            model.train(was_training)
        n = len(self.eval_pairs)
        means = dict(zip(STAT_KEYS, (float(v) / n for v in total[1:])))
        return {"eval_preference_loss": float(total[0]) / n,
                "eval_preference_accuracy": means["preference_accuracy"],
                "eval_reward_margin": means["reward_chosen"] - means["reward_rejected"],
                "eval_logp_chosen": means["logp_chosen"], "eval_logp_rejected": means["logp_rejected"],
                "eval_pairs": n}

    def state_dict(self) -> dict:
        """The reference the run trains against: its mode and the cache's key (None unless cached)."""
        return {"reference": self.reference.mode, "key": self.reference.key}

    def load_state_dict(self, state: dict | None) -> None:
        """Refuse to continue a checkpoint against another reference than the one it trained with."""
        if not state:
            return
        saved = (state.get("reference"), state.get("key"))
        if saved != (self.reference.mode, self.reference.key):
            raise cache.StaleReference(
                f"the checkpoint trained against the {saved[0]} reference{_key_text(saved[1])}, this run has the "
                f"{self.reference.mode} reference{_key_text(self.reference.key)} (preference.reference, the model "
                "or the data changed); continue with the same settings, or start a new run (--overwrite)")

    def generators(self) -> dict[str, torch.Generator]:
        return self._generators


def _key_text(key: str | None) -> str:
    return f" (cache key {key})" if key else ""


def read_eval_pairs(spec, tokenizer) -> list[Pair]:
    """The held-out pairs of ``data.eval`` (none without one)."""
    if not spec.data.eval:
        return []
    return read_pairs([spec.data.eval], tokenizer, spec.data)


def step_values(sums: Sequence[float], pairs: int) -> dict:
    """The metrics of a step from its summed stats (plain numbers)."""
    n = max(pairs, 1)
    means = {k: float(v) / n for k, v in zip(STAT_KEYS, sums)}
    means["reward_margin"] = means["reward_chosen"] - means["reward_rejected"]
    means["pairs"] = pairs
    return means


__all__ = ["PreferenceObjective", "Reference", "pair_logps", "prepare_reference", "read_eval_pairs", "score_pairs",
           "step_values"]
