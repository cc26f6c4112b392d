"""Properties of the data pipeline: packing, masks, mixing, resume, bad records."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pgs.errors import DataError
from pgs.runtime.data import DataConfig, DataSource, TrainStream, best_fit_decreasing, encode_chat, read_conversations
from pgs.runtime.data.sources import MixedOrder
from pgs.runtime.data.synthetic import generate, write_jsonl

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOK = AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")


@FAST
@given(st.lists(st.integers(1, 64), max_size=60), st.integers(64, 128))
def test_packing_is_a_permutation_and_no_bin_overflows(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # best fit never leaves two bins that could be merged when one is at most half full
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity or loads[0] == 0


TEXT = st.text(alphabet="abcdefghij XYZ0123456789.,?!", min_size=1, max_size=20).map(str.strip).filter(bool)


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        messages.append({"role": "assistant", "content": draw(TEXT)})
    return messages


@FAST
@given(conversations(), st.booleans())
def test_masks_cover_exactly_the_assistant_turns(messages, last_only):
    ids, mask = encode_chat(TOK, messages, last_turn_only=last_only)
    runs, current = [], []
    for token, trained in zip(ids, mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(TOK.decode(current))
            current = []
    if current:
        runs.append(TOK.decode(current))
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert runs == (expected[-1:] if last_only else expected)


@FAST
@given(st.lists(st.floats(0.1, 10.0), min_size=2, max_size=4), st.integers(0, 2**31))
def test_mixing_proportions_converge_to_the_weights(weights, seed):
    order = MixedOrder([7] * len(weights), weights, seed)
    draws = 4000
    counts = Counter(order.next()[0] for _ in range(draws))
    for s, w in enumerate(weights):
        expected = w / sum(weights)
        assert abs(counts[s] / draws - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5 + 0.01


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    folder = tmp_path_factory.mktemp("props")
    a, b = str(folder / "a.jsonl"), str(folder / "b.jsonl")
    write_jsonl(a, generate(25, seed=11, weather_share=0.0))
    write_jsonl(b, generate(12, seed=12, weather_share=1.0))
    return DataConfig(sources=[DataSource(a, weight=2.0), DataSource(b)], max_seq_len=128, seed=3)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 30), st.integers(1, 3), st.sampled_from([4, 9]))
def test_resume_at_any_position_yields_the_same_continuation(mix, steps, batch_size, window):
    stream = TrainStream(mix, TOK, pack_window=window)
    for _ in range(steps):
        stream.next_batch(batch_size)
    state = json.loads(json.dumps(stream.state_dict()))
    want = [stream.next_batch(batch_size).input_ids.tolist() for _ in range(2)]
    resumed = TrainStream(mix, TOK, pack_window=window)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(batch_size).input_ids.tolist() for _ in range(2)] == want


MALFORMED = [
    "{",
    '{"messages": [}',
    "42",
    '{"messages": "hi"}',
    '{"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}',
    '{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
    '{"messages": [{"role": "user", "content": {"text": "x"}}, {"role": "assistant", "content": "y"}]}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}',
    '{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}',
    '{"conversations": [{"from": "human", "value": "x"}]}',
    '{"prompt": ["x"], "completion": "y"}',
    '{"completion": "y"}',
    '{"foo": 1}',
    '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [1]}]}',
]
GOOD = '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}'


@FAST
@given(st.sampled_from(MALFORMED), st.integers(0, 5))
def test_every_malformed_file_is_a_data_error_with_file_and_line(bad, good_before):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data.jsonl")
        with open(path, "w") as handle:
            handle.write("\n".join([GOOD] * good_before + [bad, GOOD]) + "\n")
        with pytest.raises(DataError) as caught:
            list(read_conversations(path))
        message = str(caught.value)
        assert message.startswith(f"{path}:{good_before + 1}: ") and "\n" not in message
        with pytest.raises(DataError, match=f"{path}:{good_before + 1}: "):
            TrainStream(DataConfig(sources=[path]), TOK)
        skipped: list[str] = []
        assert len(list(read_conversations(path, on_bad_record="skip", skipped=skipped))) == good_before + 1
        assert len(skipped) == 1


MISTRAL = AutoTokenizer.from_pretrained("pgs/assets/quickstart/tokenizer")
MISTRAL.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]})


@FAST
@given(conversations(), st.sampled_from(["mistral-v3", "mistral-v7"]), st.lists(st.booleans(), min_size=3, max_size=3))
def test_prefix_diffing_trains_exactly_the_weighted_assistant_turns(messages, template, weights):
    """Templates whose add_generation_prompt adds nothing: for any conversation and any 0/1
    weights, the trained runs are the assistant texts of weight 1, each ending with </s>."""
    from pgs.runtime.data.chat import assistant_spans
    from pgs.runtime.data.templates import apply_chat_template, resolve_chat_template

    apply_chat_template(MISTRAL, resolve_chat_template(template))
    turns = [m for m in messages if m["role"] == "assistant"]
    for turn, weight in zip(turns, weights):
        turn["weight"] = int(weight)
    text, spans = assistant_spans(MISTRAL, messages)
    lead = " " if template == "mistral-v3" else ""
    assert [text[a:b] for a, b in spans] == [lead + m["content"] + "</s>" for m in turns if m["weight"]]
