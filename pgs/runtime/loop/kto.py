"""The objective of a ``[preference]`` run with ``kind = "kto"`` (docs/techniques/kto.md).

KTO (Ethayarajh et al., arXiv 2402.01306) trains on unpaired records, each a prompt, one
completion and a desirable/undesirable label (``pgs.runtime.data.kto``).  Everything but the
loss is ``[preference]``'s (:class:`~pgs.runtime.loop.preference.PreferenceObjective`): each
record travels as a pair of documents in one row — its completion, and the mismatched
completion of its KL sample — so the stream, the packing, the cached (or live) reference, the
head-gradient deferral, the several-process path and the control plane are the same code.

A micro-batch's loss: the policy's summed log-probs of both documents of every record in one
forward; the reference point z_ref = max(0, mean over the micro-batch's records of the KL
sample's log-ratio), detached (``pgs.func.losses.kto_reference_point``: the paper's estimate
over the micro-batch); ``pgs.func.losses.kto_loss`` of each record's own log-ratio, summed.  The
step divides by its number of records.  z_ref is this process's micro-batch's, as the paper
and TRL's per-device estimate have it: with several processes each rank's micro-batches are the
ones one process with ``grad_accum`` × ranks micro-batches trains, so the runs agree.

Evaluation estimates z_ref once over all held-out records.  Its accuracy counts a record right
when its reward is on its label's side of β·z_ref (ties half: 0.5 at step 0, where the policy is
the reference); ``eval_reward_margin`` is the mean reward of the desirable completions minus
that of the undesirable ones.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import attrs
import torch

from pgs.func.losses import (RECOMMENDED_RATIO, kto_accuracy, kto_loss, kto_reference_point,
                             kto_weight_ratio)
from pgs.runtime.data.kto import label_counts, read_kto_records
from pgs.runtime.data.preference import PreferenceBatch, PreferenceStream, eval_batches
from pgs.runtime.loop.objective_common import rank_and_world
from pgs.runtime.loop.preference import PreferenceObjective, pair_logps, prepare_reference

#: The per-step sums the objective reports, in the order of its stats tensor.
STAT_KEYS = ("reward_desirable", "reward_undesirable", "desirable", "undesirable", "preference_accuracy",
             "logp_desirable", "logp_undesirable", "kl")


def ratio_warning(pref, desirable: int, undesirable: int) -> str | None:
    """The paper's weighting advice when λ_D·n_D / (λ_U·n_U) is outside [1, 4/3], else None."""
    ratio = kto_weight_ratio(desirable, undesirable, pref.desirable_weight, pref.undesirable_weight)
    low, high = RECOMMENDED_RATIO
    if low <= ratio <= high:
        return None
    if desirable == 0 or undesirable == 0:
        return (f"the KTO data has {desirable} desirable and {undesirable} undesirable records: only one side of the "
                "loss trains")
    # the undesirable weight that brings the ratio to the middle of the range (the paper's advice: adjust λ)
    fit = pref.desirable_weight * desirable / (undesirable * (low + high) / 2)
    return (f"preference.desirable_weight · {desirable} desirable / (preference.undesirable_weight · {undesirable} "
            f"undesirable) = {ratio:.3g}, outside the [1, 4/3] the KTO paper recommends (arXiv 2402.01306); e.g. "
            f"undesirable_weight = {fit:.3g}")


