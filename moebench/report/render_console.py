"""The verdict table for a terminal (fits 80 columns: tolerances and reasons live in REPORT.md)."""

from __future__ import annotations

import re

from moebench.report.claims import DIFFERS, NOT_RUN, REPRODUCED, format_number, format_published

STYLE = {REPRODUCED: "green", DIFFERS: "red", NOT_RUN: "yellow"}


def _text(value, unit: str) -> str:
    if unit == "checks" and isinstance(value, str):
        return value.split(" at ")[0].replace(", 0 skip", "")  # "13 pass, 0 fail"
    return value if isinstance(value, str) else format_number(value, unit)


def verdict_table(rows: list[dict], *, stacked: bool = False):
    """`stacked` (a terminal too narrow for a claim beside its figures): each claim on a line of its own,
    its figures on the next."""
    from rich import box
    from rich.table import Table

    if stacked:
        from rich.console import Group
        from rich.text import Text

        lines = [Text("chapter 6: verdicts", style="bold")]
        for r in rows:
            label = r["label"] if r["variant"] == "parity" else f"{r['variant']}: {r['label']}"
            figures = Text(f"    measured {_text(r['measured'], r['unit'])}, "
                           f"chapter {format_published(r['published'], r['unit'])}: ")
            figures.append(r["verdict"], style=STYLE[r["verdict"]])
            lines += [Text(label), figures]
        return Group(*lines)
    table = Table(title="chapter 6: verdicts", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("claim", overflow="fold", min_width=30)
    table.add_column("measured", justify="right", no_wrap=True)
    table.add_column("chapter", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for i, r in enumerate(rows):
        last_of_variant = i + 1 == len(rows) or rows[i + 1]["variant"] != r["variant"]
        label = r["label"] if r["variant"] == "parity" else f"{r['variant']}: {r['label']}"
        table.add_row(label, _text(r["measured"], r["unit"]), format_published(r["published"], r["unit"]),
                      f"[{STYLE[r['verdict']]}]{r['verdict']}[/]", end_section=last_of_variant)
    return table


def not_run_reasons(rows: list[dict]) -> list[str]:
    """Why claims were not judged, each reason once (11 rows of one quick run share one reason)."""
    from moebench.report.chapter import note_lines

    lines: list[str] = []
    seen: set[str] = set()
    for r in rows:
        if r["verdict"] != NOT_RUN or not r.get("reason") or r["reason"] in seen:
            continue
        seen.add(r["reason"])
        first, *rest = note_lines(r["reason"])
        command = re.fullmatch(r"(.*): run `([^`]+)`", first) if not rest else None
        if command:  # the command on its own line: folded at the terminal's width it could not be copied
            first, rest = command.group(1), [f"run: {command.group(2)}"]
        lines += [f"{r['variant']}: {first}", *("  " + line for line in rest)]
    return lines
