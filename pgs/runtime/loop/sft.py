"""Supervised fine-tuning: the default objective of ``pgs run`` (no objective section in the spec).

The loss of a micro-batch is the summed token loss of its trained tokens
(``pgs.func.losses.token_loss``: the ``[loss]`` objective, backend and chunking, never the full
``[N, V]`` logits with the chunked backend), and the step divides by the step's valid-token
count, so the step's gradient is that of one token mean over all its micro-batches (a
micro-batch whose labels are all masked adds 0, not 0/0).  NEFTune noise
(``loss.neftune_alpha``) is added to the embeddings with its own generator, which the
checkpoint keeps.  The record carries the mean next-token entropy, and a warning is logged when
it falls under ``train.entropy_warn``.  Eval: the token loss on ``data.eval`` and, where a
checker knows the records (the quickstart's tasks), task accuracy by greedy generation.

``memory.seco_chunk``: each micro-batch's rows are trained chunk-wise (SeCO/SpaCO,
``pgs.runtime.model.seco``): the loss of chunk c is the token loss of its own tokens, and the
step divides the row's summed loss by the valid-token count as ever, so the gradient is the
whole row's (SpaCO: an unbiased estimate of it).

With gradient release on one process and a tied head, the head's gradient can skip autograd:
it is added into the embedding's own gradient buffer right before that weight steps
(:meth:`SFTObjective.defers_head_grad`, ``memory.defer_head_grad``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pgs.func.losses import token_loss
from pgs.runtime.data import EvalStream, TrainStream
from pgs.runtime.data.inspect import dataset_stats
from pgs.runtime.dist import context as CP
from pgs.runtime.documents import document_ids
from pgs.runtime.loop.evaluate import eval_loss, read_samples, sharded_eval_loss, task_accuracy, task_checker
from pgs.runtime.data.packing import collate, pad_id
from pgs.errors import SpecError
from pgs.runtime.model import seco
from pgs.runtime.loop.objective_common import (embedding_noise_generator, embedding_noise_hook, random_document,
                                        loss_memory, rank_and_world, steps_for, tied_head_deferrable)
from pgs.runtime.model.build import final_hidden, output_head

#: Eval records answered by greedy generation when the eval data has a known checker (the
#: quickstart ships 200, all of them scored).
ACCURACY_SAMPLES = 200


class SFTObjective:
    """Token loss over the trained tokens of packed conversations (see the module docstring)."""

    name = "sft"
    section = None
    stat_keys = ("entropy",)
    console_keys = ("entropy",)
    loader_ahead = None
    router_tap = True
    splits_rows = True  # a token loss: each rank sums its own part of a row
    whole_rows_reason = ""

    def __init__(self, spec, tokenizer, device: torch.device, stream):
        self.spec = spec
        self.tokenizer = tokenizer
        self.stream = stream
        self.token_objective = spec.build_token_loss()  # the [loss] objective (pgs.func.losses)
        self._generators = embedding_noise_generator(spec, device)
        if spec.memory.spaco_keep < 1.0:  # which chunks' backwards run (checkpointed with the run)
            self._generators["spaco"] = torch.Generator().manual_seed(spec.train.seed)
        self.entropy_low = False

    @classmethod
    def create(cls, spec, *, model, tokenizer, device: torch.device, ctx=None) -> "SFTObjective":
        rank, world = rank_and_world(ctx, spec.parallel.context)
        if spec.memory.seco_chunk:
            check_chunkwise(spec, model, ctx)
        return cls(spec, tokenizer, device, TrainStream(spec.data, tokenizer, rank=rank, world_size=world))

    @classmethod
    def for_profile(cls, spec, *, model, tokenizer, device: torch.device, rows: int, seq_len: int,
                    generator: torch.Generator) -> tuple["SFTObjective", list]:
        """``pgs profile --measure``'s SFT step: ``rows`` rows of one ``seq_len``-token document
        each, every token trained (a full packed row, the step's largest token loss)."""
        vocab = model.get_input_embeddings().num_embeddings
        docs = [[random_document(seq_len, 0, vocab, generator)] for _ in range(rows)]
        return cls(spec, tokenizer, device, None), [collate(docs, pad_id(tokenizer, 0), seq_len)]

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_for(dataset_stats(self.spec.data, self.tokenizer).sequences, batch_size)

    def prepare(self, run, batches: list) -> tuple[list, dict]:
        return batches, {}

    def count(self, batches: Sequence) -> int:
        return sum(b.num_trained_tokens for b in batches)

    def forward(self, run, batch, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss with its graph, and ``[entropy sum]``.  Nothing here reads a device
        value on the host: the entropy stays on the device until the step's record is read."""
        dev = run.device
        ids, pos, labels = batch.input_ids.to(dev), batch.position_ids.to(dev), batch.labels.to(dev)
        if run.moe is not None:
            run.moe.begin_micro(batch, dev)
        if self.spec.memory.seco_chunk:
            return self._chunkwise(run, ids, pos, labels, poison)
        CP.begin_rows(batch, run.context, dev)  # a row split over ranks: ring attention (until end_rows)
        h = final_hidden(run.model, ids, pos, embed_noise=embedding_noise_hook(self.spec, self._generators, batch, dev))
        aux = run.moe.end_micro() if run.moe is not None else None
        weight, bias, softcap = output_head(run.model)
        loss = self.spec.loss
        defer = self.defers_head_grad(run, weight)
        docs = document_ids(pos) if self.token_objective.name == "cadft" else None  # CADFT's per-sample compatibility
        result = token_loss(h, weight, labels, backend=loss.backend, objective=self.token_objective, bias=bias,
                            softcap=softcap, z_loss=loss.z_loss, chunk_size=loss.chunk_size,
                            memory=loss_memory(run, defer), doc_ids=docs)
        if defer and result.head_grad is not None:  # joins the embedding's gradient in the tied weight's hook
            run.bound.before_step(weight, result.head_grad)
        loss_sum = result.loss_sum * float("nan") if poison else result.loss_sum
        if aux is not None:  # the router losses join the gradient, not the value (a NaN one shows as NaN)
            loss_sum = loss_sum + (aux - aux.detach())
        entropy = result.entropy_sum.detach() if result.entropy_sum is not None else torch.zeros((), device=h.device)
        return loss_sum, entropy.reshape(1).float()

    def _chunkwise(self, run, ids, pos, labels, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for ``memory.seco_chunk``: the rows' summed token loss, computed chunk by
        chunk without autograd; its backward is SeCO's reverse sweep (SpaCO's with
        ``memory.spaco_keep`` < 1).  Gradient release holds its steps through the sweep and steps
        every group once, with the accumulated gradients, when the row's backward ends."""
        weight, bias, softcap = output_head(run.model)
        loss = self.spec.loss

        def chunk_loss(h, lo, hi):
            r = token_loss(h, weight, labels[:, lo:hi], backend=loss.backend, objective=self.token_objective,
                           bias=bias, softcap=softcap, z_loss=loss.z_loss, chunk_size=loss.chunk_size)
            e = r.entropy_sum.detach() if r.entropy_sum is not None else torch.zeros((), device=h.device)
            return r.loss_sum, e.reshape(1).float()

        mem = self.spec.memory
        hold = run.bound.accumulating if run.bound.in_backward else None
        row = seco.ChunkedRow(run.model, ids, pos, mem.seco_chunk, chunk_loss, keep=mem.spaco_keep,
                              generator=self._generators.get("spaco"), hold=hold)
        loss_sum, entropy = row.forward()
        return (loss_sum * float("nan") if poison else loss_sum), entropy

    def defers_head_grad(self, run, weight) -> bool:
        """Gradient release on one process, a tied head (the input embedding's weight),
        ``memory.defer_head_grad`` (``"auto"``: with checkpointing or slabs;
        ``objective.tied_head_deferrable``) and the chunked loss: the head's gradient is added
        into the embedding's own gradient buffer right before that weight steps (one V×D buffer,
        only at the end of backward; none with tied slabs)."""
        return self.spec.loss.backend == "chunked" and tied_head_deferrable(run, weight)

    def step_metrics(self, stats: list[float], count: int, valid_tokens: int, extra: dict) -> dict:
        return {"entropy": stats[0] / max(valid_tokens, 1), **extra}

    def after_step(self, run, record: dict) -> None:
        """Warn once each time the mean next-token entropy falls under ``train.entropy_warn``."""
        threshold = self.spec.train.entropy_warn
        if record.get("skipped") or not threshold or "entropy" not in record:
            return
        low = record["entropy"] < threshold
        if low and not self.entropy_low:
            run.log.say(f"pgs: warning: mean next-token entropy {record['entropy']:.3f} fell under "
                        f"train.entropy_warn = {threshold} at step {run.step} (collapse?)")
            run.log.write({"step": run.step, "event": "entropy_low", "entropy": record["entropy"]})
        self.entropy_low = low

    def evaluate(self, run) -> dict:
        """Eval loss, and task accuracy where a checker knows the data.  Several processes: each
        rank its share of the eval batches and of the generated replies, results reduced (the
        same record on every rank)."""
        spec = self.spec
        if run.ctx is not None:  # every rank, the same number of forwards
            out = sharded_eval_loss(run)
        else:
            out = eval_loss(run.model, EvalStream(spec.data, run.tokenizer, max(1, run.micro_batch)),
                            backend="chunked", chunk_size=spec.loss.chunk_size)
        samples = read_samples(spec.data.eval, ACCURACY_SAMPLES)
        checker = task_checker(samples)
        if checker is not None:
            turns, matches = checker
            ranks = (run.ctx.rank, run.ctx.world_size) if run.ctx is not None else None
            out.update(task_accuracy(run.model, run.tokenizer, samples, turns=turns, matches=matches, ranks=ranks))
        return out

    def state_dict(self) -> dict:
        return {"entropy_low": self.entropy_low}

    def load_state_dict(self, state: dict | None) -> None:
        self.entropy_low = bool((state or {}).get("entropy_low", False))

    def generators(self) -> dict[str, torch.Generator]:
        return self._generators


def check_chunkwise(spec, model, ctx) -> None:
    """``memory.seco_chunk`` against the model and the process layout (one line each)."""
    if ctx is not None and ctx.world_size > 1:
        raise SpecError(f"memory.seco_chunk: chunk-wise training runs on one process; this run has "
                        f"{ctx.world_size}; set memory.seco_chunk = 0 or run with --nproc 1")
    why = seco.refusal(getattr(model, "config", None))
    if why:
        raise SpecError(f"memory.seco_chunk: the model cannot be trained chunk-wise: {why}; set memory.seco_chunk = 0")


__all__ = ["ACCURACY_SAMPLES", "SFTObjective"]
