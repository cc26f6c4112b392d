"""Evaluation: token loss on the eval file, and task accuracy by greedy generation.

``eval_loss`` runs the same hidden-states-then-chunked-loss path as training, without
gradients, and divides the summed loss by the summed valid-token count of the whole pass.
``task_accuracy`` generates greedily every assistant turn of the first ``n`` eval records,
one turn after another (a tool call, then the answer relayed from the record's tool result),
and counts a record right only if a checker accepts all its turns; the quickstart's checker
is ``pgs.runtime.data.synthetic.turn_matches``.  Neither touches a random generator, so
evaluating never changes what training does next.

Several processes (FSDP2): ``sharded_eval_loss`` gives each rank its share of every eval
batch and all-reduces the sums; ``task_accuracy`` (``ranks=``) gives each rank its share of
the generation batches, pads the share with repeated work so that every rank makes the same
number of forwards (each forward all-gathers the sharded parameters: a rank that stopped early
would leave its peers waiting), and gathers the verdicts, so every rank returns the same
record.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from pgs.func.losses import token_loss
from pgs.runtime.data import EvalStream, synthetic
from pgs.runtime.data.packing import pad_id
from pgs.runtime.dist.fsdp import gather_object
from pgs.runtime.model.build import final_hidden, output_head
from pgs.runtime.model.generate import GenerationSettings, generate
from pgs.runtime.process import all_reduce_sum


@torch.no_grad()
def eval_loss(model, batches, *, backend: str = "chunked", chunk_size: int = 1024,
              max_batches: int | None = None) -> dict:
    """``{"eval_loss": Σ loss / Σ valid, "eval_tokens": Σ valid}`` over ``batches``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    weight, bias, softcap = output_head(model)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            if batch.num_trained_tokens == 0:
                continue
            h = final_hidden(model, batch.input_ids.to(device), batch.position_ids.to(device))
            result = token_loss(h, weight, batch.labels.to(device), backend=backend, bias=bias,
                                softcap=softcap, chunk_size=chunk_size)
            total += result.loss_sum.double().cpu()
            count += int(result.num_valid)
    finally:
        model.train(was_training)
    return {"eval_loss": float(total / max(count, 1)), "eval_tokens": count}


@torch.no_grad()
def sharded_eval_loss(run, path: str | None = None) -> dict:
    """:func:`eval_loss` with several processes, of ``path`` (default ``data.eval``): each rank
    its share of every eval batch (all-padding rows when it has none; a forward anyway, FSDP's
    all-gathers are collectives), sums all-reduced, so every rank returns the same numbers.  The
    head is read after the forward, when the root is gathered."""
    spec, ctx = run.spec, run.ctx
    batches = EvalStream(spec.data, run.tokenizer, max(1, run.micro_batch), path=path, rank=ctx.rank,
                         world_size=ctx.world_size)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    run.model.eval()
    try:
        for batch in batches:
            dev = run.device
            h = final_hidden(run.model, batch.input_ids.to(dev), batch.position_ids.to(dev))
            weight, bias, softcap = output_head(run.model)
            result = token_loss(h, weight, batch.labels.to(dev), backend="chunked", bias=bias, softcap=softcap,
                                chunk_size=spec.loss.chunk_size)
            total += result.loss_sum.double().cpu()
            count += int(result.num_valid)
    finally:
        run.model.train()
    sums = all_reduce_sum(torch.tensor([float(total), float(count)], dtype=torch.float64))
    total, count = float(sums[0]), int(sums[1])
    return {"eval_loss": total / max(count, 1), "eval_tokens": count}


def read_samples(path: str, n: int) -> list[dict]:
    """The first ``n`` records of a JSONL eval file (blank lines skipped)."""
    samples = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                samples.append(json.loads(line))
                if len(samples) >= n:
                    break
    return samples


