"""Every relative link in README.md and docs/**/*.md resolves: the file (or folder) exists, and a `#anchor` names a
heading of that file by GitHub's anchor rules. No process started, nothing fetched: links to other sites are not
checked."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline markdown link `[text](target "title")`; its target (images are not links)."""
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
"""A target with a scheme (https:, mailto:): another site's, not checked here."""
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped (letters, digits,
    spaces, hyphens and underscores kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline html
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file (a repeated heading gets -1, -2, ...)."""
    seen: Counter[str] = Counter()
    out = set()
    for _, line in _prose(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """'doc:line: target: why' for each relative link of `path` (a file under `root`) that does not resolve."""
    wrong = []
    for number, line in _prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # a link written inside inline code is an example, not a link
        for m in LINK.finditer(line):
            target = m.group(1)
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            where = path if not file_part else (path.parent / file_part).resolve()
            name = f"{path.relative_to(root)}:{number}: {target}"
            if not where.exists():
                wrong.append(f"{name}: no such file")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                wrong.append(f"{name}: no heading #{anchor} in {where.relative_to(root)}")
    return wrong


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    wrong = broken_links(doc)
    assert not wrong, "\n".join(wrong)


def test_the_anchor_rules_are_githubs():
    assert slug("`--repro DIR`: a standalone reproduction for an upstream report") == (
        "--repro-dir-a-standalone-reproduction-for-an-upstream-report")
    assert slug("Resume: save, load into a fresh model, continue (`--resume`)") == (
        "resume-save-load-into-a-fresh-model-continue---resume")
    assert slug("On 0.19.8 (pinned)") == "on-0198-pinned"
    assert slug("Half precision: fp16 and bf16") == "half-precision-fp16-and-bf16"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Your launch\n\n[ok](#your-launch) [ok](b.md#b-part)\n"
                                   "[gone](c.md) [no heading](b.md#nothing) [same file](#nope)\n"
                                   "`[in code](c.md)`\n\n```\n[in a block](c.md)\n```\n")
    (tmp_path / "b.md").write_text("# B part\n")
    wrong = broken_links(tmp_path / "a.md", tmp_path)
    assert [w.split(": ", 1)[1] for w in wrong] == ["c.md: no such file",
                                                   "b.md#nothing: no heading #nothing in b.md",
                                                   "#nope: no heading #nope in a.md"]
