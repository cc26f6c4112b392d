"""The distillation objective of a run with ``[distill]`` (docs/techniques/distillation.md).

On-policy distillation (GKD, Agarwal et al., arXiv 2306.13649): a frozen teacher grades every
token of a completion with its whole next-token distribution, and the student is trained to
match it (``pgs.func.losses.distill_loss``: forward KL, reverse KL or JSD(β), chunked over the
vocabulary).  The completions are, with probability λ (``distill.on_policy``) per step, sampled
by the student itself from the prompts (``pgs.runtime.model.generate``), else the data's own.

The data is the SFT stream (packed chat records).  A document's *completion* is its last run
of trained tokens (the last assistant turn with its end-of-turn token) and its *prompt*
everything before it, which ends with the assistant header the generation prompt renders.  An
off-policy step trains on the documents as they are (every trained token, as SFT would); an
on-policy step replaces each document by its prompt followed by the student's sample (at most
``max_seq_len`` tokens), repacks the micro-batch, and trains on the sampled tokens.  The
teacher (bf16 by default, no gradients) scores the same packed tokens; the loss is summed over
the completion tokens and the step divides by their number (a token mean).

Randomness: the λ coin is a CPU generator and the sampler a generator on the device, both
seeded by ``train.seed`` and saved with every checkpoint (``generators``), so a resumed run
draws the same coins and the same samples as an uninterrupted one.

Several processes (FSDP2, ``pgs run --nproc N``; docs/distributed.md, *Distillation*).  Each
rank reads its rows of every global batch (``TrainStream(rank=, world_size=)``) and samples the
completions of its own prompts, and the result is one process's with the same ``batch_size``:

- *The same coin*: every rank holds the coin generator with the same seed and draws once a
  step, so all ranks take the same on-policy or off-policy step.
- *The same samples*: the step's prompts have one global order, one process's (micro-batch by
  micro-batch, rank by rank within a micro-batch: the order of the rows in the global batch),
  made known to every rank by one gather of the prompt lengths.  Every rank holds the sampler
  generator with the same seed and, at each decode step, draws the race of the whole global
  batch and keeps its own prompts' rows of it (``pgs.runtime.model.generate.Share``), pads its
  prompts to the global batch's longest, and decodes until every rank's completions have
  stopped.  So each prompt meets the same random numbers as on one process, whatever the split
  over ranks, and the generators advance alike on every rank (each rank saves its own in the
  checkpoint, and a resume at the same world size restores them).  What is left is the
  forward's summation order, which the number of rows in a batch may change: a sample differs
  from one process's only where two tokens tie to the last bits.
- *The same loss*: each rank repacks its own micro-batches, as one process repacks the same
  micro-batches; the step divides by the global count of completion tokens (the loop's
  ``global_counts`` of ``count``), so the summed gradients are one process's.
- *The teacher* is sharded: its decoder layers with FSDP2 (``fully_shard``, each layer
  gathered for its forward and freed after it, ``pgs.runtime.dist.fsdp.shard_frozen``), its
  embeddings, final norm and head whole on every rank (the loss applies the head outside the
  model's forward, chunk by chunk, as for the student).  Replicating it would keep all its
  weights on every device; a teacher is usually the larger model of the two, and the run is
  sharded because the student's training state does not fit one device.  The price is one
  all-gather of each teacher layer per micro-batch (no backward, no reduce-scatter; a student
  layer takes two all-gathers and a reduce-scatter).
- *Eval*: each rank its share of the eval loss (as SFT), and every rank the same held-out
  divergence over all ``eval_prompts`` records; task accuracy by generation is measured on one
  process only, as SFT's.

Metrics: per step ``on_policy`` (1 or 0; its mean is the on-policy share), ``generated_tokens``
and ``gen_tokens_per_s`` (0 off-policy), and ``tokens_per_s`` from the loop; at eval the mean
teacher–student KL(T‖S) and the configured divergence per completion token on the first
``distill.eval_prompts`` held-out records (``eval_distill_kl``, ``eval_distill_loss``), the
student's eval loss and, where a checker knows the records, its task accuracy and the
teacher's (``eval_teacher_accuracy``, measured once).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from pgs.func.losses import distill_loss
from pgs.runtime.data import EvalStream, TrainStream
from pgs.runtime.data.chat import turn_markers
from pgs.runtime.data.inspect import dataset_stats
from pgs.runtime.data.packing import Document, PackedBatch, best_fit_decreasing, collate, pad_id
from pgs.runtime.dist import fsdp as D
from pgs.runtime.loop.evaluate import eval_loss, read_samples, task_accuracy, task_checker
from pgs.runtime.loop.objective_common import random_document, rank_and_world, steps_for
from pgs.runtime.loop.evaluate import sharded_eval_loss
from pgs.runtime.model.build import build_model, final_hidden, output_head
from pgs.runtime.model.generate import GenerationSettings, Share, generate

#: Eval records answered by greedy generation when the eval data has a known checker (as SFT).
ACCURACY_SAMPLES = 200


def split_documents(batch: PackedBatch) -> list[tuple[list[int], list[int], list[bool]]]:
    """Each document of a packed batch as ``(prompt ids, completion ids, trained mask of the whole
    document)``: the completion is the document's last run of trained tokens, the prompt what
    precedes it (tokens after the run are dropped).  Documents without a trained token are skipped."""
    ids = batch.input_ids.cpu().tolist()
    labels = batch.labels.cpu().tolist()
    out = []
    for r, bounds in enumerate(batch.cu_seqlens):
        edges = bounds.tolist()
        for a, b in zip(edges[:-1], edges[1:]):
            doc = ids[r][a:b]
            # token k (k ≥ 1) of the document is trained when the label at k − 1 is not −100
            trained = [False] + [labels[r][a + k - 1] != -100 for k in range(1, b - a)]
            if not any(trained):
                continue
            end = max(k for k, t in enumerate(trained) if t) + 1
            start = end
            while start > 1 and trained[start - 1]:
                start -= 1
            out.append((doc[:start], doc[start:end], trained))
    return out


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a sampled turn: eos and the chat template's end-of-turn marker when it
    is one token (``<|im_end|>`` for ChatML templates)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        _, end = turn_markers(tokenizer)
        pieces = tokenizer(end.strip(), add_special_tokens=False)["input_ids"]
        if len(pieces) == 1:
            ids.add(int(pieces[0]))
    except Exception:  # a template without readable markers: eos alone ends a turn
        pass
    return sorted(ids)


class DistillObjective:
    """The :class:`~pgs.runtime.loop.objective.Objective` of ``[distill]`` runs (module docstring)."""

    name = "distill"
    section = "distill"
    stat_keys = ()
    console_keys = ("on_policy", "gen_tokens_per_s")
    loader_ahead = None
    router_tap = False  # the student's forward here does not feed a MoE router tap (no router losses or statistics)
    splits_rows = False  # the student samples from whole prompts
    whole_rows_reason = ("the student samples its completions from whole prompts through a KV cache and the teacher "
                         "scores whole rows, while ring attention serves only the student's training forward over "
                         "a split row")

    def __init__(self, spec, tokenizer, teacher, device: torch.device, stream):
        self.spec = spec
        self.d = spec.distill
        self.tokenizer = tokenizer
        self.teacher = teacher
        self.device = device
        self.stream = stream
        self.settings = GenerationSettings(**self.d.generation_settings())
        self.stops = stop_ids(tokenizer)
        self.pad_id = pad_id(tokenizer)
        self._generators = {
            "distill_coin": torch.Generator().manual_seed(spec.train.seed),
            "distill_sampler": torch.Generator(device=device).manual_seed(spec.train.seed + 1),
        }
        self.steps = 0
        self.on_policy_steps = 0
        self.teacher_accuracy: dict | None = None
        # pgs profile --measure: every step on-policy when λ > 0 (generation is the heavier step)
        self.sample_every_step = False

    @classmethod
    def create(cls, spec, *, model, tokenizer, device: torch.device, ctx=None) -> "DistillObjective":
        rank, world = rank_and_world(ctx)
        teacher = load_teacher(spec, tokenizer, device)
        if world > 1:  # its layers sharded, its head whole (module docstring)
            D.shard_frozen(teacher, ctx.mesh)
        return cls(spec, tokenizer, teacher, device, TrainStream(spec.data, tokenizer, rank=rank, world_size=world))

    @classmethod
    def for_profile(cls, spec, *, model, tokenizer, device: torch.device, rows: int, seq_len: int,
                    generator: torch.Generator) -> tuple["DistillObjective", list]:
        """``pgs profile --measure``'s distillation step: the teacher as ``create`` loads it, and
        ``rows`` rows of one document each, a prompt of ``seq_len − max_new_tokens`` random tokens
        (at least one) and a trained completion of the rest.  With ``distill.on_policy`` > 0 every
        profiled step is on-policy: ``prepare`` samples the completions from the prompts."""
        objective = cls(spec, tokenizer, load_teacher(spec, tokenizer, device), device, None)
        objective.sample_every_step = spec.distill.on_policy > 0
        vocab = model.get_input_embeddings().num_embeddings
        prompt = max(1, seq_len - int(objective.settings.max_new_tokens))
        docs = [random_document(max(seq_len, prompt + 1), prompt, vocab, generator) for _ in range(rows)]
        return objective, [collate([[d] for d in docs], objective.pad_id, seq_len)]

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_for(dataset_stats(self.spec.data, self.tokenizer).sequences, batch_size)

    # -- a step -----------------------------------------------------------------------------
    def prepare(self, run, batches: list) -> tuple[list, dict]:
        """With probability λ, the step's completions sampled by the student (module docstring)."""
        on = bool(torch.rand((), generator=self._generators["distill_coin"]) < self.d.on_policy)
        on = on or self.sample_every_step
        self.steps += 1
        if not on:
            return batches, {"on_policy": 0.0, "generated_tokens": 0, "gen_tokens_per_s": 0.0}
        self.on_policy_steps += 1
        parts = [split_documents(b) for b in batches]
        prompts = [p for part in parts for p, _, _ in part]
        sharded = getattr(run, "ctx", None) is not None
        # sharded: FSDP's all-gathers run inside each decode step, which is then neither compiled nor
        # captured as a CUDA graph (compile=False; eager steps, the static cache on CUDA as usual)
        out = generate(run.model, prompts, self.settings, stop_ids=self.stops, pad_id=self.pad_id,
                       generator=self._generators["distill_sampler"], share=global_share(parts) if sharded else None,
                       compile=False if sharded else None)
        generated = D.global_count(out.generated_tokens) if sharded else out.generated_tokens
        samples = iter(out.completions())
        limit = self.spec.data.max_seq_len
        rebuilt = []
        for part in parts:
            docs = []
            for prompt, _, _ in part:
                completion = next(samples)[: max(0, limit - len(prompt))]
                docs.append(Document(tuple(prompt + completion), (False,) * len(prompt) + (True,) * len(completion)))
            rebuilt.append(self._collate(docs, run.device))
        seconds = out.seconds
        return rebuilt, {"on_policy": 1.0, "generated_tokens": generated,
                         "gen_tokens_per_s": generated / seconds if seconds > 0 else 0.0}

    def _collate(self, docs: list[Document], device: torch.device) -> PackedBatch:
        if self.spec.data.packing:
            bins = best_fit_decreasing([len(d) for d in docs], self.spec.data.max_seq_len)
            rows = [[docs[i] for i in b] for b in bins]
        else:
            rows = [[d] for d in docs]
        b = collate(rows or [[]], self.pad_id)
        return PackedBatch(b.input_ids.to(device), b.labels.to(device), b.position_ids.to(device), b.cu_seqlens,
                           b.num_docs, b.num_trained_tokens, b.num_tokens)

    def count(self, batches: Sequence) -> int:
        return sum(b.num_trained_tokens for b in batches)

    def _divergence(self, model, h, labels, teacher_h, *, kind=None):
        """``distill_loss`` of the student ``model``'s hidden states against the teacher's."""
        weight, bias, softcap = output_head(model)
        t_weight, t_bias, t_softcap = output_head(self.teacher)
        d = self.d
        return distill_loss(h, weight, teacher_h, t_weight, labels != -100, kind=kind or d.kind, beta=d.jsd_beta,
                            temperature=d.temperature, chunk_size=self.spec.loss.chunk_size, student_bias=bias,
                            teacher_bias=t_bias, student_softcap=softcap, teacher_softcap=t_softcap)

    @torch.no_grad()
    def teacher_hidden(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return final_hidden(self.teacher, ids, pos)

    def forward(self, run, batch, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ over the batch's completion tokens of the divergence, with the student's graph."""
        dev = run.device
        ids, pos, labels = batch.input_ids.to(dev), batch.position_ids.to(dev), batch.labels.to(dev)
        h = final_hidden(run.model, ids, pos)
        out = self._divergence(run.model, h, labels, self.teacher_hidden(ids, pos))
        loss_sum = out.loss_sum * float("nan") if poison else out.loss_sum
        return loss_sum, torch.zeros(0, device=h.device)

    def defers_head_grad(self, run, weight) -> bool:
        return False  # the divergence hands the head's gradient to autograd

    def step_metrics(self, stats: list[float], count: int, valid_tokens: int, extra: dict) -> dict:
        return dict(extra)

    def after_step(self, run, record: dict) -> None:
        pass

    # -- eval -------------------------------------------------------------------------------
    @torch.no_grad()
    def held_out_divergence(self, model) -> dict:
        """Mean KL(T‖S) and the configured divergence per completion token on the first
        ``distill.eval_prompts`` held-out records (their own completions: no sampling)."""
        n = self.d.eval_prompts
        if not self.spec.data.eval or n == 0:
            return {}
        docs = list(itertools.islice(EvalStream(self.spec.data, self.tokenizer, 1).documents(), n))
        if not docs:
            return {}
        was_training = model.training
        model.eval()
        kl = loss = 0.0
        tokens = 0
        try:
            for start in range(0, len(docs), 16):
                b = collate([[d] for d in docs[start:start + 16]], self.pad_id)
                ids, pos, labels = b.input_ids.to(self.device), b.position_ids.to(self.device), b.labels.to(self.device)
                h = final_hidden(model, ids, pos)
                th = self.teacher_hidden(ids, pos)
                kl += float(self._divergence(model, h, labels, th, kind="forward_kl").loss_sum)
                out = self._divergence(model, h, labels, th)
                loss += float(out.loss_sum)
                tokens += int(out.num_tokens)
        finally:
            model.train(was_training)
        return {"eval_distill_kl": kl / max(tokens, 1), "eval_distill_loss": loss / max(tokens, 1),
                "eval_distill_tokens": tokens}

    def evaluate(self, run) -> dict:
        """The held-out divergence, the student's eval loss and, where a checker knows the
        records, the student's task accuracy and the teacher's (measured once)."""
        spec = self.spec
        if run.ctx is not None:  # every rank the same forwards (FSDP's all-gathers)
            out = sharded_eval_loss(run)
        else:
            out = eval_loss(run.model, EvalStream(spec.data, run.tokenizer, max(1, run.micro_batch)),
                            backend="chunked", chunk_size=spec.loss.chunk_size)
        out.update(self.held_out_divergence(run.model))
        samples = read_samples(spec.data.eval, ACCURACY_SAMPLES)
        checker = task_checker(samples)
        if checker is not None:
            turns, matches = checker
            ranks = (run.ctx.rank, run.ctx.world_size) if run.ctx is not None else None  # replies dealt over ranks
            out.update(task_accuracy(run.model, run.tokenizer, samples, turns=turns, matches=matches, ranks=ranks))
            if self.teacher_accuracy is None:
                found = task_accuracy(self.teacher, run.tokenizer, samples, turns=turns, matches=matches, ranks=ranks)
                self.teacher_accuracy = {"eval_teacher_" + k[len("eval_"):]: v for k, v in found.items()}
            out.update(self.teacher_accuracy)
        out["on_policy_share"] = self.on_policy_steps / max(self.steps, 1)
        return out

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"steps": self.steps, "on_policy_steps": self.on_policy_steps}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.steps = int(state.get("steps", 0))
        self.on_policy_steps = int(state.get("on_policy_steps", 0))

    def generators(self) -> dict[str, torch.Generator]:
        return self._generators


def global_share(parts: list[list]) -> Share:
    """This rank's part of the step's prompts in one process's order (``parts``: this rank's
    ``split_documents`` of each micro-batch): micro-batch by micro-batch, and within one the
    ranks in order, as the rows of the global batch lie (``TrainStream.next_batch``).  One
    gather of every rank's prompt lengths; ``all_stopped`` agrees over the ranks."""
    lengths = [[len(prompt) for prompt, _, _ in part] for part in parts]
    every = D.gather_object(lengths)
    me = D.rank()
    rows: list[int] = []
    total = 0
    for m in range(len(lengths)):
        for r, theirs in enumerate(every):
            n = len(theirs[m])
            if r == me:
                rows.extend(range(total, total + n))
            total += n
    width = max((n for theirs in every for micro in theirs for n in micro), default=1)
    return Share(tuple(rows), total, width, D.all_true)


def load_teacher(spec, tokenizer, device: torch.device):
    """The frozen teacher: ``distill.teacher_path`` or ``distill.teacher_config`` (random init),
    in ``distill.teacher_dtype``, eval mode, no parameter requiring a gradient."""
    d, m = spec.distill, spec.model
    config = None
    if d.teacher_config is not None:
        config = {k: v for k, v in d.teacher_config.items() if not (k == "vocab_size" and not v)}
    teacher = build_model(path=d.teacher_path, config=config, dtype=d.teacher_dtype,
                          attn_implementation=m.attn_implementation, varlen_kernel=m.varlen_kernel,
                          init_seed=d.teacher_init_seed, vocab_size=len(tokenizer), device=device)
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher


__all__ = ["DistillObjective", "global_share", "load_teacher", "split_documents", "stop_ids"]
