"""tokenizer_mismatch: the first id, special token or rendered template where a teacher's
tokenizer differs from the student's (the quickstart tokenizer, altered one way at a time)."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from pgs.runtime.model.compat import tokenizer_mismatch

TOKENIZER = os.path.join("pgs", "assets", "quickstart", "tokenizer")


def load():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def student():
    return load()


def test_the_same_tokenizer_matches(student):
    assert tokenizer_mismatch(student, load()) is None
    records = [{"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]}]
    assert tokenizer_mismatch(student, load(), records) is None


def test_an_added_token_is_named_by_its_id(student):
    teacher = load()
    teacher.add_tokens(["<extra_thing>"])
    msg = tokenizer_mismatch(student, teacher)
    assert msg == f"vocabulary differs at token id {len(student)}: student no token, teacher '<extra_thing>'"


def test_a_different_special_token_is_named(student):
    teacher = load()
    teacher.pad_token = teacher.eos_token if teacher.pad_token != teacher.eos_token else teacher.unk_token
    msg = tokenizer_mismatch(student, teacher)
    assert msg.startswith("special token pad_token differs: student "), msg


def test_a_different_template_names_the_conversation_and_the_text(student):
    teacher = load()
    teacher.chat_template = student.chat_template.replace("<|im_start|>", "<|im_start|> ")
    msg = tokenizer_mismatch(student, teacher)
    assert msg.startswith("chat rendering of sample conversation 0 differs at character 12: "), msg
    assert "student" in msg and "teacher" in msg


def test_a_template_that_differs_only_on_a_run_record_is_caught(student):
    teacher = load()
    # the teacher's template rewrites one word that only the run's own record contains
    teacher.chat_template = "{% for m in messages %}{{ m['content'] | replace('zebra', 'horse') }}{% endfor %}"
    twin = load()
    twin.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_mismatch(twin, teacher) is None
    record = {"messages": [{"role": "user", "content": "a zebra?"}, {"role": "assistant", "content": "yes"}]}
    msg = tokenizer_mismatch(twin, teacher, [record])
    assert msg.startswith("chat rendering of sample conversation 4 differs at character 2"), msg
