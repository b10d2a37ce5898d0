"""Presenting a Report: a rich table with a summary line, and a plain block to paste into a bug report."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from moebench.envcheck.check import FAIL, OK, SECTIONS, SKIP, WARN, Report

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def summary_line(report: Report) -> str:
    c = report.counts()
    return (f"env-check: {report.status.upper()} - {c[OK]} ok, {c[WARN]} warn, {c[FAIL]} fail, {c[SKIP]} skip "
            f"in {report.elapsed_s:.1f} s")


ITEM_WIDTH = 21
"""Width of the item column: the longest titles ("nccl.h for building fastmoe") wrap, the rest align."""
STATUS_WIDTH = 5
"""Width of the status column ("warn" and a space)."""
GAP = 2
"""Spaces between the item and what was found."""


def lines(report: Report, width: int) -> list[Text]:
    """The report laid out for a terminal `width` columns wide: per section a title, then one entry per
    item (status, item, what was found), wrapped at word boundaries. Under an item that warns or fails,
    `needs:` and `fix:` start lines of their own, each clause of a fix on its own line, so that a fix (a
    command to paste) is whole. What an ok item requires is in the JSON: at 80 columns it tripled the
    length."""
    indent = STATUS_WIDTH + ITEM_WIDTH + GAP
    body = max(width - indent, 20)
    out: list[Text] = []
    for section in SECTIONS:
        rows = [c for c in report.checks if c.section == section]
        if not rows:
            continue
        out.append(Text(section, style="bold underline"))
        for c in rows:
            titles = _wrap(c.title, ITEM_WIDTH)
            found = _wrap(c.found, body)
            for i in range(max(len(titles), len(found))):
                line = Text(f"{c.status if i == 0 else '':<{STATUS_WIDTH}}",
                            style=_STYLE[c.status] if i == 0 else "")
                line.append(f"{titles[i] if i < len(titles) else '':<{ITEM_WIDTH + GAP}}", style="bold")
                line.append(found[i] if i < len(found) else "")
                line.rstrip()
                out.append(line)
            if c.required and c.status in (WARN, FAIL):
                out += _labelled("needs", [c.required], width, "dim")
            if c.hint:
                out += _labelled("fix", [part.strip() for part in c.hint.split("; ")], width, "cyan")
        out.append(Text(""))
    return out


def _wrap(text: str, width: int) -> list[str]:
    """Word-wrapped lines; a word longer than a whole line (a path) starts a line and is split (after a
    `/` where it can be), never cut."""
    import textwrap

    out = []
    for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]:
        while len(line) > width:
            cut = line.rfind("/", 1, width) + 1 or width
            out.append(line[:cut])
            line = line[cut:]
        out.append(line)
    return out


def _labelled(label: str, clauses: list[str], width: int, style: str) -> list[Text]:
    """`label: clause;` then each further clause on its own line, under the first."""
    head = " " * STATUS_WIDTH + f"{label}: "
    out = []
    for k, clause in enumerate(clauses):
        text = clause + (";" if k + 1 < len(clauses) else "")
        for j, part in enumerate(_wrap(text, max(width - len(head), 20))):
            line = Text(head if k == 0 and j == 0 else " " * len(head), style="bold")
            line.append(part, style=style)
            out.append(line)
    return out


def print_report(report: Report, console: Console) -> None:
    for line in lines(report, console.width):
        console.print(line, overflow="ignore", crop=False, soft_wrap=True)
    style = _STYLE[FAIL] if report.status == FAIL else _STYLE[WARN] if report.status == WARN else _STYLE[OK]
    console.print(Text(summary_line(report), style=style))
    console.print("what each item requires, and why: --json, or the saved file below", style="dim")


def bug_report_block(report: Report) -> str:
    """Plain text (Markdown fenced) with every item on one line and fixes beneath: paste as-is."""
    lines = ["### moebench env-check", "", "```text",
             f"moebench {report.moebench_version}  created {report.created}  host {report.hostname}",
             summary_line(report)]
    for section in SECTIONS:
        rows = [c for c in report.checks if c.section == section]
        if not rows:
            continue
        lines.append(f"-- {section}")
        for c in rows:
            lines.append(f"[{c.status:4}] {c.id}: {c.found}")
            if c.status in (WARN, FAIL) and c.hint:
                lines.append(f"       fix: {c.hint}")
    lines.append("```")
    return "\n".join(lines)
