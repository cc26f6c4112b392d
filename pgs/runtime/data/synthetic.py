"""Synthetic chat tasks for the quickstart, their checker, and the quickstart's tokenizer.

Two tasks, each with a short answer that can be checked exactly, small enough that a tiny
model learns them in a couple of minutes on a CPU:

* ``add``: "What is 47 + 58?" -> "105" (two-digit operands);
* ``weather``: a one-tool conversation.  The user asks for the weather in a city, the
  assistant calls ``get_weather`` with that city, the tool answers, the assistant reports.

:func:`eval_turns` gives, for each assistant turn, the conversation before it; :func:`turn_matches`
checks one generated turn exactly (the sum; the tool call's name and arguments; the relayed
answer), and a sample is right only if all its turns are (:func:`is_correct`).  Regenerate
the quickstart assets with::

    python -m pgs.runtime.data.synthetic --out pgs/assets/quickstart   # also the DPO quickstart's pairs
    python -m pgs.runtime.data.synthetic --long-chats 256 --out pgs/assets/bench/chats.jsonl

Everything is deterministic given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Any

CITIES = (
    "Oslo", "Paris", "Lima", "Cairo", "Tokyo", "Quito", "Dakar", "Hanoi", "Perth", "Bern",
    "Rome", "Seoul", "Delhi", "Accra", "Porto", "Riga", "Minsk", "Sofia", "Doha", "Baku",
)
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

#: ChatML-like, with ``{% generation %}`` markers around each whole assistant turn (content,
#: tool calls and ``<|im_end|>``), so that the assistant mask comes from the template itself.
QUICKSTART_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:\\n' }}"
    "{%- for tool in tools %}{{- (tool.function if tool.function is defined else tool) | tojson }}"
    "{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' }}{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"


#: The addition task's operands: two-digit numbers, so 8,100 distinct questions.
ADD_OPERANDS = (10, 99)


def make_addition(rng: random.Random, operands: tuple[int, int] = ADD_OPERANDS) -> dict[str, Any]:
    a = rng.randint(*operands)
    b = rng.randint(*operands)
    return {
        "task": "add",
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": str(a + b)},
        ],
    }


#: What the weather tool returns.  The assistant relays it after the city ("Oslo: 23C,
#: sunny."), a verbatim copy.  With the tool saying "23C sunny" (a copy with a comma to
#: insert) one quickstart seed in three still relayed a wrong condition at step 1000 of
#: 1200 (weather 0.14); with the verbatim copy all three relayed right by then.
TOOL_SAYS = "{degrees}C, {condition}"


def make_weather(rng: random.Random, tool_says: str = TOOL_SAYS) -> dict[str, Any]:
    city = rng.choice(CITIES)
    degrees = rng.randint(-9, 35)
    condition = rng.choice(CONDITIONS)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return {
        "task": "weather",
        "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": tool_says.format(degrees=degrees, condition=condition)},
            {"role": "assistant", "content": f"{city}: {degrees}C, {condition}."},
        ],
        "tools": [WEATHER_TOOL],
    }


def sample_key(sample: dict) -> str:
    """What makes two samples the same: their whole conversation."""
    return json.dumps(sample["messages"], sort_keys=True)


def generate(n: int, seed: int, weather_share: float = 0.25, exclude: set[str] | None = None) -> list[dict]:
    """``n`` distinct samples, deterministic in ``seed``, none of whose :func:`sample_key`
    is in ``exclude`` (which gains the keys of those returned)."""
    rng = random.Random(seed)
    exclude = set() if exclude is None else exclude
    samples: list[dict] = []
    misses = 0  # draws in a row that were already taken
    while len(samples) < n:
        sample = make_weather(rng) if rng.random() < weather_share else make_addition(rng)
        key = sample_key(sample)
        if key in exclude:
            misses += 1
            if misses >= 10_000:
                raise ValueError(f"cannot draw {n} distinct samples (seed {seed}): after {len(samples)}, "
                                 f"10,000 draws in a row were all taken already; ask for fewer")
            continue
        misses = 0
        exclude.add(key)
        samples.append(sample)
    return samples


#: The long chats' sums have two- and three-digit operands, and their weather tool says
#: "23C sunny".
LONG_CHAT_OPERANDS = (10, 999)
LONG_CHAT_TOOL_SAYS = "{degrees}C {condition}"


def wrong_answer(sample: dict, rng: random.Random) -> dict:
    """The first assistant turn of ``sample`` answered wrongly: for a sum, half the time the
    difference of the operands (the wrong operation), else the sum off by 100-900 (a wrong
    hundreds digit); for the weather, a tool call for another city."""
    turn = sample["messages"][1]
    if sample["task"] == "add":
        right = int(turn["content"])
        a, b = (int(x) for x in re.findall(r"\d+", sample["messages"][0]["content"]))
        if rng.random() < 0.5 and a != b:
            return {"role": "assistant", "content": str(abs(a - b))}
        while True:
            wrong = right + rng.choice((-1, 1)) * 100 * rng.randint(1, 9)
            if wrong > 0:
                return {"role": "assistant", "content": str(wrong)}
    city = turn["tool_calls"][0]["function"]["arguments"]["city"]
    other = rng.choice([c for c in CITIES if c != city])
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": other}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def preference_pairs(samples: list[dict], seed: int) -> list[dict]:
    """A preference pair per sample: its user turn as the prompt, its first assistant turn as
    the chosen answer and :func:`wrong_answer` as the rejected one (deterministic in ``seed``)."""
    rng = random.Random(f"pairs:{seed}")
    pairs = []
    for sample in samples:
        pair = {"task": sample["task"], "prompt": sample["messages"][:1], "chosen": sample["messages"][1:2],
                "rejected": [wrong_answer(sample, rng)]}
        if "tools" in sample:
            pair["tools"] = sample["tools"]
        pairs.append(pair)
    return pairs


def write_preference(out: str, seed: int = 0, n_train: int = 1000) -> None:
    """``pairs_train.jsonl`` and ``pairs_eval.jsonl`` under ``out``, from its ``train.jsonl`` (the
    first ``n_train`` records) and ``eval.jsonl``: the DPO quickstart's pairs (held-out pairs from
    the held-out prompts)."""
    for split in ("train", "eval"):
        with open(os.path.join(out, f"{split}.jsonl"), encoding="utf-8") as f:
            samples = [json.loads(line) for line in f if line.strip()]
        if split == "train":
            samples = samples[:n_train]
        write_jsonl(os.path.join(out, f"pairs_{split}.jsonl"), preference_pairs(samples, seed + (split == "eval")))


def kto_records(pairs: list[dict], seed: int) -> list[dict]:
    """KTO's unpaired records from preference pairs: one record per pair, its chosen answer
    (``label`` true) or its rejected one (false) with even odds (deterministic in ``seed``), so
    no prompt is seen with both labels: the data is unpaired, as KTO's is."""
    rng = random.Random(f"kto:{seed}")
    out = []
    for pair in pairs:
        desirable = rng.random() < 0.5
        record = {"task": pair["task"], "prompt": pair["prompt"],
                  "completion": pair["chosen" if desirable else "rejected"], "label": desirable}
        if "tools" in pair:
            record["tools"] = pair["tools"]
        out.append(record)
    return out


