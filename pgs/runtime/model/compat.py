"""Whether a teacher's tokenizer speaks exactly the student's language (distillation).

Token-level distillation compares the two models' distributions id by id, on token ids that
the student's tokenizer and chat template produced.  If the teacher maps an id to another
string, or renders a conversation differently, the loss is computed, finite and silently
wrong (the failure that TRL's GKD users report when tokenizers differ).  So before a run the
two tokenizers must agree on

1. the vocabulary: the same token for every id (added tokens included);
2. the special tokens: eos, bos, pad, unk and the additional special tokens, with their ids;
3. chat rendering: a few sample conversations (plain, with a system prompt, multi-turn, a
   tool call, and the run's own records when given) render to the same text, with and
   without the generation prompt.

``tokenizer_mismatch`` returns the first difference as one line, or None.  The same comparison
tells whether the tokenizer a spec names is a model folder's own (``model.tokenizer`` against the
tokenizer saved beside the weights); a folder that ships no tokenizer is checked against the ids
its configuration names (``config_special_mismatch``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

#: Conversations every check renders (the run adds a few of its own records).
SAMPLE_CONVERSATIONS: tuple[dict, ...] = (
    {"messages": [{"role": "user", "content": "What is 47 + 58?"}, {"role": "assistant", "content": "105"}]},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]},
    {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
     "messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                  {"role": "tool", "content": "23C sunny"},
                  {"role": "assistant", "content": "Oslo: 23C, sunny."}]},
)

SPECIAL = ("eos_token", "bos_token", "pad_token", "unk_token")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _vocab_mismatch(student, teacher, names=("student", "teacher")) -> str | None:
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    s_by_id = {i: tok for tok, i in s_vocab.items()}
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    for i in sorted(set(s_by_id) | set(t_by_id)):
        a, b = s_by_id.get(i), t_by_id.get(i)
        if a != b:
            a = "no token" if a is None else _short(a)
            b = "no token" if b is None else _short(b)
            return f"vocabulary differs at token id {i}: {names[0]} {a}, {names[1]} {b}"
    if len(student) != len(teacher):
        return f"vocabulary sizes differ: {names[0]} {len(student)} tokens, {names[1]} {len(teacher)}"
    return None


def _special_mismatch(student, teacher, names=("student", "teacher")) -> str | None:
    for name in SPECIAL:
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        ia, ib = getattr(student, name + "_id", None), getattr(teacher, name + "_id", None)
        if (a, ia) != (b, ib):
            return (f"special token {name} differs: {names[0]} {_short(a)} (id {ia}), "
                    f"{names[1]} {_short(b)} (id {ib})")
    a, b = list(student.all_special_tokens), list(teacher.all_special_tokens)
    if sorted(a) != sorted(b):
        extra = sorted(set(a) ^ set(b))
        side = names[0] if extra and extra[0] in a else names[1]
        return f"special tokens differ: {_short(extra[0] if extra else a)} is special for the {side} only"
    return None


def _render(tokenizer, conversation: dict, generation_prompt: bool):
    messages = conversation["messages"]
    if generation_prompt:  # the prompt of the last assistant turn, as generation sees it
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
        messages = messages[:last]
    try:
        return tokenizer.apply_chat_template(messages, tools=conversation.get("tools"), tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as err:  # a template that cannot render this conversation: compared as such
        return ("error", type(err).__name__, str(err).splitlines()[0] if str(err) else "")


def _first_difference(a: str, b: str, names=("student", "teacher")) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, n - 20)
    return f"at character {n}: {names[0]} {_short(a[lo:n + 30])}, {names[1]} {_short(b[lo:n + 30])}"


def _template_mismatch(student, teacher, conversations: Iterable[dict], names=("student", "teacher")) -> str | None:
    if bool(getattr(student, "chat_template", None)) != bool(getattr(teacher, "chat_template", None)):
        who = names[0] if getattr(student, "chat_template", None) else names[1]
        return f"chat template: only the {who}'s tokenizer has one"
    for index, conversation in enumerate(conversations):
        for generation_prompt in (False, True):
            a, b = _render(student, conversation, generation_prompt), _render(teacher, conversation, generation_prompt)
            if a == b:
                continue
            what = (f"chat rendering of sample conversation {index}"
                    + (" (generation prompt)" if generation_prompt else ""))
            if isinstance(a, tuple) or isinstance(b, tuple):
                fail = names[0] if isinstance(a, tuple) else names[1]
                err = a if isinstance(a, tuple) else b
                return f"{what}: the {fail}'s template fails ({err[1]}: {_short(err[2])})"
            return f"{what} differs {_first_difference(a, b, names)}"
    return None


def tokenizer_mismatch(student, teacher, conversations: Sequence[dict] = (),
                       names: tuple[str, str] = ("student", "teacher")) -> str | None:
    """The first way ``teacher`` tokenizes or renders differently from ``student``, or None.

    Args:
        student, teacher: transformers tokenizers.
        conversations: extra records (``{"messages": [...], "tools": [...]}``) rendered after
            ``SAMPLE_CONVERSATIONS`` (e.g. the first records of the run's data).
        names: how the line calls the two sides (a model's own tokenizer against the spec's:
            ``("model's", "spec's")``).

    Returns:
        One line naming the first differing token id, special token or template output; None
        when they agree.
    """
    records = [c for c in conversations if isinstance(c, dict) and isinstance(c.get("messages"), list)]
    return (_vocab_mismatch(student, teacher, names) or _special_mismatch(student, teacher, names)
            or _template_mismatch(student, teacher, [*SAMPLE_CONVERSATIONS, *records], names))



def _ids(value) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def config_special_mismatch(tokenizer, config, generation_eos=None) -> str | None:
    """The first special token whose id ``tokenizer`` gives otherwise than the model's
    configuration, or None.

    eos: the tokenizer's must be one of the ids that end a reply for the model (``config.json``'s
    ``eos_token_id``, an int or a list, and ``generation_eos``, ``generation_config.json``'s);
    bos and pad: the same id where both name one.  An id the configuration leaves out is not
    compared (many configurations name no pad)."""
    config = getattr(config, "text_config", None) or config
    ends = _ids(getattr(config, "eos_token_id", None)) | _ids(generation_eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    if ends and eos is not None and eos not in ends:
        return (f"the tokenizer's eos_token {_short(tokenizer.eos_token)} is id {eos}, the model's config.json "
                f"ends a reply with id {', '.join(map(str, sorted(ends)))}")
    for name in ("bos", "pad"):
        mine, theirs = getattr(tokenizer, f"{name}_token_id", None), getattr(config, f"{name}_token_id", None)
        if isinstance(theirs, int) and mine is not None and mine != theirs:
            return (f"the tokenizer's {name}_token {_short(getattr(tokenizer, f'{name}_token', None))} is id {mine}, "
                    f"the model's config.json says {name}_token_id = {theirs}")
    return None
