"""Masks of templates in the style of each major family, and ``data.chat_template``.

The templates under ``tests/templates/`` are written for these tests in the shape of Qwen3,
Llama 3.1, Mistral v3 and tekken-era ([INST], [TOOL_CALLS]), Gemma 3, Phi-4 and DeepSeek-R1
templates (no downloads).  For each, the trained tokens are decoded run by run and compared
with the assistant turns written out by hand, end-of-turn token included: whatever way the
spans are found (generation markers, turn markers, prefix diffing), what trains is exactly
what the assistant says.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pgs.errors import DataError, SpecError
from pgs.runtime.data import encode_chat
from pgs.runtime.data.chat import assistant_spans
from pgs.runtime.data.synthetic import WEATHER_TOOL
from pgs.runtime.data.templates import apply_chat_template, resolve_chat_template, shipped_templates
from test_data_chat import trained_runs as chat_runs

HERE = Path(__file__).resolve().parents[1]  # tests/, where templates/ lives
TEMPLATES = HERE / "templates"
QUICKSTART_TOKENIZER = "pgs/assets/quickstart/tokenizer"

FAMILY_TOKENS = {
    "qwen3": ({}, ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "llama3": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               ["<|start_header_id|>", "<|end_header_id|>"]),
    "mistral": ({"bos_token": "<s>", "eos_token": "</s>"},
                ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]),
    "gemma3": ({"bos_token": "<bos>", "eos_token": "<eos>"}, ["<start_of_turn>", "<end_of_turn>"]),
    "phi4": ({}, ["<|im_sep|>"]),
    "deepseek_r1": ({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
                    ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                     "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]),
}


@functools.lru_cache(maxsize=None)
def family_tokenizer(family: str, template: str):
    """The quickstart tokenizer with a family's special tokens and a template from tests/templates
    (or a shipped one, by name)."""
    tok = AutoTokenizer.from_pretrained(QUICKSTART_TOKENIZER)
    named, extra = FAMILY_TOKENS[family]
    tok.add_special_tokens({**named, "additional_special_tokens": extra})
    path = TEMPLATES / f"{template}.jinja"
    return apply_chat_template(tok, str(path) if path.exists() else resolve_chat_template(template))


def trained_runs(tok, messages, tools=None, **kw) -> list[str]:
    """The trained tokens, decoded run by run (a run: consecutive trained tokens)."""
    return chat_runs(tok, *encode_chat(tok, messages, tools, **kw))


def rendered(tok, messages, tools=None) -> str:
    ids, _ = encode_chat(tok, messages, tools)
    return tok.decode(ids, skip_special_tokens=False)


CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}


def tool_conversation(last: dict | None = None) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "23C, sunny", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "Oslo: 23C, sunny."},
        {"role": "user", "content": "Thanks!"},
        last or {"role": "assistant", "content": "You're welcome."},
    ]


PLAIN = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_qwen3_think_blocks_tool_calls_and_end_of_turn():
    tok = family_tokenizer("qwen3", "qwen3")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    # the empty think block the template writes on the last turn is context, not trained
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        call, "Oslo: 23C, sunny.<|im_end|>", "You're welcome.<|im_end|>"]
    assert "<think>\n\n</think>\n\nYou're welcome." in rendered(tok, tool_conversation(), [WEATHER_TOOL])
    # real reasoning trains, given as reasoning_content or inside the content
    for last in ({"role": "assistant", "content": "You're welcome.", "reasoning_content": "They thanked me."},
                 {"role": "assistant", "content": "<think>\nThey thanked me.\n</think>\n\nYou're welcome."}):
        assert trained_runs(tok, tool_conversation(last), [WEATHER_TOOL])[-1] == (
            "<think>\nThey thanked me.\n</think>\n\nYou're welcome.<|im_end|>")


def test_llama3_tool_calls_and_the_ipython_role():
    tok = family_tokenizer("llama3", "llama3")
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
        "Oslo: 23C, sunny.<|eot_id|>", "You're welcome.<|eot_id|>"]
    text = rendered(tok, tool_conversation(), [WEATHER_TOOL])
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n23C, sunny<|eot_id|>" in text
    assert "Environment: ipython" in text


@pytest.mark.parametrize("template", ["mistral_v3", "mistral-v3"])
def test_mistral_v3_by_prefix_diffing(template):
    """[INST] templates add nothing for add_generation_prompt: spans come from prefix diffing."""
    tok = family_tokenizer("mistral", template)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True) \
        == tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call00001"}]</s>',
        " Oslo: 23C, sunny.</s>", " You're welcome.</s>"]
    text = rendered(tok, tool_conversation(), [WEATHER_TOOL])
    assert text.startswith("<s>[AVAILABLE_TOOLS] [")
    assert "[/AVAILABLE_TOOLS][INST] You are terse.\n\nWeather in Oslo?[/INST]" in text  # system in the first turn
    assert '[TOOL_RESULTS] {"content": "23C, sunny", "call_id": "call00001"}[/TOOL_RESULTS]' in text


@pytest.mark.parametrize("template", ["mistral_v7", "mistral-v7"])
def test_mistral_v7_by_prefix_diffing(template):
    tok = family_tokenizer("mistral", template)
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]</s>',
        "Oslo: 23C, sunny.</s>", "You're welcome.</s>"]
    text = rendered(tok, tool_conversation(), [WEATHER_TOOL])
    system = ("[INST]You are terse.\n\nWeather in Oslo?[/INST]" if template == "mistral_v7"
              else "[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT]")
    assert system in text


def test_a_template_that_is_not_prefix_stable_is_refused_naming_it():
    """Mistral's stock v3 shape moves the system prompt to the last user turn: prefixes of a
    multi-turn conversation are not prefixes of its render.  One line naming the template."""
    tok = family_tokenizer("mistral", "mistral_v3_stock")
    single = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}]
    assert trained_runs(tok, single) == [" Hello.</s>"]  # one user turn: stable
    with pytest.raises(DataError) as err:
        encode_chat(tok, PLAIN)
    message = str(err.value)
    assert "\n" not in message
    assert "mistral_v3_stock.jinja" in message and "not prefix-stable" in message and "mistral-v3" in message
    # the shipped training template in the same shape masks it
    assert trained_runs(family_tokenizer("mistral", "mistral-v3"), PLAIN) == [" Hello.</s>", " 4</s>"]


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn():
    tok = family_tokenizer("gemma3", "gemma3")
    assert trained_runs(tok, PLAIN) == ["Hello.<end_of_turn>", "4<end_of_turn>"]
    assert rendered(tok, PLAIN).startswith("<bos><start_of_turn>user\nAnswer in one word.\n\nHi<end_of_turn>\n")


def test_phi4():
    tok = family_tokenizer("phi4", "phi4")
    assert trained_runs(tok, PLAIN) == ["Hello.<|im_end|>", "4<|im_end|>"]


def test_deepseek_r1_reasoning_in_content():
    tok = family_tokenizer("deepseek_r1", "deepseek_r1")
    last = {"role": "assistant", "content": "<think>\nThey thanked me.\n</think>\n\nYou're welcome."}
    conversation = tool_conversation(last)
    conversation[4] = {"role": "assistant", "content": "<think>\nRelay it.\n</think>\n\nOslo: 23C, sunny."}
    assert trained_runs(tok, conversation, [WEATHER_TOOL]) == [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        # reasoning before the last user query is cut by the template (as R1's: what follows </think>)
        "\n\nOslo: 23C, sunny.<｜end▁of▁sentence｜>",
        "<think>\nThey thanked me.\n</think>\n\nYou're welcome.<｜end▁of▁sentence｜>"]


def test_shipped_chatml_has_generation_markers():
    tok = family_tokenizer("qwen3", "chatml")
    assert "{%- generation -%}" in tok.chat_template
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "Oslo: 23C, sunny.<|im_end|>", "You're welcome.<|im_end|>"]


@pytest.mark.parametrize("family,template", [("qwen3", "qwen3"), ("llama3", "llama3"), ("mistral", "mistral_v3"),
                                             ("mistral", "mistral_v7"), ("deepseek_r1", "deepseek_r1")])
def test_weight_zero_turns_are_context(family, template):
    tok = family_tokenizer(family, template)
    weighted = tool_conversation()
    weighted[4] = {**weighted[4], "weight": 0}
    runs = trained_runs(tok, weighted, [WEATHER_TOOL])
    assert len(runs) == 2 and not any("Oslo: 23C, sunny." in r for r in runs)
    assert "Oslo: 23C, sunny." in rendered(tok, weighted, [WEATHER_TOOL])


def test_prefix_diff_spans_match_the_whole_render_for_long_conversations():
    """Every span found by diffing lies in the full render and covers the assistant's text."""
    tok = family_tokenizer("mistral", "mistral_v7")
    messages = [{"role": "user", "content": f"q{i}"} if i % 2 == 0 else {"role": "assistant", "content": f"a{i}"}
                for i in range(12)]
    text, spans = assistant_spans(tok, messages)
    assert [text[a:b] for a, b in spans] == [f"a{i}</s>" for i in range(1, 12, 2)]


