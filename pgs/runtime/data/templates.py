"""Chat templates pgs ships for training, and ``data.chat_template``: a Jinja file or one of them.

A model's own template is written for inference; some cannot be masked for training (Mistral's
stock v3 template moves the system prompt into the *last* user turn, so a conversation's
prefixes do not render to prefixes of it).  ``data.chat_template`` replaces the tokenizer's
template for the whole run, masks, evaluation and the exported tokenizer alike: a path to a
Jinja file, or the name of a template in ``pgs/assets/templates`` (``chatml``, ``glm4``,
``mistral-v3``, ``mistral-v7``).
"""

from __future__ import annotations

import os
from pathlib import Path

from pgs.errors import SpecError

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "assets" / "templates"


def shipped_templates() -> dict[str, Path]:
    """The training templates pgs ships, by name."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.jinja"))}


def resolve_chat_template(value, base: Path | str | None = None) -> str:
    """``data.chat_template``'s file: a shipped template's name, or a path (relative to ``base``)."""
    if not isinstance(value, str) or not value:
        raise SpecError(f"data.chat_template: expected a Jinja file or a template pgs ships, got {value!r}")
    shipped = shipped_templates()
    if value in shipped:
        return str(shipped[value])
    path = Path(os.path.expanduser(value))
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    if not path.is_file():
        raise SpecError(f"data.chat_template: {value!r} is neither a file nor a template pgs ships "
                        f"({', '.join(shipped)})")
    return str(path)


def read_chat_template(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"data.chat_template: cannot read {path} ({getattr(err, 'strerror', None) or err})") from None
    if not text.strip():
        raise SpecError(f"data.chat_template: {path} is empty")
    return text


def apply_chat_template(tokenizer, chat_template: str | None):
    """Give ``tokenizer`` the template of ``data.chat_template`` (a resolved path; ``None``: keep
    the tokenizer's own).  Returns the tokenizer."""
    if chat_template is None:
        check_template(getattr(tokenizer, "chat_template", None), "the tokenizer's chat template (model.tokenizer)")
        return tokenizer
    tokenizer.chat_template = read_chat_template(chat_template)
    check_template(tokenizer.chat_template, f"data.chat_template: {chat_template}")
    shipped = {str(p): name for name, p in shipped_templates().items()}
    tokenizer.pgs_chat_template_name = shipped.get(str(chat_template), str(chat_template))
    return tokenizer


def check_template(text, where: str) -> None:
    """``SpecError`` naming the template and its line when ``text`` does not compile as the
    Jinja transformers renders (before, the error surfaced at the first record and was blamed on
    it, or with ``on_bad_record = "skip"`` skipped every record)."""
    if not isinstance(text, str):
        return  # none, or several named templates (checked when one is rendered)
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise SpecError(f"{where}:{err.lineno}: Jinja syntax error: {err.message}") from None
