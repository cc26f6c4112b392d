"""The repository is self-contained: nothing in it cites a file outside it, and every
``docs/...md`` that the source names exists.

A user who clones pgs gets its equations, papers and measurements in ``docs/`` (the techniques
in ``docs/techniques/``, the figures of particular machines in ``docs/performance.md``); a
reference to a file that only existed beside the repository (a notes file, a design folder)
would send them nowhere.  The scan covers every tracked text file (``git ls-files``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

#: Names of files outside the repository, and the phrases that pointed at them.  Written as
#: pieces so that this file does not match its own patterns.
OUTSIDE = [
    (re.compile(r"\b" + "EQUA" + r"TIONS\b"), "the equations notes file"),
    (re.compile(r"\b" + "ANCH" + r"ORS\b"), "the peers' numbers notes file"),
    (re.compile(r"\b" + "STY" + r"LE\.md\b"), "the style notes file"),
    (re.compile(r"\.\./" + "shared" + r"\b"), "a folder beside the repository"),
    (re.compile(r"\b" + "shared" + r"/(docs|design|hooks)\b"), "a folder beside the repository"),
    (re.compile(r"/work/" + "shared" + r"\b"), "a folder beside the repository"),
    (re.compile(r"\b" + "design" + r"/0\d\d"), "a design file beside the repository"),
    (re.compile(r"(?i)\b" + "design" + r"[ -](documents?|brief)\b"), "the design notes beside the repository"),
]

#: ``docs/<path>.md`` named in text (not part of a longer path such as ``bench/docs/...``).
DOC_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]*?\.md\b")
#: A relative Markdown link to a ``.md`` file: ``[text](path.md#anchor)``.
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(#[^)]*)?\)")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary (or missing: deleted, not yet committed) file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def _texts(suffix: str, top: str | None = None):
    """``(path relative to the root, text)`` of every tracked text file ending in ``suffix``
    (below the top folder ``top``, when given)."""
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if path.suffix != suffix or (top is not None and rel.parts[0] != top):
            continue
        text = _text(path)
        if text is not None:
            yield rel, text


def _lines_matching(text: str, pattern: re.Pattern) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_no_reference_to_files_outside_the_repository():
    found = []
    for path in _tracked():
        if path.resolve() == THIS:
            continue
        text = _text(path)
        if text is None:
            continue
        for pattern, what in OUTSIDE:
            if not pattern.search(text):
                continue
            for n in _lines_matching(text, pattern):
                found.append(f"{path.relative_to(ROOT)}:{n}: cites {what} ({pattern.pattern})")
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def test_docs_named_by_the_source_exist():
    missing = []
    for rel, text in _texts(".py", "pgs"):
        for n, line in enumerate(text.splitlines(), 1):
            for m in DOC_PATH.finditer(line):
                if not (ROOT / m.group(0)).is_file():
                    missing.append(f"{rel}:{n}: {m.group(0)} does not exist")
    assert not missing, "\n".join(missing)


def test_links_between_docs_resolve():
    missing = []
    for rel, text in _texts(".md"):
        for n, line in enumerate(text.splitlines(), 1):
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if "://" in target:
                    continue
                if not (ROOT / rel.parent / target).resolve().is_file():
                    missing.append(f"{rel}:{n}: link to {target} does not resolve")
            if rel.parts[0] == "docs":
                for m in DOC_PATH.finditer(line):
                    if not (ROOT / m.group(0)).is_file():
                        missing.append(f"{rel}:{n}: {m.group(0)} does not exist")
    assert not missing, "\n".join(missing)


#: A particular machine named in source: its figures belong in docs/performance.md.
MACHINE = re.compile(r"\b(H100|H200|A100|RTX ?\d{4})\b")


def test_source_names_no_particular_machine():
    found = [f"{rel}:{n}" for rel, text in _texts(".py", "pgs") for n in _lines_matching(text, MACHINE)]
    assert not found, "machine figures belong in docs/performance.md, not in source:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line, cites",
    [
        ("see " + "EQUA" + "TIONS.md A3", True),
        ("(" + "ANCH" + "ORS.md, 4B feasibility)", True),
        ("../" + "shared/docs/x.md", True),
        ("design" + "/001", True),
        ("the " + "design" + " documents' definition", True),
        ("arXiv 2302.06675; docs/techniques/lion.md", False),
        ("../runs/quickstart", False),
    ],
)
def test_patterns_tell_outside_references_from_inside_ones(line, cites):
    """The scan itself: it flags the old citations and passes a citation inside the repository."""
    assert any(p.search(line) for p, _ in OUTSIDE) is cites
