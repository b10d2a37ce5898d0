"""The report's page in a real browser: Debian's `chromium`, headless, with no Python dependency.

How a page is checked (`check_page`): a copy of it gets a small script (CHECKER) that, on the window's `load`
event (fired once every image has been decoded or has failed), writes what the browser made of the page into the
page itself, as JSON in a `<pre id="moebench-check">`: each <img>'s naturalWidth / naturalHeight, each <table>'s
rendered height and body rows, the document's height. `chromium --headless --dump-dom` prints the DOM after the
page has loaded (`--virtual-time-budget` lets it run its load handlers first), and the test reads the JSON back
out of it. One browser start per check, no remote-debugging protocol to speak, nothing fetched (the report embeds
its figures as data: URIs; the page is a file:// URL).

`find()`: the browser, else a skip, or a failure where MOEBENCH_REQUIRE_BROWSER=1 (CI installs chromium first and
sets it: .ci/run), so the browser tests cannot skip there unnoticed."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REQUIRE_ENV = "MOEBENCH_REQUIRE_BROWSER"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         # without these a headless chromium keeps trying the (closed) network for updates, sync and metrics
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")
CHECKER = """<script id="moebench-checker">
window.addEventListener("load", function () {
  var report = {
    images: Array.from(document.images, function (im) {
      return {alt: im.alt.slice(0, 80), complete: im.complete, width: im.naturalWidth, height: im.naturalHeight};
    }),
    tables: Array.from(document.querySelectorAll("table"), function (t) {
      return {height: t.getBoundingClientRect().height, rows: t.tBodies.length ? t.tBodies[0].rows.length : 0,
              head: t.rows.length ? t.rows[0].textContent.slice(0, 60) : ""};
    }),
    height: document.documentElement.scrollHeight  // before the result is added below
  };
  var out = document.createElement("pre");
  out.id = "moebench-check";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>"""
RESULT = re.compile(r'<pre id="moebench-check">(.*?)</pre>', re.S)
WIDTH = 1200
"""The window's width (px), the same for the check and the screenshot: the page's height depends on it."""
MAX_SHOT_HEIGHT = 16000
"""A screenshot is the whole page up to this height (px): chromium's headless window has a limit."""


def find() -> str:
    """The chromium executable; a skip where there is none (a failure where MOEBENCH_REQUIRE_BROWSER=1)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        why = "chromium is not installed (apt-get install chromium)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{why}, and {REQUIRE_ENV}=1 requires it (CI: .ci/run installs it first)")
        pytest.skip(why)
    return browser


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """One headless chromium, a fresh profile of its own (nothing read from or left in the user's)."""
    return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


def check_page(browser: str, page: Path, tmp: Path) -> dict:
    """What the browser made of `page`: {"images": [...], "tables": [...], "height": px} (see CHECKER)."""
    copy = tmp / f"checked-{page.name}"
    text = page.read_text(encoding="utf-8")
    assert "</body>" in text, f"{page}: no </body> to put the checker before"
    copy.write_text(text.replace("</body>", CHECKER + "\n</body>", 1), encoding="utf-8")
    done = _chromium(browser, tmp / "profile-check", f"--window-size={WIDTH},900", "--virtual-time-budget=10000",
                     "--dump-dom", copy.as_uri())
    found = RESULT.search(done.stdout)
    assert found, f"the checker wrote nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(html.unescape(found.group(1)))


def problems(report: dict) -> list[str]:
    """Every figure that did not load and every table that did not render, one line each ([] when none)."""
    out = []
    for number, image in enumerate(report["images"], start=1):
        if not image["complete"] or image["width"] <= 0 or image["height"] <= 0:
            out.append(f"figure {number} did not load ({image['width']}x{image['height']}): {image['alt']}")
    for number, table in enumerate(report["tables"], start=1):
        if table["height"] <= 0 or table["rows"] <= 0:
            out.append(f"table {number} did not render ({table['height']:.0f} px, {table['rows']} rows): "
                       f"{table['head']}")
    return out


def screenshot(browser: str, page: Path, path: Path, height: int) -> Path:
    """A PNG of the whole page (WIDTH px wide, `height` px up to MAX_SHOT_HEIGHT) at `path`."""
    done = _chromium(browser, path.parent / "profile-shot", f"--window-size={WIDTH},{min(height, MAX_SHOT_HEIGHT)}",
                     f"--screenshot={path}", page.as_uri())
    assert path.exists(), f"no screenshot (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return path
