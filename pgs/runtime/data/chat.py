"""Chat tokenization with an assistant mask that covers whole assistant turns.

A token is *trained* when it belongs to an assistant turn: its content, its tool calls and
the end-of-turn token, so that the model learns to stop.  The turns are found in the text
that the chat template renders (the tokenizer's own, or ``data.chat_template``), in one of
three ways:

* the template has ``{% generation %}`` markers: the spans they enclose;
* a stock template without them whose ``add_generation_prompt`` opens an assistant turn
  (Qwen3, Llama 3, Gemma 3, Phi-4, DeepSeek-R1, ChatML): the template's own turn markers, read
  off two probe renders.  The *assistant header* is what ``add_generation_prompt=True``
  appends; the *end-of-turn marker* is what the template writes right after an assistant
  message's text.  Every assistant turn in the full render starts after a header and ends
  after the first end-of-turn marker that follows.  When the markers miss a turn (a template
  that writes no header after tool outputs, as DeepSeek-R1's), prefix diffing below is tried;
* a template whose ``add_generation_prompt`` adds nothing (Mistral's ``[INST]`` templates:
  the assistant's text follows ``[/INST]`` directly): *prefix diffing*.  The span of
  assistant turn ``k`` is what rendering the first ``k + 1`` messages adds to the render of
  the first ``k``, less the constant text every assistant turn opens with and the whitespace
  after its end-of-turn token.  This needs a prefix-stable template: each of those renders
  must be a prefix of the next and of the whole conversation's; one that is not (a template
  that moves the system prompt into the *last* user turn) is refused with one line naming
  the template, never masked wrongly.

An *empty* assistant turn (no content, no tool calls, no reasoning) is not trained: left in,
it would teach the model to end its turn at once, the only token it holds being the
end-of-turn marker.  Its tokens stay as context; :func:`empty_assistant_turns` counts them
(``DataStats.empty_assistant_turns``).  An assistant turn with ``weight = 0`` (the per-message
weight of TRL and axolotl data) is context too (``DataStats.weight_zero_turns``).

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
        raise TemplateProblem("the tokenizer has no chat template (set tokenizer.chat_template, or data.chat_template "
                              "in the spec)")
    return template


def template_name(tokenizer) -> str:
    """How error messages name the template: ``data.chat_template``'s value when the spec set one."""
    named = getattr(tokenizer, "pgs_chat_template_name", None)
    if named:
        return f"chat template {named}"
    where = getattr(tokenizer, "name_or_path", "") or ""
    return f"the chat template of {where}" if where else "the tokenizer's chat template"


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


def _key(tokenizer, template: str) -> tuple:
    return template, tuple(sorted((getattr(tokenizer, "special_tokens_map", {}) or {}).items(), key=str))


def assistant_header(tokenizer, template: str | None = None) -> str:
    """What ``add_generation_prompt=True`` appends to a conversation: the assistant header, or
    ``""`` for a template whose assistant turns follow the user turn directly (Mistral)."""
    template = template or chat_template_of(tokenizer)
    key = ("header",) + _key(tokenizer, template)
    if key not in _markers_cache:
        user = [{"role": "user", "content": _PROBE_USER}]
        bare, _ = _render(tokenizer, template, user)
        prompted, _ = _render(tokenizer, template, user, add_generation_prompt=True)
        _markers_cache[key] = prompted[len(bare):] if prompted.startswith(bare) else ""
    return _markers_cache[key]


def turn_markers(tokenizer, template: str | None = None) -> tuple[str, str]:
    """The template's assistant header and end-of-turn marker, read off probe renders."""
    template = template or chat_template_of(tokenizer)
    key = _key(tokenizer, template)
    if key in _markers_cache:
        return _markers_cache[key]
    header = assistant_header(tokenizer, template)
    if not header:
        raise TemplateProblem("cannot find the assistant header: add_generation_prompt adds nothing")
    user = [{"role": "user", "content": _PROBE_USER}]
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


class NoEndOfTurn(TemplateProblem):
    """A template that ends an assistant turn with nothing of its own (GLM-4.5's shape)."""


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


