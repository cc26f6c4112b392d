"""Sample completions at every evaluation (``[eval] samples = N``): what the model replies.

A loss says how likely the held-out answers are; a sample says what the model writes.  At
every evaluation the model replies, greedily, to the first ``N`` held-out conversations of
``data.eval`` that have an assistant turn: the prompt is the conversation before its first
assistant turn (system, user, tools), rendered by the run's chat template with the
generation prompt, and the reply comes from the run's own generation path
(``pgs.runtime.model.generate``: left-padded batches, KV cache, temperature 0), stopping at
the end-of-turn token or after ``max_new_tokens``.  Greedy decoding touches no random
generator, so sampling never changes what training does next.

The replies go to ``<run dir>/samples/step_<N>.jsonl``, one JSON line per prompt::

    {"step": 400, "index": 0, "origin": "eval.jsonl:1", "prompt": [...messages...],
     "reply": "105", "reference": "105", "new_tokens": 2, "stopped": true}

``reference`` is the record's own first assistant turn (its text; a tool call as JSON).
``pgs report`` shows the latest step's replies and puts every step's in its HTML page.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import attrs
import torch

from pgs.errors import SpecError
from pgs.runtime.data.config import DataSource
from pgs.runtime.data.packing import pad_id
from pgs.runtime.data.readers import read_conversations
from pgs.runtime.model.generate import GenerationSettings, generate
from pgs.runtime.spec.fields import int_at_least

#: The folder of the run that holds the samples, one JSONL file per evaluated step.
SAMPLES_DIR = "samples"
#: Prompts generated together (one left-padded batch each).
BATCH = 16


@attrs.frozen
class EvalSpec:
    """``[eval]``: what an evaluation adds to the eval loss.

    ``samples`` (0: off): greedy replies to that many held-out prompts of ``data.eval`` at every
    evaluation, written to ``<run dir>/samples/step_<N>.jsonl`` (``pgs.runtime.loop.samples``);
    ``max_new_tokens``: the longest reply.
    """

    section: ClassVar[str] = "eval"

    samples: int = attrs.field(default=0, validator=int_at_least(0))
    max_new_tokens: int = attrs.field(default=128, validator=int_at_least(1))

    def check(self, spec) -> None:
        """Samples need held-out prompts (``data.eval``) and evaluations to happen."""
        if not self.samples:
            return
        if not spec.data.eval:
            raise SpecError("eval.samples: the prompts are data.eval's held-out conversations, and data.eval is "
                            "not set; name a held-out file or set eval.samples = 0")
        if spec.train.eval_every <= 0:
            raise SpecError("eval.samples: train.eval_every = 0 turns evaluation off, so no sample would be "
                            "written; set train.eval_every")


def first_turn(messages: list[dict]) -> tuple[list[dict], dict] | None:
    """``(prompt, reply)``: the messages before the first assistant turn, and that turn; None
    when the conversation has no assistant turn after something to reply to."""
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            return (messages[:i], message) if i > 0 else None
    return None


def _reference(message: dict) -> str:
    """An assistant message as text: its content, and its tool calls as JSON."""
    parts = [message["content"]] if isinstance(message.get("content"), str) and message["content"] else []
    if message.get("tool_calls"):
        parts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
    return "\n".join(parts)


def held_out_prompts(path: str, n: int) -> list[dict]:
    """The first ``n`` conversations of ``path`` with a prompt and an assistant reply:
    ``{"origin", "messages", "tools", "reference"}`` each."""
    prompts: list[dict] = []
    for conversation in read_conversations(DataSource(path), None, "skip"):
        turn = first_turn(conversation.messages) if conversation.text is None else None
        if turn is None:
            continue
        prompts.append({"origin": conversation.origin, "messages": turn[0], "tools": conversation.tools,
                        "reference": _reference(turn[1])})
        if len(prompts) >= n:
            break
    return prompts


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[dict], max_new_tokens: int, synced: bool = False) -> list[dict]:
    """Each prompt's greedy reply through the run's generation path: ``{"reply", "new_tokens",
    "stopped"}`` (``stopped``: it ended at the end-of-turn token, not at ``max_new_tokens``).
    ``synced``: every rank of an FSDP2-sharded model calls this with the same prompts, and each
    batch decodes until every rank's has stopped (``generate(synced=True)``): the same forwards,
    the same greedy replies on every rank."""
    out: list[dict] = []
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0)
    for start in range(0, len(prompts), BATCH):
        chunk = prompts[start:start + BATCH]
        texts = [tokenizer.apply_chat_template(p["messages"], tools=p["tools"], tokenize=False,
                                               add_generation_prompt=True) for p in chunk]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        generation = generate(model, ids, settings, stop_ids=[tokenizer.eos_token_id], pad_id=pad_id(tokenizer),
                              synced=synced)
        for tokens in generation.completions():
            tokens = [int(t) for t in tokens]
            stopped = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
            out.append({"reply": tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                        "new_tokens": len(tokens), "stopped": stopped})
    return out


def write_samples(run_dir: str, step: int, prompts: list[dict], replies: list[dict]) -> str:
    """``<run_dir>/samples/step_<step>.jsonl``, written whole then renamed into place; its path."""
    folder = os.path.join(run_dir, SAMPLES_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for index, (prompt, reply) in enumerate(zip(prompts, replies)):
            record: dict[str, Any] = {"step": step, "index": index, "origin": prompt["origin"],
                                      "prompt": prompt["messages"], "reply": reply["reply"],
                                      "reference": prompt["reference"], "new_tokens": reply["new_tokens"],
                                      "stopped": reply["stopped"]}
            if prompt["tools"]:
                record["tools"] = prompt["tools"]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    return path


def _short(text: str, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


class EvalSamples:
    """``[eval] samples``: the held-out prompts, read once, and their replies at an evaluation
    (module docstring; ``loop.services.SamplesService`` calls it after each evaluation)."""

    def __init__(self, spec):
        self.max_new_tokens = spec.eval.max_new_tokens
        self.prompts = held_out_prompts(spec.data.eval, spec.eval.samples)

    def sample(self, run, result: dict) -> None:
        """Reply to every prompt, write ``samples/step_<N>.jsonl``, count them in ``result``."""
        if not self.prompts:
            return
        sharded = run.ctx is not None  # several processes: every rank replies to every prompt, rank 0 writes
        with run.bound.eval_weights():  # the weights the eval loss was measured at
            replies = greedy_replies(run.model, run.tokenizer, self.prompts, self.max_new_tokens, synced=sharded)
        result["eval_samples"] = len(replies)
        if sharded and run.ctx.rank != 0:
            return
        path = write_samples(run.run_dir, run.step, self.prompts, replies)
        last_user = next((m.get("content") for m in reversed(self.prompts[0]["messages"])
                          if m.get("role") == "user"), "")
        run.log.say(f"samples  {len(replies)} replies in {os.path.relpath(path, run.run_dir)}; "
                    f"first: {_short(last_user, 40)!r} -> {_short(replies[0]['reply'])!r}")
