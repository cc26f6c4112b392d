"""The one place ``pgs prepare`` generates text: K sampled answers per prompt.

:func:`generate_answers` is the seam between the self-answer pipeline and a generator.  It
renders each ``(messages, tools)`` prompt with the chat template's generation prompt, and
returns, per prompt, ``k`` decoded continuations that keep their end-of-turn token when the
model emitted it (so the caller can tell a finished answer from one cut at
``max_new_tokens``), padding removed.  It uses transformers' ``model.generate`` (KV cache,
left-padded batches, temperature / top-p sampling, stopping at the tokenizer's eos token);
a generator with the same signature can replace it without touching its callers.
"""

from __future__ import annotations

import torch

from pgs.errors import SpecError


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[tuple[list, list | None]], k: int, *,
                     temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 256,
                     seed: int = 0, batch_size: int = 16) -> list[list[str]]:
    """``k`` sampled continuations of each prompt (greedy, and so ``k`` equal ones, at temperature 0).

    Deterministic given ``seed`` on one device: the sampling generator is seeded per batch, and
    the caller's random state is left as it was.
    """
    if k < 1:
        raise SpecError(f"-k: expected an integer >= 1, got {k}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise SpecError(f"--temperature >= 0 and --top-p in (0, 1] expected, got {temperature}, {top_p}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[list[str]] = []
    try:
        for b, start in enumerate(range(0, len(prompts), batch_size)):
            chunk = prompts[start:start + batch_size]
            texts = [tokenizer.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=True)
                     for m, t in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            sample = temperature > 0
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                       device_type=device.type if device.type == "cuda" else "cuda"):
                torch.manual_seed(seed * 1_000_003 + b)
                ids = model.generate(
                    input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens, do_sample=sample,
                    temperature=temperature if sample else None, top_p=top_p if sample else None,
                    top_k=None, num_return_sequences=k if sample else 1,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=pad,
                )
            decoded = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
            if tokenizer.pad_token and tokenizer.pad_token != tokenizer.eos_token:
                decoded = [d.replace(tokenizer.pad_token, "") for d in decoded]
            elif tokenizer.eos_token:  # pad == eos: keep the first eos, drop the padding after it
                decoded = [d.split(tokenizer.eos_token)[0] + tokenizer.eos_token if tokenizer.eos_token in d else d
                           for d in decoded]
            per = k if sample else 1
            for i in range(len(chunk)):
                answers = decoded[i * per:(i + 1) * per]
                out.append(answers if sample else answers * k)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out
