"""Assistant masks: decode each trained run and compare it with the assistant text.

The templates below are written for these tests in the style of three template families
(no downloads): a Qwen3-style ChatML with think blocks and tool calls, a Llama-3-style with
header ids, and a plain ChatML.  None has ``{% generation %}`` markers; the quickstart's
template (which has them) is tested too.
"""

from __future__ import annotations

import functools

import pytest
from transformers import AutoTokenizer

from pgs.errors import DataError
from pgs.runtime.data import encode_chat
from pgs.runtime.data.synthetic import WEATHER_TOOL

QUICKSTART_TOKENIZER = "pgs/assets/quickstart/tokenizer"

CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- elif loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
    "{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + (tools | tojson) + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{%- set role = 'ipython' %}{%- else %}{%- set role = m.role %}{%- endif %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{- {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{%- endfor %}"
    "{%- else %}{{- m.content | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=None)
def tokenizer_with(template: str | None):
    tok = AutoTokenizer.from_pretrained(QUICKSTART_TOKENIZER)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tok.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"])
    if template is not None:
        tok.chat_template = template
    return tok


def trained_runs(tok, ids, mask) -> list[str]:
    runs, current = [], []
    for token, trained in zip(ids, mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def call(city):
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now"},
]
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("Oslo")]},
    {"role": "tool", "content": "12C cloudy"},
    {"role": "assistant", "content": "Oslo: 12C, cloudy."},
]


def test_chatml_masks_every_assistant_turn_with_its_end_token():
    tok = tokenizer_with(CHATML)
    ids, mask = encode_chat(tok, TWO_TURNS)
    assert len(ids) == len(mask)
    assert trained_runs(tok, ids, mask) == ["Hello there<|im_end|>", "Bye now<|im_end|>"]


def test_last_turn_only():
    tok = tokenizer_with(CHATML)
    ids, mask = encode_chat(tok, TWO_TURNS, last_turn_only=True)
    assert trained_runs(tok, ids, mask) == ["Bye now<|im_end|>"]


def test_qwen3_style_tool_calls_and_empty_think_left_out():
    tok = tokenizer_with(QWEN3_STYLE)
    ids, mask = encode_chat(tok, TOOL_TURNS, [WEATHER_TOOL])
    assert trained_runs(tok, ids, mask) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "Oslo: 12C, cloudy.<|im_end|>",
    ]
    assert "<think>" in tok.decode(ids)  # the template did insert an empty think block


def test_qwen3_style_empty_think_supervised_when_asked():
    tok = tokenizer_with(QWEN3_STYLE)
    ids, mask = encode_chat(tok, TOOL_TURNS, [WEATHER_TOOL], supervise_empty_think=True)
    assert trained_runs(tok, ids, mask)[-1] == "<think>\n\n</think>\n\nOslo: 12C, cloudy.<|im_end|>"


def test_qwen3_style_real_reasoning_is_supervised():
    tok = tokenizer_with(QWEN3_STYLE)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    ]
    ids, mask = encode_chat(tok, messages)
    assert trained_runs(tok, ids, mask) == ["<think>\nadd them\n</think>\n\n4<|im_end|>"]


def test_llama3_style_masks_content_tool_calls_and_eot():
    tok = tokenizer_with(LLAMA3_STYLE)
    ids, mask = encode_chat(tok, TWO_TURNS)
    assert trained_runs(tok, ids, mask) == ["Hello there<|eot_id|>", "Bye now<|eot_id|>"]
    ids, mask = encode_chat(tok, TOOL_TURNS, [WEATHER_TOOL])
    assert trained_runs(tok, ids, mask) == [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
        "Oslo: 12C, cloudy.<|eot_id|>",
    ]


def test_generation_markers_template_quickstart():
    tok = tokenizer_with(None)
    ids, mask = encode_chat(tok, TOOL_TURNS, [WEATHER_TOOL])
    assert trained_runs(tok, ids, mask) == [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>',
        "Oslo: 12C, cloudy.<|im_end|>",
    ]
    reference = tok.apply_chat_template(
        TOOL_TURNS, tools=[WEATHER_TOOL], return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(reference["input_ids"])
    assert mask == [bool(m) for m in reference["assistant_masks"]]


def test_ids_match_the_templates_own_tokenization():
    for template in (CHATML, QWEN3_STYLE, LLAMA3_STYLE):
        tok = tokenizer_with(template)
        ids, _ = encode_chat(tok, TWO_TURNS)
        assert ids == list(tok.apply_chat_template(TWO_TURNS, return_dict=True)["input_ids"])


def test_template_that_refuses_is_a_data_error():
    tok = tokenizer_with("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match="roles must alternate"):
        encode_chat(tok, TWO_TURNS)