def _assistant_lead(tokenizer, template: str, name: str) -> str:
    """The text a template writes before every assistant message's own text (``""`` for
    Mistral's templates; a role line for a template that only opens a turn once it has one)."""
    key = ("lead",) + _key(tokenizer, template)
    if key not in _markers_cache:
        user = [{"role": "user", "content": _PROBE_USER}]
        before, _ = _render(tokenizer, template, user)
        after, _ = _render(tokenizer, template, user + [{"role": "assistant", "content": _PROBE_ASSISTANT}])
        if not after.startswith(before):
            raise TemplateProblem(f"{name} is not prefix-stable: a user turn renders differently once an assistant "
                                  "turn follows it, so its assistant turns cannot be found by diffing; add "
                                  "{% generation %} markers or set data.chat_template")
        at = after.find(_PROBE_ASSISTANT, len(before))
        if at < 0:
            raise TemplateProblem(f"{name} does not render assistant content")
        if not after[at + len(_PROBE_ASSISTANT):].strip():
            # GLM-4.5's shape: the next turn's role token ends a turn; trained as it is, the
            # model would never learn to end a reply
            raise NoEndOfTurn(f"{name} writes nothing after an assistant turn's text (no end-of-turn token: the "
                                  "next turn's role token ends it), so no end of reply would train; set "
                                  f"data.chat_template (a template pgs ships: {', '.join(shipped_names())})")
        _markers_cache[key] = after[len(before):at]
    return _markers_cache[key]


def _spans_by_prefix(tokenizer, template: str, messages, tools) -> tuple[str, list[tuple[int, int]]]:
    """Assistant spans by prefix diffing: turn ``k`` is what rendering ``messages[:k + 1]`` adds
    to the render of ``messages[:k]``; each render must be a prefix of the next and of the whole."""
    name = template_name(tokenizer)
    lead = _assistant_lead(tokenizer, template, name)
    full, _ = _render(tokenizer, template, messages, tools)
    renders: dict[int, str] = {len(messages): full}

    def render(n: int) -> str:
        if n not in renders:
            renders[n] = _render(tokenizer, template, messages[:n], tools)[0] if n else ""
        return renders[n]

    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, after = render(k), render(k + 1)
        if not after.startswith(before) or not full.startswith(after):
            shorter, longer = (k, k + 1) if not after.startswith(before) else (k + 1, len(messages))
            raise TemplateProblem(
                f"{name} is not prefix-stable: the render of the first {shorter} messages is not a prefix of the "
                f"render of the first {longer}, so assistant turn {k} cannot be found by diffing; add "
                "{% generation %} markers or set data.chat_template (a template pgs ships: "
                f"{', '.join(shipped_names())})")
        start, stop = len(before), len(after)
        if lead.strip() and full.startswith(lead, start):
            start += len(lead)
        while stop > start and full[stop - 1].isspace():  # whitespace after the end-of-turn token
            stop -= 1
        spans.append((start, stop))
    return full, spans


def shipped_names() -> list[str]:
    from pgs.runtime.data.templates import shipped_templates

    return sorted(shipped_templates())


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
    text, turns = _turn_spans(tokenizer, messages, tools)
    spans = _trained_spans(tokenizer, text, turns, messages, last_turn_only, supervise_empty_think)
    if "tool" in train_roles:
        spans = sorted(spans + tool_spans(text, messages, turns))
    return text, spans