@torch.no_grad()
def task_accuracy(
    model,
    tokenizer,
    samples: list[dict],
    *,
    turns: Callable[[dict], list[tuple[list, list | None, dict]]],
    matches: Callable[[dict, str], bool],
    max_new_tokens: int = 32,
    batch_size: int = 32,
    ranks: tuple[int, int] | None = None,
) -> dict:
    """``{"eval_accuracy": correct / n, "eval_correct": correct}``: whole greedy replies, checked.

    A sample is right only if every one of its assistant turns is.  ``turns(sample)`` lists
    them as ``(messages, tools, expected)``: the conversation before the turn as the record
    has it (earlier assistant turns and tool results included), the tools, and the expected
    assistant message; ``matches(expected, text)`` checks one generated turn.  Round ``k``
    generates turn ``k`` of the samples whose earlier turns all matched, so the earlier turns
    fed back (the record's) are what the model itself replied, up to the checker's
    normalisation (a tool call's JSON spacing), and the tool results are the record's.
    Records with a ``"task"`` field also get ``eval_accuracy_<task>`` per task.

    The chat template renders each prompt with the generation prompt, and greedy decoding
    (``pgs.runtime.model.generate``: left-padded batches, KV cache) stops at eos or after
    ``max_new_tokens``.

    ``ranks = (rank, world)``: several processes share an FSDP2-sharded model, and every rank
    calls this with the same samples.  Each round's prompts are cut into the batches one
    process would generate (so each reply is the one a process alone gives), and batch ``j``
    goes to rank ``j mod world``; a rank with fewer batches than the most loaded one generates
    the round's first batch again and drops the replies, and every batch decodes until every
    rank's batch has stopped (``generate(synced=True)``), so all ranks make the same forwards.
    The verdicts are gathered after each round: every rank knows which samples go on and
    returns the same numbers.
    """
    if not samples:
        return {}
    plans = []
    for index, sample in enumerate(samples):
        plan = turns(sample)
        if not plan:
            raise ValueError(f"eval sample {index} has no assistant turn to generate: {json.dumps(sample)[:200]}")
        plans.append(plan)
    was_training = model.training
    model.eval()
    alive = [True] * len(samples)
    rank, world = ranks if ranks is not None else (0, 1)
    try:
        for k in range(max(len(plan) for plan in plans)):
            todo = [i for i, plan in enumerate(plans) if alive[i] and k < len(plan)]
            batches = [todo[start:start + batch_size] for start in range(0, len(todo), batch_size)]
            if world == 1:
                for chunk in batches:
                    replies = _generate(model, tokenizer, [plans[i][k][:2] for i in chunk], max_new_tokens)
                    for i, reply in zip(chunk, replies):
                        alive[i] = bool(matches(plans[i][k][2], reply))
                continue
            mine, verdicts = batches[rank::world], []
            for call in range(-(-len(batches) // world)):  # the same number of calls on every rank
                chunk = mine[call] if call < len(mine) else None
                replies = _generate(model, tokenizer, [plans[i][k][:2] for i in (chunk or batches[0])],
                                    max_new_tokens, synced=True)
                verdicts += [(i, bool(matches(plans[i][k][2], reply))) for i, reply in zip(chunk or (), replies)]
            for part in gather_object(verdicts):
                for i, ok in part:
                    alive[i] = ok
    finally:
        model.train(was_training)
    per_task: dict[str, list[bool]] = {}
    for sample, ok in zip(samples, alive):
        if isinstance(sample.get("task"), str):
            per_task.setdefault(sample["task"], []).append(ok)
    correct = sum(alive)
    out = {"eval_accuracy": correct / len(samples), "eval_correct": correct}
    out.update({f"eval_accuracy_{task}": sum(oks) / len(oks) for task, oks in sorted(per_task.items())})
    return out


def _generate(model, tokenizer, prompts: list[tuple[list, list | None]], max_new_tokens: int,
              synced: bool = False) -> list[str]:
    """Greedy continuations of ``(messages, tools)`` prompts, decoded (the eos kept, padding removed).
    ``synced``: every rank of a sharded model calls it at the same time (``generate``'s)."""
    texts = [tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
             for messages, tools in prompts]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = generate(model, ids, GenerationSettings(max_new_tokens=max_new_tokens, temperature=0),
                   stop_ids=[tokenizer.eos_token_id], pad_id=pad_id(tokenizer), synced=synced)
    replies = tokenizer.batch_decode(out.completions(), skip_special_tokens=False)
    pad = tokenizer.pad_token
    return [reply.replace(pad, "") if pad else reply for reply in replies]


def task_checker(samples: list[dict]):
    """``(turns, matches)`` for eval records a known checker understands, else None.

    The quickstart's synthetic records carry ``"task"`` in ``add``/``weather``; their
    checker is ``pgs.runtime.data.synthetic.eval_turns`` and ``turn_matches``.  Other data
    gets eval loss only.
    """

    if samples and all(s.get("task") in ("add", "weather") for s in samples):
        return synthetic.eval_turns, synthetic.turn_matches
    return None