class KTOObjective(PreferenceObjective):
    """``[preference]`` with ``kind = "kto"`` (module docstring)."""

    stat_keys = STAT_KEYS
    console_keys = ("reward_desirable", "reward_undesirable", "kl", "preference_accuracy")

    @classmethod
    def selects(cls, spec) -> bool:
        return getattr(spec.preference, "kind", None) == "kto"

    @classmethod
    def create(cls, spec, *, model, tokenizer, device: torch.device, ctx=None) -> "KTOObjective":
        """The records are read and tokenized once (each with its KL sample); the reference
        scores both documents of every record with the initial weights."""
        rank, world = rank_and_world(ctx)
        stream = PreferenceStream(spec.data, tokenizer, rank=rank, world_size=world, read=read_kto_records)
        eval_pairs = read_kto_records([spec.data.eval], tokenizer, spec.data) if spec.data.eval else []
        warning = ratio_warning(spec.preference, *label_counts(stream.pairs))
        if warning and rank == 0:
            print(f"pgs: warning: {warning}", file=sys.stderr, flush=True)
        os.makedirs(spec.checkpoint.dir, exist_ok=True)
        reference = prepare_reference(spec, model, tokenizer, device, stream.pairs, eval_pairs)
        return cls(spec, reference, eval_pairs, stream=stream, device=device)

    @classmethod
    def for_profile(cls, spec, *, model, tokenizer, device: torch.device, rows: int, seq_len: int,
                    generator: torch.Generator):
        """``[preference]``'s measured step (a record and its KL sample are a pair's two
        documents), the records labelled desirable and undesirable in turn."""
        objective, batches = super().for_profile(spec, model=model, tokenizer=tokenizer, device=device, rows=rows,
                                                 seq_len=seq_len, generator=generator)
        labelled = [attrs.evolve(b, desirable=torch.arange(b.num_pairs) % 2 == 0) for b in batches]
        return objective, labelled

    def kto(self, logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor):
        """``kto_loss`` of records with ``[P, 2]`` log-probs and reference log-probs (column 0: the
        record's completion, 1: its KL sample), z_ref estimated over these records."""
        p = self.pref
        z = kto_reference_point(logps[:, 1], ref[:, 1])
        return kto_loss(logps[:, 0], ref[:, 0], desirable.to(logps.device), z, beta=p.beta,
                        desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)

    def batch_loss(self, logps: torch.Tensor, lengths: torch.Tensor, ref, batch: PreferenceBatch):
        return self.kto(logps, ref, batch.desirable)

    def sums(self, out, logps: torch.Tensor) -> torch.Tensor:
        good = out.desirable.to(out.rewards.device)
        bad = ~good
        rewards, own = out.rewards.detach(), logps[:, 0].detach().to(out.rewards.dtype)
        n = float(good.numel())
        return torch.stack([rewards[good].sum(), rewards[bad].sum(), good.sum().to(rewards.dtype),
                            bad.sum().to(rewards.dtype), kto_accuracy(out, self.pref.beta).sum(), own[good].sum(),
                            own[bad].sum(), out.reference_point.to(rewards.dtype) * n]).float()

    def step_metrics(self, stats: list[float], count: int, valid_tokens: int, extra: dict) -> dict:
        return {**kto_values(stats, count), **extra}

    @torch.no_grad()
    def evaluate_pairs(self, model, tokenizer, device: torch.device) -> dict:
        """Held-out records: the loss with z_ref estimated over all of them, the accuracy, the
        mean rewards and log-probs of each label, their margin, and z_ref."""
        if not self.eval_pairs:
            return {}
        chunk = self.spec.loss.chunk_size
        n = len(self.eval_pairs)
        logps, ref = torch.zeros(n, 2, dtype=torch.float64), torch.zeros(n, 2, dtype=torch.float64)
        desirable = torch.zeros(n, dtype=torch.bool)
        was_training = model.training
        model.eval()
        try:
            for batch in eval_batches(self.eval_pairs, tokenizer, self.spec.data):
                ids = batch.pair_ids
                logps[ids] = pair_logps(model, batch, device, chunk)[0].double().cpu()
                ref[ids] = self.reference.logps(batch, device, chunk, split="eval").double().cpu()
                desirable[ids] = batch.desirable
        finally:
            model.train(was_training)
        out = self.kto(logps, ref, desirable)
        values = kto_values(self.sums(out, logps).tolist(), n)
        record = {"eval_preference_loss": float(out.loss.mean()),
                  "eval_preference_accuracy": values["preference_accuracy"], "eval_kl": float(out.reference_point),
                  "eval_records": n}
        for key in ("reward_margin", "reward_desirable", "reward_undesirable", "logp_desirable", "logp_undesirable"):
            if key in values:
                record[f"eval_{key}"] = values[key]
        return record


def kto_values(sums: Sequence[float], records: int) -> dict:
    """The metrics of a step (or of the held-out records) from their summed stats: each label's
    mean reward and log-prob (a label with no record in the step has none), their margin, the
    accuracy, the record-weighted mean z_ref (``kl``) and the counts."""
    s = dict(zip(STAT_KEYS, (float(v) for v in sums)))
    n = max(records, 1)
    out = {"preference_accuracy": s["preference_accuracy"] / n, "kl": s["kl"] / n, "records": records,
           "desirable": int(round(s["desirable"])), "undesirable": int(round(s["undesirable"]))}
    for side in ("desirable", "undesirable"):
        if s[side] > 0:
            out[f"reward_{side}"] = s[f"reward_{side}"] / s[side]
            out[f"logp_{side}"] = s[f"logp_{side}"] / s[side]
    if "reward_desirable" in out and "reward_undesirable" in out:
        out["reward_margin"] = out["reward_desirable"] - out["reward_undesirable"]
    return out


__all__ = ["KTOObjective", "kto_values", "ratio_warning"]