def write_kto(out: str, seed: int = 0) -> None:
    """``kto_train.jsonl`` and ``kto_eval.jsonl`` under ``out`` from its ``pairs_*.jsonl``: the KTO
    quickstart's records (:func:`kto_records`)."""
    for split in ("train", "eval"):
        with open(os.path.join(out, f"pairs_{split}.jsonl"), encoding="utf-8") as f:
            pairs = [json.loads(line) for line in f if line.strip()]
        write_jsonl(os.path.join(out, f"kto_{split}.jsonl"), kto_records(pairs, seed + (split == "eval")))


#: Tokens of one turn under the quickstart tokenizer and template, on average within a
#: conversation (measured over 256 chats), plus the 35-token tool header once.
_TURN_TOKENS = {"add": 23, "weather": 67}


def long_chat(rng: random.Random, target_tokens: int, weather_share: float = 0.25) -> dict[str, Any]:
    """One multi-turn conversation of about ``target_tokens`` tokens (quickstart tokenizer):
    addition and weather exchanges, one after another, every assistant turn supervised.

    The packed-throughput specs train on these: documents of a realistic length mix
    (hundreds to thousands of tokens), several supervised turns each, a tool header.
    """
    messages: list[dict] = []
    tokens = 35  # the tool header
    while tokens < target_tokens:
        if rng.random() < weather_share:
            messages += make_weather(rng, LONG_CHAT_TOOL_SAYS)["messages"]
            tokens += _TURN_TOKENS["weather"]
        else:
            messages += make_addition(rng, LONG_CHAT_OPERANDS)["messages"]
            tokens += _TURN_TOKENS["add"]
    return {"task": "chat", "messages": messages, "tools": [WEATHER_TOOL]}


