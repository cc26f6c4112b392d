"""Self-answers: the model's own verified answers to the data's prompts, as a training set.

For every record of the spec's sources, the prompt is the conversation before its *last*
assistant turn (earlier turns, tool results and the tools as the record has them) and the
reference is that turn.  The model samples ``k`` answers per prompt
(:func:`pgs.runtime.prepare.generation.generate_answers`); the first that finished (emitted
its end-of-turn token) and that the verifier accepts replaces the reference, and the record
is written in the ``messages`` shape with its other keys (metadata) kept.  A prompt with no
accepted answer is left out and counted.  The kept prompts' records as the data has them are
the baseline: the same prompts with the dataset's answers.

``--replay FILE`` mixes in the model's own answers to general prompts (records of any shape,
their last assistant turn replaced; nothing to verify against, so an answer is kept when it
finished and is not empty), as a share of the written records, each marked ``"replay": true``.
pgs's premise (docs/prepare.md): on the same prompts, the model's own verified answers kept its math and
instruction following better than the dataset's, and replaying its own answers to general
prompts forgot less than replaying a chat dataset.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from pgs.errors import DataError, SpecError
from pgs.runtime.data.readers import open_reader
from pgs.runtime.data.records import conversation
from pgs.runtime.prepare.generation import generate_answers
from pgs.runtime.prepare.verify import parse_answer

_SHAPE_KEYS = ("messages", "conversations", "prompt", "completion", "system", "tools")


def prompt_of(record: dict, origin: str, format: str = "auto", fields: dict | None = None
              ) -> tuple[list, list | None, int]:
    """``(messages, tools, last)``: the validated conversation and the index of its last assistant
    turn; the prompt is ``messages[:last]``, the reference ``messages[last]``."""
    found = conversation(record, origin, format, fields)
    if found.text is not None:
        raise DataError(f"{origin}: a text document has no prompt to answer")
    last = max(i for i, m in enumerate(found.messages) if m["role"] == "assistant")
    return found.messages, found.tools, last


def answered_record(record: dict, messages: list, tools, last: int, answer: dict, **marks) -> dict:
    """The record in the ``messages`` shape with turn ``last`` replaced by ``answer``; its other keys kept."""
    out = {k: v for k, v in record.items() if k not in _SHAPE_KEYS}
    out["messages"] = messages[:last] + [answer] + messages[last + 1:]
    if tools:
        out["tools"] = tools
    out.update(marks)
    return out


def read_records(path: str, limit: int | None = None) -> list[tuple[dict, str]]:
    """``(record, origin)`` of the first ``limit`` records of a source file of any kind a spec
    source takes (all when None)."""
    reader = open_reader(path)
    out = []
    try:
        for _, label, raw in reader.scan():
            origin = reader.origin(label)
            out.append((reader.record(raw, origin), origin))
            if limit is not None and len(out) >= limit:
                break
    finally:
        reader.close()
    return out


def self_answer(model, tokenizer, records: list[tuple[dict, str]], verify: Callable, *, k: int = 4,
                temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 256, seed: int = 0,
                batch_size: int = 16, format: str = "auto", fields: dict | None = None, generate=generate_answers
                ) -> tuple[list[dict], list[dict], dict]:
    """The accepted self-answered records, the same prompts' records as the data has them (the
    baseline to compare with), and the counts (prompts, answers, finished, accepted, kept)."""
    eos = tokenizer.eos_token
    parsed = []
    for record, origin in records:
        messages, tools, last = prompt_of(record, origin, format, fields)
        parsed.append((record, origin, messages, tools, last))
    texts = generate(model, tokenizer, [(p[2][:p[4]], p[3]) for p in parsed], k, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size)
    kept, originals = [], []
    stats = {"prompts": len(parsed), "answers": 0, "finished": 0, "accepted": 0, "kept": 0}
    for (record, origin, messages, tools, last), answers in zip(parsed, texts):
        reference = messages[last]
        chosen = None
        for j, text in enumerate(answers):
            stats["answers"] += 1
            if eos and eos not in text:
                continue  # cut at max_new_tokens: not a whole answer
            stats["finished"] += 1
            answer = parse_answer(text, eos)
            try:
                ok = bool(verify(answer, reference, record))
            except Exception as err:  # the user's verifier: name the prompt, keep the message to one line
                raise DataError(f"{origin}: the verifier raised {type(err).__name__}: {err}") from None
            if ok:
                stats["accepted"] += 1
                if chosen is None:
                    chosen = (j, answer)
        if chosen is not None:
            stats["kept"] += 1
            kept.append(answered_record(record, messages, tools, last, chosen[1],
                                        self_answer={"origin": origin, "sample": chosen[0]}))
            originals.append(record)
    return kept, originals, stats


def replay(model, tokenizer, records: list[tuple[dict, str]], n: int, *, temperature: float = 1.0,
           top_p: float = 1.0, max_new_tokens: int = 256, seed: int = 0, batch_size: int = 16,
           generate=generate_answers) -> tuple[list[dict], dict]:
    """Up to ``n`` general prompts (drawn by ``seed``) answered once by the model; finished, non-empty answers kept."""
    order = np.random.default_rng([seed, 0xE9]).permutation(len(records))
    eos = tokenizer.eos_token
    kept, stats = [], {"replay_prompts": 0, "replay_kept": 0}
    for start in range(0, len(order), max(n, 1)):
        if len(kept) >= n:
            break
        picked = [records[i] for i in order[start:start + max(n, 1)]]
        parsed = [(r, o, *prompt_of(r, o)) for r, o in picked]
        texts = generate(model, tokenizer, [(p[2][:p[4]], p[3]) for p in parsed], 1, temperature=temperature,
                         top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + 7919 + start, batch_size=batch_size)
        for (record, origin, messages, tools, last), (text,) in zip(parsed, texts):
            stats["replay_prompts"] += 1
            if len(kept) >= n or (eos and eos not in text):
                continue
            answer = parse_answer(text, eos)
            if not answer["content"] and not answer.get("tool_calls"):
                continue
            kept.append(answered_record(record, messages, tools, last, answer, replay=True,
                                        self_answer={"origin": origin, "sample": 0}))
    stats["replay_kept"] = len(kept)
    return kept, stats


def replay_count(verified: int, share: float) -> int:
    """How many replay records make ``share`` of the written file next to ``verified`` ones."""
    if not 0 <= share < 1:
        raise SpecError(f"--replay-share: expected a number in [0, 1), got {share}")
    return round(verified * share / (1 - share))


def write_jsonl(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
