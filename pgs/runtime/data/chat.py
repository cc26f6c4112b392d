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

An *empty* assistant turn (no content, no tool calls, no reasoning) is not trained: left in,
it would teach the model to end its turn at once, the only token it holds being the
end-of-turn marker.  Its tokens stay as context; :func:`empty_assistant_turns` counts them
(``DataStats.empty_assistant_turns``).

A template that opens an assistant turn with an empty think block (``<think>\\n\\n</think>``)
gets that block left out of the mask unless ``supervise_empty_think`` is asked for: the model
should not learn to emit empty reasoning.

Tokens are mapped to spans through the fast tokenizer's character offsets; a token is trained
when it overlaps a span (the rule ``apply_chat_template(return_assistant_tokens_mask=True)``
uses).
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Sequence

import numpy as np
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
    train_roles: Sequence[str] = ("assistant",),
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans to train on.

    ``train_roles`` with ``"tool"`` adds the content of every tool message (ECHO): the first
    occurrence of that content after the assistant turn that precedes it."""
    text, spans = _assistant_spans(tokenizer, messages, tools, last_turn_only=last_turn_only,
                                   supervise_empty_think=supervise_empty_think)
    if "tool" in train_roles:
        spans = sorted(spans + tool_spans(tokenizer, text, messages, tools))
    return text, spans


def tool_spans(tokenizer, text: str, messages: list[dict[str, Any]], tools: list[dict] | None = None
               ) -> list[tuple[int, int]]:
    """The character spans of the tool messages' contents in the rendered ``text``.

    Each is searched for after the end of the assistant turn before it (the tool call: the
    template's generation span or turn markers) and after the previous tool result.  A tool content the template does not render verbatim raises
    ``TemplateProblem``: silently not training it would not be what ``train_roles`` asked for.
    """
    spans: list[tuple[int, int]] = []
    template = chat_template_of(tokenizer)
    if GENERATION_MARKER.search(template):
        turns = [tuple(t) for t in _render(tokenizer, template, messages, tools, spans=True)[1]]
    else:
        header, end = turn_markers(tokenizer, template)
        turns = _spans_from_markers(text, header, end, sum(m.get("role") == "assistant" for m in messages))
    cursor, seen = 0, 0
    for m in messages:
        if m.get("role") == "assistant":
            if turns is not None and seen < len(turns):
                cursor = max(cursor, turns[seen][1])
            seen += 1
        elif m.get("role") == "tool" and (m.get("content") or "").strip():
            content = m["content"]
            at = text.find(content, cursor)
            if at < 0:
                raise TemplateProblem("a tool result is not rendered verbatim by the chat template; "
                                      "data.train_roles cannot train it")
            spans.append((at, at + len(content)))
            cursor = at + len(content)
    return spans


def _assistant_spans(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    *,
    last_turn_only: bool = False,
    supervise_empty_think: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
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
    turns = [m for m in messages if m.get("role") == "assistant"]
    if len(spans) == len(turns):  # one span per assistant turn, in order: leave the empty ones out
        pairs = list(zip(spans, turns))[-1:] if last_turn_only else list(zip(spans, turns))
        return text, [span for span, turn in pairs if not is_empty_turn(turn)]
    if last_turn_only:
        spans = spans[-1:]
    return text, spans


def is_empty_turn(message: dict[str, Any]) -> bool:
    """An assistant message with nothing to learn: no content, tool calls or reasoning."""
    return (message.get("role") == "assistant" and not message.get("tool_calls")
            and not str(message.get("content") or "").strip()
            and not str(message.get("reasoning_content") or "").strip())


def empty_assistant_turns(messages: list[dict[str, Any]], last_turn_only: bool = False) -> int:
    """How many of the assistant turns that would be trained are empty (and so are not)."""
    turns = [m for m in messages if m.get("role") == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    return sum(is_empty_turn(m) for m in turns)


def encode_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    *,
    last_turn_only: bool = False,
    supervise_empty_think: bool = False,
    train_roles: Sequence[str] = ("assistant",),
) -> tuple[list[int], list[bool]]:
    """Tokenize a conversation with its chat template; return ``(input_ids, train_mask)``.

    ``train_mask[i]`` is True when token ``i`` belongs to an assistant turn (content, tool
    calls, end-of-turn token).  ``last_turn_only`` trains the last assistant turn only;
    ``supervise_empty_think`` also trains an empty think block a template inserts;
    ``train_roles`` with ``"tool"`` also trains the tool results' content (ECHO).

    Example::

        ids, mask = encode_chat(tok, [{"role": "user", "content": "2+2?"},
                                      {"role": "assistant", "content": "4"}])
        tok.decode([t for t, m in zip(ids, mask) if m])   # '4<|im_end|>'
    """
    text, spans = assistant_spans(
        tokenizer, messages, tools, last_turn_only=last_turn_only, supervise_empty_think=supervise_empty_think,
        train_roles=train_roles,
    )
    ((ids, offsets),) = _tokenize(tokenizer, [text])
    return ids, train_mask(offsets, spans).tolist()


def encode_chats(
    tokenizer,
    conversations: Sequence[tuple[list[dict[str, Any]], list[dict] | None]],
    *,
    last_turn_only: bool = False,
    supervise_empty_think: bool = False,
    train_roles: Sequence[str] = ("assistant",),
) -> list[tuple[list[int], list[bool]] | Exception]:
    """:func:`encode_chat` of many ``(messages, tools)`` at once: equal results, one batch call.

    The texts are rendered one by one and tokenized in one batch (the fast tokenizer's
    ``encode_batch``, parallel over documents where the tokenizer has threads).  A
    conversation that fails (a template that refuses it) gives its exception in its place
    instead of raising, so that the caller meets the failures in order, as it would calling
    :func:`encode_chat` on each.
    """
    out: list[Any] = []
    texts: list[str] = []
    for messages, tools in conversations:
        try:
            text, spans = assistant_spans(
                tokenizer, messages, tools, last_turn_only=last_turn_only,
                supervise_empty_think=supervise_empty_think, train_roles=train_roles,
            )
        except Exception as err:  # noqa: BLE001 - handed back in its place, raised by the caller
            out.append(err)
            continue
        out.append(spans)
        texts.append(text)
    encoded = iter(_tokenize(tokenizer, texts)) if texts else iter(())
    for i, item in enumerate(out):
        if not isinstance(item, Exception):
            ids, offsets = next(encoded)
            out[i] = (ids, train_mask(offsets, item).tolist())
    return out


def train_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Which tokens overlap a span: ``offsets`` is ``[n, 2]`` (character start, stop per token).

    The rule of a scan that walks the tokens and the sorted spans together (the rule
    ``apply_chat_template(return_assistant_tokens_mask=True)`` uses): token ``i`` belongs to
    the first span that ends after the furthest token start seen so far, when the token ends
    after that span starts and is not empty.  Vectorised: the span index of every token is a
    search of the running maximum of the starts in the running maximum of the span ends.
    """
    n = len(offsets)
    if n == 0 or not len(spans):
        return np.zeros(n, dtype=bool)
    span = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    starts, stops = offsets[:, 0], offsets[:, 1]
    k = np.searchsorted(np.maximum.accumulate(span[:, 1]), np.maximum.accumulate(starts), side="right")
    inside = k < len(span)
    opens = span[np.minimum(k, len(span) - 1), 0]
    return inside & (stops > opens) & (stops > starts)


def _offsets(pairs) -> np.ndarray:
    flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
    return flat.reshape(-1, 2)


_WRAPPER_METHODS = ("__call__", "_call_one", "encode_plus", "batch_encode_plus", "_encode_plus",
                    "_batch_encode_plus", "set_truncation_and_padding")
_plain_wrapper: dict[type, bool] = {}


def _backend(tokenizer):
    """The Rust tokenizer behind a stock HF fast tokenizer, when calling it directly gives
    exactly what ``tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)``
    gives: the wrapper's encoding methods are the stock ones (no subclass adds its own
    processing), no padding or truncation is configured on the Rust tokenizer (the wrapper
    would switch them off first), and special tokens are split as the wrapper would set it.
    ``None`` otherwise: the wrapper is called, which is always right, only slower."""
    kind = type(tokenizer)
    plain = _plain_wrapper.get(kind)
    if plain is None:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:  # pragma: no cover - transformers is a dependency
            plain = False
        else:
            plain = issubclass(kind, PreTrainedTokenizerFast) and all(
                getattr(kind, name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in _WRAPPER_METHODS
            )
        _plain_wrapper[kind] = plain
    backend = getattr(tokenizer, "_tokenizer", None)
    if not plain or backend is None:
        return None
    try:
        if backend.padding is not None or backend.truncation is not None:
            return None
        if bool(backend.encode_special_tokens) != bool(getattr(tokenizer, "split_special_tokens", False)):
            return None
    except AttributeError:  # an older tokenizers without these properties
        return None
    return backend


def _tokenize(tokenizer, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
    """``(input_ids, offsets [n, 2])`` of each text, without special tokens added."""
    backend = _backend(tokenizer)
    if backend is not None:
        return [(e.ids, _offsets(e.offsets)) for e in backend.encode_batch(texts, add_special_tokens=False)]
    out = []
    for text in texts:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append((list(encoded["input_ids"]), _offsets(encoded["offset_mapping"])))
    return out
