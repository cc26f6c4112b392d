"""Evaluation: token loss on the eval file, and task accuracy by greedy generation.

``eval_loss`` runs the same hidden-states-then-chunked-loss path as training, without
gradients, and divides the summed loss by the summed valid-token count of the whole pass.
``task_accuracy`` generates greedily from the first ``n`` eval prompts (the messages before
their first assistant turn) and asks a checker whether each reply is right; the quickstart's
checker is ``pgs.runtime.data.synthetic.is_correct``.  Neither touches a random generator,
so evaluating never changes what training does next.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from pgs.func.losses import token_loss
from pgs.runtime.data import synthetic
from pgs.runtime.model.build import final_hidden, output_head


@torch.no_grad()
def eval_loss(model, batches, *, backend: str = "chunked", chunk_size: int = 1024, max_batches: int | None = None) -> dict:
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
    prompt: Callable[[dict], tuple[list, list | None]],
    is_correct: Callable[[dict, str], bool],
    max_new_tokens: int = 32,
    batch_size: int = 16,
) -> dict:
    """``{"eval_accuracy": correct / n, "eval_correct": correct}``: greedy replies, checked.

    Records with a ``"task"`` field also get ``eval_accuracy_<task>`` per task.

    ``prompt(sample) -> (messages, tools)``; the chat template renders them with the
    generation prompt, prompts are left-padded in batches, and generation stops at eos.
    """
    if not samples:
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    correct = 0
    per_task: dict[str, list[int]] = {}
    try:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start:start + batch_size]
            texts = []
            for sample in chunk:
                messages, tools = prompt(sample)
                texts.append(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                           add_generation_prompt=True))
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                input_ids=enc["input_ids"].to(device),
                attention_mask=enc["attention_mask"].to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            for sample, reply in zip(chunk, replies):
                pad = tokenizer.pad_token
                ok = bool(is_correct(sample, reply.replace(pad, "") if pad else reply))
                correct += ok
                if isinstance(sample.get("task"), str):
                    per_task.setdefault(sample["task"], []).append(ok)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    out = {"eval_accuracy": correct / len(samples), "eval_correct": correct}
    out.update({f"eval_accuracy_{task}": sum(oks) / len(oks) for task, oks in sorted(per_task.items())})
    return out


def task_checker(samples: list[dict]):
    """``(prompt, is_correct)`` for eval records a known checker understands, else None.

    The quickstart's synthetic records carry ``"task"`` in ``add``/``weather``; their checker
    is ``pgs.runtime.data.synthetic.is_correct``.  Other data gets eval loss only.
    """

    if samples and all(s.get("task") in ("add", "weather") for s in samples):
        return synthetic.eval_prompt, synthetic.is_correct
    return None
