"""Presenting a Report: a rich table with a summary line, and a plain block to paste into a bug report."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from moebench.envcheck.check import FAIL, OK, SECTIONS, SKIP, WARN, Report

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def summary_line(report: Report) -> str:
    c = report.counts()
    return (f"env-check: {report.status.upper()} - {c[OK]} ok, {c[WARN]} warn, {c[FAIL]} fail, {c[SKIP]} skip "
            f"in {report.elapsed_s:.1f} s")


def table(report: Report) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    t.add_column("", no_wrap=True)
    t.add_column("Item", no_wrap=True, style="bold")
    t.add_column("Found", ratio=4, overflow="fold")
    t.add_column("Required (why)", ratio=3, style="dim")
    t.add_column("Fix", ratio=2)
    for section in SECTIONS:
        rows = [c for c in report.checks if c.section == section]
        if not rows:
            continue
        t.add_row("", Text(section, style="bold underline"), "", "", "", end_section=False)
        for c in rows:
            t.add_row(Text(c.status, style=_STYLE[c.status]), c.title, c.found, c.required,
                      Text(c.hint, style="cyan") if c.hint else "")
        t.add_section()
    return t


def print_report(report: Report, console: Console) -> None:
    console.print(table(report))
    style = _STYLE[FAIL] if report.status == FAIL else _STYLE[WARN] if report.status == WARN else _STYLE[OK]
    console.print(Text(summary_line(report), style=style))


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
