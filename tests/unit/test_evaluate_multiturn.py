"""Task accuracy scores the whole reply: every assistant turn of a record, generated in turn.

A scripted stand-in for the model answers each prompt by looking at which assistant turn it
is asked for; the real quickstart tokenizer and chat template render the prompts, and the
real checker (``synthetic.turn_matches``) judges the replies.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from pgs.runtime.data.synthetic import eval_turns, is_correct, turn_matches
from pgs.runtime.loop.evaluate import task_accuracy, task_checker

TOKENIZER = os.path.join("pgs", "assets", "quickstart", "tokenizer")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def weather(city: str, report: str, relay: str) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return {"task": "weather", "tools": [TOOL], "messages": [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": report},
        {"role": "assistant", "content": relay},
    ]}


def add(a: int, b: int) -> dict:
    return {"task": "add", "messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                        {"role": "assistant", "content": str(a + b)}]}


def tool_call(city: str) -> str:
    return "<tool_call>" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "</tool_call>"


class Scripted(torch.nn.Module):
    """A stand-in for a causal LM, driven by ``pgs.runtime.model.generate``: on the prompt's
    forward it decodes each left-padded row and plans the reply ``script(prompt_text, turn)``
    (and eos); each forward then returns logits that put the next planned token first (eos once
    the reply is out).  ``turn`` counts the assistant turns already in the prompt."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = None
        self.tokenizer, self.script, self.prompts = tokenizer, script, []
        self.plans, self.step = [], 0

    def forward(self, input_ids, attention_mask, cache=None, **_):
        if cache.get_seq_length() == 0:  # the prompt's forward: plan every row's reply
            self.plans, self.step = [], 0
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
                text = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
                self.prompts.append(text)
                turn = text.count("<|im_start|>assistant") - 1
                self.plans.append(self.tokenizer(self.script(text, turn) + "<|im_end|>",
                                                 add_special_tokens=False)["input_ids"])
        # the cache only counts tokens here (nothing attends): one slot per forwarded position
        k = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 1)
        cache.update(k, k, 0)
        eos = self.tokenizer.eos_token_id
        logits = torch.zeros(input_ids.shape[0], 1, len(self.tokenizer))
        for row, plan in enumerate(self.plans):
            logits[row, 0, plan[self.step] if self.step < len(plan) else eos] = 1.0
        self.step += 1
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def score(tokenizer, samples, script, **kwargs):
    model = Scripted(tokenizer, script)
    turns, matches = task_checker(samples)
    return task_accuracy(model, tokenizer, samples, turns=turns, matches=matches, **kwargs), model


def test_right_tool_call_then_wrong_relay_scores_zero(tokenizer):
    sample = weather("Oslo", "23C sunny", "Oslo: 23C, sunny.")
    out, model = score(tokenizer, [sample], lambda text, turn: tool_call("Oslo") if turn == 0 else "Oslo: 23C, rainy.")
    assert out == {"eval_accuracy": 0.0, "eval_correct": 0, "eval_accuracy_weather": 0.0}
    assert len(model.prompts) == 2  # the relay was generated, and judged


def test_right_on_both_turns_scores_one_and_the_relay_sees_the_records_tool_result(tokenizer):
    sample = weather("Oslo", "23C sunny", "Oslo: 23C, sunny.")
    out, model = score(tokenizer, [sample], lambda text, turn: tool_call("Oslo") if turn == 0 else "Oslo: 23C, sunny.")
    assert out == {"eval_accuracy": 1.0, "eval_correct": 1, "eval_accuracy_weather": 1.0}
    first, second = model.prompts
    assert "23C sunny" not in first and first.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>tool\n23C sunny<|im_end|>" in second and second.endswith("<|im_start|>assistant\n")
    assert tool_call("Oslo") + "<|im_end|>" in second  # the turn before, as the record has it


def test_a_wrong_first_turn_ends_the_sample(tokenizer):
    sample = weather("Oslo", "23C sunny", "Oslo: 23C, sunny.")
    out, model = score(tokenizer, [sample], lambda text, turn: tool_call("Paris") if turn == 0 else "Oslo: 23C, sunny.")
    assert out["eval_accuracy"] == 0.0 and len(model.prompts) == 1


def test_per_task_accuracy_over_a_batch_of_mixed_records(tokenizer):
    samples = [add(12, 30), add(45, 45), weather("Oslo", "23C sunny", "Oslo: 23C, sunny."),
               weather("Lima", "-3C foggy", "Lima: -3C, foggy."), weather("Rome", "9C windy", "Rome: 9C, windy.")]

    def script(text, turn):
        if "What is 12 + 30?" in text:
            return "42"
        if "What is 45 + 45?" in text:
            return "91"  # wrong
        city = next(c for c in ("Oslo", "Lima", "Rome") if f"weather in {c}" in text)
        if turn == 0:
            return tool_call(city)
        return {"Oslo": "Oslo: 23C, sunny.", "Lima": "Lima: -3C, foggy.", "Rome": "Rome: 9C, sunny."}[city]

    out, _ = score(tokenizer, samples, script, batch_size=2)
    assert out["eval_correct"] == 3 and out["eval_accuracy"] == pytest.approx(3 / 5)
    assert out["eval_accuracy_add"] == 0.5 and out["eval_accuracy_weather"] == pytest.approx(2 / 3)


def test_turn_matches_is_exact():
    call = weather("Oslo", "23C sunny", "x")["messages"][1]
    assert turn_matches(call, tool_call("Oslo") + "<|im_end|>")
    assert turn_matches(call, '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>')
    assert not turn_matches(call, "Sure. " + tool_call("Oslo"))  # text the record does not have
    assert not turn_matches(call, tool_call("Oslo") * 2)
    assert not turn_matches(call, "<tool_call>{not json}</tool_call>")
    answer = {"role": "assistant", "content": "Oslo: 23C, sunny."}
    assert turn_matches(answer, " Oslo: 23C, sunny.<|im_end|>garbage after the turn")
    assert not turn_matches(answer, "Oslo: 23C, sunny")
    assert not turn_matches(answer, "Oslo: 23C, sunny." + tool_call("Oslo"))


def test_is_correct_needs_every_turn():
    sample = weather("Oslo", "23C sunny", "Oslo: 23C, sunny.")
    assert [t[2]["role"] for t in eval_turns(sample)] == ["assistant", "assistant"]
    assert eval_turns(sample)[1][0][-1] == {"role": "tool", "content": "23C sunny"}
    assert is_correct(sample, [tool_call("Oslo"), "Oslo: 23C, sunny."])
    assert not is_correct(sample, [tool_call("Oslo"), "Oslo: 23C, cloudy."])
    assert not is_correct(sample, [tool_call("Oslo")])
    with pytest.raises(TypeError, match="one per assistant turn"):
        is_correct(sample, tool_call("Oslo"))


def test_a_record_without_an_assistant_turn_is_a_clear_error(tokenizer):
    samples = [add(1, 2), {"task": "add", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}]
    with pytest.raises(ValueError, match="eval sample 1 has no assistant turn"):
        score(tokenizer, samples, lambda text, turn: "3")