def long_chats(n: int, seed: int, min_tokens: int = 300, max_tokens: int = 3000) -> list[dict]:
    """``n`` conversations of ``min_tokens``-``max_tokens`` tokens each (uniform), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [long_chat(rng, rng.randint(min_tokens, max_tokens)) for _ in range(n)]


def eval_turns(sample: dict) -> list[tuple[list[dict], list[dict] | None, dict]]:
    """One ``(messages, tools, expected)`` per assistant turn of ``sample``: the conversation
    before that turn (earlier turns and tool results as the record has them), the tools, and
    the assistant message a reply must match."""
    messages = sample["messages"]
    tools = sample.get("tools")
    return [(messages[:i], tools, m) for i, m in enumerate(messages) if m["role"] == "assistant"]


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def turn_matches(expected: dict, generated_text: str) -> bool:
    """Whether ``generated_text`` (one generated assistant turn) is ``expected``, exactly.

    Everything up to the first end-of-turn token counts.  Its text outside tool calls must
    equal the expected content once surrounding whitespace is stripped, and its tool calls
    must name the same functions with the same arguments, in order (their JSON may be spaced
    differently).
    """
    text = generated_text.split(EOS_TOKEN)[0]
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            calls.append(json.loads(body))
        except json.JSONDecodeError:
            return False
    want = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in expected.get("tool_calls") or []
    ]
    return _TOOL_CALL.sub("", text).strip() == (expected.get("content") or "").strip() and calls == want


def is_correct(sample: dict, replies: list[str]) -> bool:
    """Whether ``replies`` (one generated text per assistant turn of ``sample``, in order, as
    :func:`eval_turns` prompts them) are the whole expected reply: every turn matches."""
    if isinstance(replies, str):
        raise TypeError("is_correct takes a list of replies, one per assistant turn, not a string")
    expected = [turn[2] for turn in eval_turns(sample)]
    return len(replies) == len(expected) and all(turn_matches(e, r) for e, r in zip(expected, replies))


def write_jsonl(path: str, samples: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps(sample, separators=(",", ":")) + "\n")


def train_tokenizer(texts: list[str], vocab_size: int = 768):
    """A byte-level BPE (digits split one by one) with the quickstart chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                pattern=_tokenizers_regex(), behavior="isolated"
            ),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )
    tokenizer.add_tokens(list(TOOL_TAGS))
    tokenizer.chat_template = QUICKSTART_CHAT_TEMPLATE
    return tokenizer


def _tokenizers_regex():
    from tokenizers import Regex

    # Keep the tool tags and special tokens out of BPE merges' way: split on them first.
    return Regex(r"<\|[a-z_]+\|>|</?tool_call>")


def save_tokenizer(tokenizer, folder: str) -> None:
    """Save as a HF tokenizer folder with the chat template inside tokenizer_config.json."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(folder)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["chat_template"] = QUICKSTART_CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as handle:
        json.dump({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, handle, indent=2, sort_keys=True)
        handle.write("\n")


def write_quickstart(out: str, seed: int = 0, n_train: int = 4000, n_eval: int = 200, vocab_size: int = 768,
                     weather_share: float = 0.25):
    """Write train.jsonl, eval.jsonl and tokenizer/ under ``out``; returns the tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    os.makedirs(out, exist_ok=True)
    train = generate(n_train, seed, weather_share)
    # Held out: no eval conversation is a training one (the same sum, or the same city,
    # temperature and condition).
    seen = {sample_key(s) for s in train}
    evaluation = generate(n_eval, seed + 1, weather_share, exclude=seen)
    write_jsonl(os.path.join(out, "train.jsonl"), train)
    write_jsonl(os.path.join(out, "eval.jsonl"), evaluation)
    texts = []
    for sample in train:
        rendered, _ = render_jinja_template(
            conversations=[sample["messages"]], tools=sample.get("tools"),
            chat_template=QUICKSTART_CHAT_TEMPLATE,
        )
        texts.append(rendered[0])
    tokenizer = train_tokenizer(texts, vocab_size)
    save_tokenizer(tokenizer, os.path.join(out, "tokenizer"))
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the pgs quickstart data and tokenizer.")
    parser.add_argument("--out", default="pgs/assets/quickstart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("--weather-share", type=float, default=0.25)
    parser.add_argument("--long-chats", type=int, default=0, metavar="N",
                        help="write N multi-turn chats of 300-3000 tokens to OUT (a .jsonl file) instead")
    args = parser.parse_args(argv)
    if args.long_chats:
        write_jsonl(args.out, long_chats(args.long_chats, args.seed))
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB)")
        return 0
    write_quickstart(args.out, args.seed, args.train, args.eval, args.vocab_size, args.weather_share)
    write_preference(args.out, args.seed)
    write_kto(args.out, args.seed)
    total = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(args.out) for f in files
    )
    print(f"wrote {args.out} ({total / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
