"""Chat tokenization with an assistant mask that covers whole assistant turns.

A token is *trained* when it belongs to an assistant turn: its content, its tool calls and
the end-of-turn token, so that the model learns to stop.  The turns are found in the text
that the tokenizer's own chat template renders, in one of two ways:

* the template has ``{% generation %}`` markers: the spans they enclose;
* a stock template without them (Qwen3, Llama 3, most ChatML templates): the template's own
  turn markers, read off two probe renders.  The *assistant header* is what
  ``add_generation_prompt=True`` appends; the *end-of-turn marker* is what the template writes
  right after an assistant message's text.  Every assistant turn in the full render starts
  after a header and ends after the first end-of-turn marker that follows.

A template that opens an assistant turn with an empty think block (``<think>\\n\\n</think>``)
gets that block left out of the mask unless ``supervise_empty_think`` is asked for: the model
should not learn to emit empty reasoning.

Tokens are mapped to spans through the fast tokenizer's character offsets; a token is trained
when it overlaps a span (the rule ``apply_chat_template(return_assistant_tokens_mask=True)``
uses).
"""

from __future__ import annotations

import re
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from pgs.errors import DataError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")
_PROBE_USER = "pgs-probe-user-7c1e"
_PROBE_ASSISTANT = "pgs-probe-assistant-52b9"

_markers_cache: dict[tuple, tuple[str, str]] = {}


class TemplateProblem(DataError):
    """The chat template failed to render, or its assistant turns could not be located."""


def chat_template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise TemplateProblem("the tokenizer has no chat template (set tokenizer.chat_template)")
    return template


def _render(tokenizer, template: str, messages, tools=None, *, add_generation_prompt=False, spans=False):
    kwargs = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
    try:
        rendered, indices = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template,
            return_assistant_tokens_mask=spans,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as err:  # jinja's own exceptions (raise_exception, TemplateError, ...)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TemplateProblem(f"the chat template refused this conversation: {first}") from None
    return rendered[0], (indices[0] if spans else None)


def turn_markers(tokenizer, template: str | None = None) -> tuple[str, str]:
    """The template's assistant header and end-of-turn marker, read off probe renders."""
    template = template or chat_template_of(tokenizer)
    key = (template, tuple(sorted((getattr(tokenizer, "special_tokens_map", {}) or {}).items(), key=str)))
    if key in _markers_cache:
        return _markers_cache[key]
    user = [{"role": "user", "content": _PROBE_USER}]
    bare, _ = _render(tokenizer, template, user)
    prompted, _ = _render(tokenizer, template, user, add_generation_prompt=True)
    if not prompted.startswith(bare) or len(prompted) == len(bare):
        raise TemplateProblem("cannot find the assistant header: add_generation_prompt adds nothing")
    header = prompted[len(bare):]
    full, _ = _render(tokenizer, template, user + [{"role": "assistant", "content": _PROBE_ASSISTANT}])
    at = full.find(_PROBE_ASSISTANT)
    if at < 0:
        raise TemplateProblem("the chat template does not render assistant content")
    end = full[at + len(_PROBE_ASSISTANT):].rstrip()
    if not end:
        end = getattr(tokenizer, "eos_token", None) or ""
    if not end:
        raise TemplateProblem("cannot find the end-of-turn marker of assistant turns")
    _markers_cache[key] = (header, end)
    return header, end


def _spans_from_markers(text: str, header: str, end: str, n_assistant: int) -> list[tuple[int, int]]:
    spans = []
    cursor = 0
    while True:
        at = text.find(header, cursor)
        if at < 0:
            break
        start = at + len(header)
        stop = text.find(end, start)
        if stop < 0:
            raise TemplateProblem("an assistant turn has no end-of-turn marker in the rendered text")
        spans.append((start, stop + len(end)))
        cursor = stop + len(end)
    if len(spans) != n_assistant:
        raise TemplateProblem(
            f"found {len(spans)} assistant turns in the rendered template, expected {n_assistant}"
        )
    return spans


def assistant_spans(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    *,
    last_turn_only: bool = False,
    supervise_empty_think: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans to train on."""
    template = chat_template_of(tokenizer)
    n_assistant = sum(m.get("role") == "assistant" for m in messages)
    if GENERATION_MARKER.search(template):
        text, spans = _render(tokenizer, template, messages, tools, spans=True)
        spans = [tuple(s) for s in spans]
    else:
        header, end = turn_markers(tokenizer, template)
        text, _ = _render(tokenizer, template, messages, tools)
        spans = _spans_from_markers(text, header, end, n_assistant)
    if not supervise_empty_think:
        trimmed = []
        for start, stop in spans:
            empty = EMPTY_THINK.match(text, start)
            if empty and empty.end() < stop:
                start = empty.end()
            trimmed.append((start, stop))
        spans = trimmed
    if last_turn_only:
        spans = spans[-1:]
    return text, spans


def encode_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    *,
    last_turn_only: bool = False,
    supervise_empty_think: bool = False,
) -> tuple[list[int], list[bool]]:
    """Tokenize a conversation with its chat template; return ``(input_ids, train_mask)``.

    ``train_mask[i]`` is True when token ``i`` belongs to an assistant turn (content, tool
    calls, end-of-turn token).  ``last_turn_only`` trains the last assistant turn only;
    ``supervise_empty_think`` also trains an empty think block a template inserts.

    Example::

        ids, mask = encode_chat(tok, [{"role": "user", "content": "2+2?"},
                                      {"role": "assistant", "content": "4"}])
        tok.decode([t for t, m in zip(ids, mask) if m])   # '4<|im_end|>'
    """
    text, spans = assistant_spans(
        tokenizer, messages, tools, last_turn_only=last_turn_only, supervise_empty_think=supervise_empty_think
    )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [False] * len(ids)
    k = 0
    for i, (start, stop) in enumerate(encoded["offset_mapping"]):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if stop > spans[k][0] and stop > start:
            mask[i] = True
    return ids, mask
