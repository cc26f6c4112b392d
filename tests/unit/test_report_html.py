"""``pgs report``'s page: one self-contained HTML file with the summary, a chart per plot (inline
SVG, one line per series with every point), the sample replies (escaped) and the resolved spec,
and nothing it would have to fetch.  Rendered by a real headless browser, laid out and drawn to pixels:
tests/integration/test_report_browser.py."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from pgs.runtime.tools.report import write_report

REPLY = 'a <b>bold</b> & "quoted" reply'


class Page(HTMLParser):
    """The tags of a page, with their attributes, the text of each table cell, and the nesting."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.cells: list[str] = []
        self.pre: list[str] = []
        self.open: list[str] = []
        self._where: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID and tag not in ("polyline", "circle", "line", "rect", "path"):
            self.open.append(tag)
        if tag in ("td", "pre"):
            self._where.append(tag)
            (self.cells if tag == "td" else self.pre).append("")

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if tag in ("polyline", "circle", "line", "rect", "path"):
            return
        assert self.open and self.open[-1] == tag, (self.open[-3:], tag)
        self.open.pop()
        if tag in ("td", "pre"):
            self._where.pop()

    def handle_data(self, data):
        if self._where:
            (self.cells if self._where[-1] == "td" else self.pre)[-1] += data


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    lines = [{"event": "start", "step": 0}]
    lines += [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 2.0 / s, "entropy": 1.0} for s in range(1, 21)]
    lines += [{"step": s, "eval_loss": 4.0 / (s + 1), "eval_accuracy": s / 20} for s in (0, 10, 20)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (run / "spec.resolved.toml").write_text('[optimizer]\nalias = "adamw"\nclip = 1.0\n\n[train]\nsteps = 20\n')
    for step in (10, 20):
        rows = [{"step": step, "index": i, "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                 "reply": REPLY if step == 20 else "x", "reference": str(i + 1)} for i in range(2)]
        (run / "samples" / f"step_{step}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


def _page(tmp_path: Path) -> tuple[Path, str, Page]:
    run = _run(tmp_path)
    write_report(str(run))
    path = run / "report" / "report.html"
    text = path.read_text(encoding="utf-8")
    page = Page()
    page.feed(text)
    page.close()
    return path, text, page


def test_the_page_holds_summary_charts_samples_and_spec(tmp_path):
    _, text, page = _page(tmp_path)
    assert page.open == []  # every element closed, in order
    charts = [a for t, a in page.tags if t == "svg"]
    names = {a["aria-label"] for a in charts}
    assert {"loss", "learning rate", "gradient norm (before clipping)", "mean next-token entropy",
            "eval accuracy"} <= names
    lines = {a["data-name"]: a["points"].split() for t, a in page.tags if t == "polyline"}
    assert len(lines["loss"]) == 20 and len(lines["eval_loss"]) == 3 and len(lines["eval_accuracy"]) == 3
    # the summary's figures, the samples of both evaluations (escaped: text, not markup), the spec
    assert "<tr><th>first train loss</th><td class=\"num\">5</td></tr>" in text
    assert REPLY in page.cells and "What is 1 + 1?" in page.cells
    assert "<b>bold</b>" not in text and "&lt;b&gt;bold&lt;/b&gt;" in text
    assert text.index("step 20: 2 replies") < text.index("step 10: 2 replies")  # newest first
    assert any('alias = "adamw"' in p for p in page.pre)


def test_the_page_fetches_nothing(tmp_path):
    _, text, page = _page(tmp_path)
    assert not [t for t, _ in page.tags if t in ("script", "link", "img", "iframe", "object", "embed")]
    assert not [a for _, a in page.tags for k in ("src", "href") if k in a]
    assert "url(" not in text and "@import" not in text

