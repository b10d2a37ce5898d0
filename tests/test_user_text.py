"""No notes from development in what users read: README.md, docs/ and every command's --help never speak of the
project's issues, sessions or stops, carry a commit hash outside a changelog, or remark on what else was running on
the machine while something was measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# typer >= 0.29 vendors click (moebench/cli/app.py)
import typer._click as click
import typer.main

from moebench.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTES = {
    "an issue of this project": re.compile(r"\bissues? \d+", re.I),
    "a stop": re.compile(r"\b(?:this|last|earlier|previous|next|later|the) stop\b", re.I),
    "a session": re.compile(r"\b(?:this|a|the|each|every|earlier|previous|next|later) session(?:'s|s)?\b"
                            r"(?! of its own)", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "what else ran on the machine": re.compile(r"\bmachine was (?:shared|busy)\b|\bwhile (?:other|another) "
                                               r"(?:\w+ ){0,3}(?:ran|was running|were running)\b", re.I),
}
"""What a development note looks like: a pattern each."""
CHANGELOG = re.compile(r"^#+ .*changelog", re.I)


def notes(text: str) -> list[str]:
    """Each development note in `text` (outside a changelog section), as `under "heading": what: the words`; lines
    are joined, so a note wrapped over two lines is found too."""
    found, heading, section = [], "(top)", []

    def scan() -> None:
        joined = " ".join(line.strip() for line in section)
        for what, pattern in NOTES.items():
            found.extend(f"under {heading!r}: {what}: {m.group(0)!r}" for m in pattern.finditer(joined))

    for line in text.splitlines():
        if line.startswith("#"):
            if not CHANGELOG.match(heading):
                scan()
            heading, section = line, [line.lstrip("# ")]
        else:
            section.append(line)
    if not CHANGELOG.match(heading):
        scan()
    return found


def _helps() -> dict[str, str]:
    root = typer.main.get_command(app)
    out = {"moebench": root.get_help(click.Context(root, info_name="moebench"))}

    def walk(command, path):
        for name, sub in getattr(command, "commands", {}).items():
            out[f"{path} {name}"] = sub.get_help(click.Context(sub, info_name=name))
            walk(sub, f"{path} {name}")

    walk(root, "moebench")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_notes_in_the_docs(doc):
    found = notes(doc.read_text())
    assert not found, f"{doc.relative_to(ROOT)}:\n" + "\n".join(found)


def test_no_development_notes_in_any_help():
    found = [f"{command} --help: {n}" for command, text in _helps().items() for n in notes(text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", [
    "measured before this stop", "as issue 31 found", "issues 37 and 38", "the next session with a GPU",
    "measured at 62e19f9", "up to 9 s was measured while the machine was shared",
])
def test_each_kind_of_note_is_caught(text):
    assert notes(text)


@pytest.mark.parametrize("text", [
    "a child in a session of its own (start_new_session=True)", "huggingface/transformers#48205",
    "run 20261122-015355-quick-421337", "## Changelog\nfixed at 62e19f9", "deepspeedai/DeepSpeed#8475 (open)",
])
def test_what_is_not_a_note(text):
    assert not notes(text)