def tool_spans(text: str, messages: list[dict[str, Any]], turns: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character spans of the tool messages' contents in the rendered ``text``.

    Each is searched for after the assistant turn before it (the tool call; ``turns`` are the
    template's assistant spans, one per assistant message when the template marks them all)
    and after the previous tool result.  A tool content the template does not render verbatim
    raises ``TemplateProblem``: silently not training it is not what ``train_roles`` asked for.
    """
    spans: list[tuple[int, int]] = []
    n_assistant = sum(m.get("role") == "assistant" for m in messages)
    cursor, seen = 0, 0
    for m in messages:
        if m.get("role") == "assistant":
            if len(turns) == n_assistant:
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


def _turn_spans(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None
                ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the template's assistant spans (untrimmed, every turn)."""
    template = chat_template_of(tokenizer)
    n_assistant = sum(m.get("role") == "assistant" for m in messages)
    if GENERATION_MARKER.search(template):
        text, spans = _render(tokenizer, template, messages, tools, spans=True)
        spans = [tuple(s) for s in spans]
    elif assistant_header(tokenizer, template):
        header, end = turn_markers(tokenizer, template)
        text, _ = _render(tokenizer, template, messages, tools)
        try:
            spans = _spans_from_markers(text, header, end, n_assistant)
        except TemplateProblem as err:
            # a turn the markers miss (DeepSeek-R1 writes no header after tool outputs): prefix
            # diffing finds it when the template is prefix-stable; otherwise the markers' error
            try:
                text, spans = _spans_by_prefix(tokenizer, template, messages, tools)
            except NoEndOfTurn:
                raise
            except TemplateProblem:
                raise err from None
    else:
        text, spans = _spans_by_prefix(tokenizer, template, messages, tools)
    return text, spans


def _trained_spans(tokenizer, text: str, spans: list[tuple[int, int]], messages: list[dict[str, Any]],
                   last_turn_only: bool, supervise_empty_think: bool) -> list[tuple[int, int]]:
    """The assistant spans that train: empty think blocks trimmed, untrained turns left out."""
    if not supervise_empty_think:
        trimmed = []
        for start, stop in spans:
            empty = EMPTY_THINK.match(text, start)
            if empty and empty.end() < stop:
                start = empty.end()
            trimmed.append((start, stop))
        spans = trimmed
    turns = [m for m in messages if m.get("role") == "assistant"]
    if len(spans) == len(turns):  # one span per assistant turn, in order: leave the untrained ones out
        pairs = list(zip(spans, turns))[-1:] if last_turn_only else list(zip(spans, turns))
        return [span for span, turn in pairs if is_trained_turn(turn)]
    if any(t.get("weight", 1) == 0 for t in turns):
        raise TemplateProblem(
            f"{template_name(tokenizer)} marks {len(spans)} assistant spans for {len(turns)} assistant turns, so "
            "the turns with weight 0 cannot be left untrained")
    if last_turn_only:
        spans = spans[-1:]
    return spans


def document_spans(tokenizer, text: str) -> tuple[str, list[tuple[int, int]]]:
    """A ``{"text": ...}`` document: the tokenizer's bos token (when it has one), the text and
    its eos token (so that the model learns where a document ends), every token but the bos
    trained."""
    bos = getattr(tokenizer, "bos_token", None) or ""
    eos = getattr(tokenizer, "eos_token", None) or ""
    full = bos + text + ("" if eos and text.endswith(eos) else eos)
    return full, [(len(bos), len(full))]


def _spans(tokenizer, content, tools, **options) -> tuple[str, list[tuple[int, int]]]:
    if isinstance(content, str):
        return document_spans(tokenizer, content)
    return assistant_spans(tokenizer, content, tools, **options)


def is_trained_turn(message: dict[str, Any]) -> bool:
    """An assistant turn that trains: not empty, and not given ``weight = 0``."""
    return message.get("weight", 1) != 0 and not is_empty_turn(message)


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
    return sum(is_empty_turn(m) and m.get("weight", 1) != 0 for m in turns)


def weight_zero_turns(messages: list[dict[str, Any]], last_turn_only: bool = False) -> int:
    """How many of the assistant turns that would be trained have ``weight = 0`` (context only)."""
    turns = [m for m in messages if m.get("role") == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    return sum(m.get("weight", 1) == 0 for m in turns)


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
    calls, end-of-turn token).  ``messages`` may be a string: a ``text`` document, trained
    whole (:func:`document_spans`).  ``last_turn_only`` trains the last assistant turn only;
    ``supervise_empty_think`` also trains an empty think block a template inserts;
    ``train_roles`` with ``"tool"`` also trains the tool results' content (ECHO).

    Example::

        ids, mask = encode_chat(tok, [{"role": "user", "content": "2+2?"},
                                      {"role": "assistant", "content": "4"}])
        tok.decode([t for t, m in zip(ids, mask) if m])   # '4<|im_end|>'
    """
    text, spans = _spans(
        tokenizer, messages, tools, last_turn_only=last_turn_only, supervise_empty_think=supervise_empty_think,
        train_roles=train_roles,
    )
    ((ids, offsets),) = tokenize_texts(tokenizer, [text])
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
            text, spans = _spans(
                tokenizer, messages, tools, last_turn_only=last_turn_only,
                supervise_empty_think=supervise_empty_think, train_roles=train_roles,
            )
        except Exception as err:  # noqa: BLE001 - handed back in its place, raised by the caller
            out.append(err)
            continue
        out.append(spans)
        texts.append(text)
    encoded = iter(tokenize_texts(tokenizer, texts)) if texts else iter(())
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


def tokenize_texts(tokenizer, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
    """``(input_ids, offsets [n, 2])`` of each text, without special tokens added."""
    backend = _backend(tokenizer)
    if backend is not None:
        return [(e.ids, _offsets(e.offsets)) for e in backend.encode_batch(texts, add_special_tokens=False)]
    out = []
    for text in texts:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out.append((list(encoded["input_ids"]), _offsets(encoded["offset_mapping"])))
    return out