def test_chat_template_resolution_and_pickling():
    assert set(shipped_templates()) >= {"chatml", "mistral-v3", "mistral-v7"}
    assert resolve_chat_template("mistral-v3").endswith("mistral-v3.jinja")
    assert resolve_chat_template("templates/gemma3.jinja", HERE).endswith("gemma3.jinja")
    with pytest.raises(SpecError, match=r"^data\.chat_template: 'nope' is neither a file nor a template pgs ships"):
        resolve_chat_template("nope")
    tok = family_tokenizer("mistral", "mistral-v3")
    again = pickle.loads(pickle.dumps(tok))  # the loader's worker process gets a pickled copy
    assert again.chat_template == tok.chat_template
    assert encode_chat(again, PLAIN) == encode_chat(tok, PLAIN)


def test_a_turn_the_markers_miss_is_found_by_prefix_diffing():
    """DeepSeek-R1's template writes no <｜Assistant｜> header on the turn after tool outputs: the
    turn markers find two of three turns, prefix diffing finds all three."""
    tok = family_tokenizer("deepseek_r1", "deepseek_r1_tools")
    assert "<｜tool▁outputs▁end｜>Oslo: 23C" in rendered(tok, tool_conversation(), [WEATHER_TOOL])
    assert trained_runs(tok, tool_conversation(), [WEATHER_TOOL]) == [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        "Oslo: 23C, sunny.<｜end▁of▁sentence｜>", "You're welcome.<｜end▁of▁sentence｜>"]
    # reasoning the template cuts once a later user turn exists: not prefix-stable either way
    conversation = tool_conversation()
    conversation[4] = {"role": "assistant", "content": "<think>\nRelay it.\n</think>\n\nOslo: 23C, sunny."}
    with pytest.raises(DataError, match=r"^found 2 assistant turns in the rendered template, expected 3$"):
        encode_chat(tok, conversation, [WEATHER_TOOL])
