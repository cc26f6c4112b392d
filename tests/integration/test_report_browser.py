r"""``pgs report``'s page rendered by a real headless browser: laid out, drawn to pixels and checked.

The structural tests (tests/unit/test_report_html.py) parse the HTML; this one shows that a browser
draws it: every chart is laid out at its size, beside the others without overlapping them and
inside the page's width; each series' line runs through the points of its data (the screenshot
has the line's colour at the vertices the browser placed, all but where another line crosses);
the summary and the newest samples' tables are shown with ink in them, the older samples folded
away; the escaped reply is shown as text.

The browser: ``PGS_TEST_BROWSER`` (the path of a Chromium-family binary: Chromium, Chrome or
chromium-headless-shell, or of a script that runs one), else the first of ``BROWSERS`` on PATH;
without one the test is skipped.  Without root, Debian's ``chromium-headless-shell`` runs from its
unpacked packages (docs/cli.md, *A real browser for the report's test*), e.g.::

    LD_LIBRARY_PATH=/opt/chromium/usr/lib/x86_64-linux-gnu:/opt/chromium/usr/lib/x86_64-linux-gnu/pulseaudio \
    PGS_TEST_BROWSER=/opt/chromium/usr/lib/chromium/chromium-headless-shell \
    pytest tests/integration/test_report_browser.py

The page is read back twice: once with a probe script appended to a copy (the page itself has no
script) that writes what the browser computed (boxes, styles, the screen position of every
vertex of every line) into the DOM it dumps, and once as a screenshot of the page as shipped.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pgs.runtime.tools import report_html
from test_report_html import REPLY, Page, _page

BROWSERS = ("chromium", "chromium-browser", "chromium-headless-shell", "headless_shell", "google-chrome",
            "google-chrome-stable", "chrome")
WINDOW = 1400  # the window: two 640-pixel charts side by side in the page's 1340-pixel column

# Runs at the end of the copy's body, after layout; its JSON goes into a hidden <pre> of the dump.
PROBE = """<script>
(() => {
  const box = e => {
    const r = e.getBoundingClientRect();
    return [r.left + scrollX, r.top + scrollY, r.width, r.height];
  };
  const shown = e => {
    // checkVisibility also sees what a closed <details> hides (content-visibility), where the browser has it
    if (e.checkVisibility) return e.checkVisibility({opacityProperty: true, visibilityProperty: true});
    for (let n = e; n && n.nodeType === 1; n = n.parentElement) {
      const s = getComputedStyle(n);
      if (s.display === 'none' || s.visibility !== 'visible' || Number(s.opacity) === 0) return false;
    }
    return e.getClientRects().length > 0;
  };
  const out = {width: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
               charts: [], tables: [], cells: []};
  for (const svg of document.querySelectorAll('svg.chart')) {
    const m = svg.getScreenCTM();
    out.charts.push({name: svg.getAttribute('aria-label'), box: box(svg), shown: shown(svg),
      series: Array.from(svg.querySelectorAll('polyline.series'), p => ({
        name: p.dataset.name, stroke: getComputedStyle(p).stroke, length: p.getTotalLength(), shown: shown(p),
        points: Array.from({length: p.points.numberOfItems}, (_, i) => {
          const q = p.points.getItem(i).matrixTransform(m); return [q.x + scrollX, q.y + scrollY]; })}))});
  }
  for (const t of document.querySelectorAll('table')) out.tables.push({cls: t.className, box: box(t), shown: shown(t)});
  for (const td of document.querySelectorAll('td'))
    out.cells.push({text: td.textContent, drawn: td.innerText, shown: shown(td)});
  const pre = document.createElement('pre');
  pre.id = 'pgs-probe'; pre.style.display = 'none'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def find_browser() -> str | None:
    named = os.environ.get("PGS_TEST_BROWSER")
    if named:
        assert os.access(named, os.X_OK), f"PGS_TEST_BROWSER={named} is not an executable file"
        return named
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def _browse(browser: str, profile: Path, height: int, *args: str) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--force-device-scale-factor=1", f"--window-size={WINDOW},{height}", f"--user-data-dir={profile}",
               *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (command, done.returncode, done.stderr[-2000:])
    return done.stdout


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.fullmatch(r"rgb\((\d+), (\d+), (\d+)\)", css).groups())
    return r, g, b


def _near(pixel, colour) -> bool:
    """``pixel`` is ``colour`` blended over the white background with at least 40% coverage (a thin
    line's edge pixels are partly covered): on the white-to-colour segment, near it."""
    away = [255 - v for v in pixel[:3]]
    full = [255 - v for v in colour]
    share = sum(a * f for a, f in zip(away, full)) / sum(f * f for f in full)
    off = sum((a - share * f) ** 2 for a, f in zip(away, full)) ** 0.5
    return share >= 0.4 and off <= 30


def _overlap(a, b) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def test_the_page_renders_in_a_headless_browser(tmp_path):
    browser = find_browser()
    if browser is None:
        pytest.skip(f"no headless browser (PGS_TEST_BROWSER, or on PATH: {', '.join(BROWSERS)}): "
                    "the structural checks of tests/unit/test_report_html.py stand")
    image = pytest.importorskip("PIL.Image", reason="Pillow (matplotlib's dependency, the test extra) reads the "
                                                    "screenshot")
    path, text, _ = _page(tmp_path)
    probed = path.with_name("probed.html")
    probed.write_text(text.replace("</body>", PROBE + "</body>"), encoding="utf-8")

    dom = _browse(browser, tmp_path / "profile", 1000, "--dump-dom", probed.as_uri())
    page = Page()
    page.feed(dom)
    assert len([t for t, _ in page.tags if t == "svg"]) >= 5
    # one line per series: loss, eval_loss, lr, grad_norm, entropy, eval_accuracy (the clip threshold is a <line>)
    assert len([t for t, _ in page.tags if t == "polyline"]) == 6
    assert REPLY in page.cells
    found = re.search(r'<pre id="pgs-probe"[^>]*>(.*?)</pre>', dom, re.S)
    assert found, "the probe did not run: " + dom[-500:]
    laid = json.loads(html.unescape(found.group(1)))

    # layout: every chart shown at its size, inside the page's width, none over another
    charts = {c["name"]: c for c in laid["charts"]}
    assert {"loss", "learning rate", "gradient norm (before clipping)", "mean next-token entropy",
            "eval accuracy"} <= set(charts)
    assert laid["width"] <= WINDOW
    boxes = [c["box"] for c in laid["charts"]]
    for c in laid["charts"]:
        assert c["shown"] and c["box"][2:] == [report_html.WIDTH + 2, report_html.HEIGHT + 2], c["box"]  # 1px border
        assert c["box"][0] >= 0 and c["box"][0] + c["box"][2] <= WINDOW, c["box"]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b)]
    assert len({round(b[1]) for b in boxes}) < len(boxes)  # side by side, not one under another
    # every point of the data is a vertex of its line, inside its chart
    sizes = {s["name"]: len(s["points"]) for c in laid["charts"] for s in c["series"]}
    assert sizes["loss"] == 20 and sizes["eval_loss"] == 3 and sizes["eval_accuracy"] == 3, sizes
    for c in laid["charts"]:
        x, y, w, h = c["box"]
        for s in c["series"]:
            assert s["shown"] and s["length"] > 0, (c["name"], s["name"])
            assert all(x <= px <= x + w and y <= py <= y + h for px, py in s["points"]), (c["name"], s["name"])
    # tables: the summary and the newest evaluation's samples shown, the older one folded in its <details>
    tables = laid["tables"]
    assert [t["cls"] for t in tables] == ["summary", "samples", "samples"]
    assert tables[0]["shown"] and tables[1]["shown"] and not tables[2]["shown"]
    # the newest replies shown as text (not as bold markup), step 10's ("x") folded
    assert [(c["shown"], c["drawn"]) for c in laid["cells"] if c["text"] == REPLY] == [(True, REPLY)] * 2
    assert [c["shown"] for c in laid["cells"] if c["text"] == "x"] == [False, False]

    # pixels: the page as shipped, in a window as tall as the page
    shot = tmp_path / "page.png"
    _browse(browser, tmp_path / "profile", laid["height"], f"--screenshot={shot}", path.as_uri())
    pixels = image.open(shot).convert("RGB")
    assert pixels.size == (WINDOW, laid["height"])
    for c in laid["charts"]:
        for s in c["series"]:
            colour = _rgb(s["stroke"])
            hit = [any(_near(pixels.getpixel((round(px) + dx, round(py) + dy)), colour)
                       for dx in range(-2, 3) for dy in range(-2, 3)) for px, py in s["points"]]
            # a vertex another line crosses may show that line's colour: nearly all, not all
            assert sum(hit) >= 0.9 * len(hit), (c["name"], s["name"], hit)
    for t in tables[:2]:
        x, y, w, h = (round(v) for v in t["box"])
        region = pixels.crop((x, y, x + w, y + h))
        ink = sum(1 for p in region.getdata() if sum(p) < 3 * 100)
        assert ink >= 0.01 * w * h, (t["cls"], ink, w * h)  # text drawn, not an empty box
