"""One document, two renderings: REPORT.md and a self-contained report.html (figures embedded as
base64), from the same list of blocks, so the two never say different things."""

from __future__ import annotations

import base64
import dataclasses
import html
import re
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclasses.dataclass(frozen=True)
class Para:
    text: str


@dataclasses.dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    classes: tuple[str, ...] = ()
    """Per row: a CSS class for the HTML (e.g. the verdict), "" for none."""


@dataclasses.dataclass(frozen=True)
class Figure:
    path: Path
    caption: str


Block = Heading | Para | Bullets | Table | Figure


def clean(text) -> str:
    """A results file's text as a document may show it: control characters (a terminal's escape sequences, a bell)
    written out escaped, never passed through (results written by an older moebench, or by hand, may hold them)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def _cleaned(block: Block) -> Block:
    if isinstance(block, (Heading, Para)):
        return dataclasses.replace(block, text=clean(block.text))
    if isinstance(block, Bullets):
        return Bullets(tuple(clean(i) for i in block.items))
    if isinstance(block, Table):
        return dataclasses.replace(block, headers=tuple(clean(h) for h in block.headers),
                                   rows=tuple(tuple(clean(c) for c in row) for row in block.rows))
    if isinstance(block, Figure):
        return dataclasses.replace(block, caption=clean(block.caption))
    return block


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for block in map(_cleaned, blocks):
        if isinstance(block, Heading):
            out += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Para):
            out += [block.text, ""]
        elif isinstance(block, Bullets):
            out += [f"- {item}" for item in block.items] + [""]
        elif isinstance(block, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in block.headers) + " |")
            out.append("|" + "|".join("---" for _ in block.headers) + "|")
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            out.append("")
        elif isinstance(block, Figure):
            out += [f"![{block.caption}]({block.path.name})", "", f"*{block.caption}*", ""]
    return "\n".join(out).rstrip() + "\n"


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.7em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .9em; }
th, td { border: 1px solid #ccc; padding: .3em .55em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr.reproduced td.v, tr.pass td.v, tr.ok td.v { color: #1a7f37; font-weight: 600; }
tr.differs td.v, tr.fail td.v, tr.failed td.v { color: #b42318; font-weight: 600; }
tr.not-run td.v, tr.warn td.v, tr.skip td.v, tr.interrupted td.v, tr.abandoned td.v { color: #9a6700;
       font-weight: 600; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #555; }
code { font-family: ui-monospace, monospace; font-size: .92em; background: #f4f4f4; padding: 0 .2em; }
"""


V_CELL = '<td class="v">'
CODE = re.compile(r"`([^`]+)`")


def _inline(text: str) -> str:
    """Escaped text, with Markdown's `code` spans as <code> (the HTML shows no raw backticks)."""
    return CODE.sub(r"<code>\1</code>", html.escape(str(text)))


def html_document(blocks: list[Block], *, title: str, verdict_column: str = "verdict") -> str:
    """A self-contained page: every figure is embedded, nothing is fetched."""
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{html.escape(title)}"
             f"</title>\n<style>{STYLE}</style>\n</head>\n<body>"]
    for block in map(_cleaned, blocks):
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Para):
            parts.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
            marked = {i for i, h in enumerate(block.headers) if h in (verdict_column, "status")}
            body = []
            for n, row in enumerate(block.rows):
                cls = block.classes[n].replace(" ", "-") if n < len(block.classes) else ""
                cells = "".join((V_CELL if i in marked else "<td>") + _inline(c) + "</td>"
                                for i, c in enumerate(row))
                body.append(f"<tr class=\"{html.escape(cls)}\">{cells}</tr>" if cls else f"<tr>{cells}</tr>")
            parts.append(f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body)
                         + "\n</tbody>\n</table>")
        elif isinstance(block, Figure):
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            parts.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{html.escape(block.caption)}\">"
                         f"<figcaption>{html.escape(block.caption)}</figcaption></figure>")
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)
