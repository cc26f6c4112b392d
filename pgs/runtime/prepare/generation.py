"""The one place ``pgs prepare`` generates text: K sampled answers per prompt.

:func:`generate_answers` renders each ``(messages, tools)`` prompt with the chat template's
generation prompt and returns, per prompt, ``k`` decoded continuations that keep their
end-of-turn token when the model emitted it (so the caller can tell a finished answer from one
cut at ``max_new_tokens``), padding removed.  It draws them through pgs's one generation path,
``pgs.runtime.model.generate`` (left-padded batches, KV cache, temperature / top-p sampling
from an explicit generator, stopping at the tokenizer's eos token), as the distillation
objective and the eval's task accuracy do.
"""

from __future__ import annotations

import torch

from pgs.errors import SpecError
from pgs.runtime.data.packing import pad_id
from pgs.runtime.model.generate import GenerationSettings, generate


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[tuple[list, list | None]], k: int, *,
                     temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 256,
                     seed: int = 0, batch_size: int = 16) -> list[list[str]]:
    """``k`` sampled continuations of each prompt (greedy, and so ``k`` equal ones, at temperature 0).

    Deterministic given ``seed`` on one device: each batch samples from its own generator,
    seeded from ``seed`` and the batch's index; the global random state is not used.
    """
    if k < 1:
        raise SpecError(f"-k: expected an integer >= 1, got {k}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise SpecError(f"--temperature >= 0 and --top-p in (0, 1] expected, got {temperature}, {top_p}")
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = pad_id(tokenizer)
    sample = temperature > 0
    per = k if sample else 1
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    out: list[list[str]] = []
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=True)
                 for m, t in chunk]
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + b)
        result = generate(model, [p for p in ids for _ in range(per)], settings, stop_ids=[eos], pad_id=pad,
                          generator=gen if sample else None)
        decoded = [tokenizer.decode(c, skip_special_tokens=False) for c in result.completions()]
        for i in range(len(chunk)):
            answers = decoded[i * per:(i + 1) * per]
            out.append(answers if sample else answers * k)
    return out
