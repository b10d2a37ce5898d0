"""A library run's row records (what the console, `--json` and the report read) and their plain-text forms.

`rows_of(summary)` turns the checks that are library rows into one record each: the row's labels and settings
(spec.Row.labels), its check name, verdict, diagnosis and time. `conformance` prints them at most WIDTH columns
wide; `library_list` prints `--list`'s libraries.
"""

from __future__ import annotations

import textwrap
from typing import Any

from moebench.parity.diagnosis import RESTORE_NAMES

WIDTH = 80
"""Console width every line fits (the project's rule)."""
COLUMNS = (("library", "library"), ("version", "version"), ("model", "model"), ("backend", "backend"),
           ("EP mode", "ep_mode"), ("world", "world_size"), ("verdict", "verdict"), ("time", "time"))
DIAGNOSIS_INDENT = "    "
LOAD_FIELDS = (("load_ep_mode", "under"), ("load_ep_size", "at ep_size"), ("load_zero_stage", "at ZeRO"))
"""A resume row's JSON fields that say where it was loaded, and how its line under the row says them."""


def _resume_line(r: dict[str, Any]) -> str:
    """ "resume+elastic+data-before-expert: loaded at the same layout" / "resume-to-all_reduce: loaded under
    all_reduce at ep_size 2": the row's variant (the end of its check name; when that is only "resume", its
    features in full, which the table's columns may cut) and where it was loaded."""
    variant = r.get("check", "").rsplit("/", 1)[-1]
    if not variant.startswith("resume-"):
        variant = "+".join(r.get("features") or ()) or "resume"
    where = [f"{words} {r[key]}" for key, words in LOAD_FIELDS if key in r]
    return f"{DIAGNOSIS_INDENT}{variant}: loaded {' '.join(where) if where else 'at the same layout'}"


def _fit(rows: list[list[str]], header: list[str], width: int = WIDTH) -> tuple[list[int], str]:
    """Column widths and the gap: two spaces when everything fits, else one; past that the widest
    columns are cut (ending in "~") until the line fits `width`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= width else " "
    while sum(widths) + len(gap) * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=widths.__getitem__)
        widths[i] -= 1
    return widths, gap


def _cell(text: str, width: int) -> str:
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "~"


def _line(cells: list[str], widths: list[int], gap: str = "  ") -> str:
    return gap.join(_cell(c, w) for c, w in zip(cells, widths)).rstrip()


FEATURES_COLUMN = ("features", "features")
"""Shown (after EP mode) when some row has features: what tells rows with the same model/backend/EP apart."""


def _value(r: dict[str, Any], key: str) -> str:
    if key == "time":
        return f"{r['elapsed_s']:.1f}s"
    value = r.get(key, "")
    return "+".join(value) or "-" if isinstance(value, (list, tuple)) else str(value)


def conformance(rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """One line per row; under a failing (or skipped) row its diagnosis, wrapped and indented."""
    columns = list(COLUMNS)
    if any(r.get("features") for r in rows):
        columns.insert(5, FEATURES_COLUMN)
    header = [h for h, _ in columns]
    cells = [[_value(r, key) for _, key in columns] for r in rows]
    widths, gap = _fit(cells, header, width)
    out = [_line(header, widths, gap), _line(["-" * w for w in widths], widths, gap)]
    for r, c in zip(rows, cells):
        out.append(_line(c, widths, gap))
        if "resume" in r.get("features", ()):
            out.append(_resume_line(r)[:width])
        if r["verdict"] != "pass" and r.get("diagnosis"):
            first = r["diagnosis"].strip().splitlines()[0]
            out += textwrap.wrap(first, width, initial_indent=DIAGNOSIS_INDENT, subsequent_indent=DIAGNOSIS_INDENT,
                                 break_on_hyphens=False)
    return "\n".join(out)


def library_list(statuses: list, width: int = WIDTH) -> str:
    """One line per library: version, whether it runs here, and the one line why not."""
    header = ["library", "version", "runs", "why not"]
    cells = [[s.name, s.version or "-", "no" if s.why_not else "yes", s.why_not or ""] for s in statuses]
    fixed, _ = _fit([c[:3] for c in cells], header[:3], width // 2)
    indent = sum(fixed) + 2 * 3
    out = [_line(header, [*fixed, width - indent])]
    for c in cells:
        head = "  ".join(_cell(x, w) for x, w in zip(c[:3], fixed)) + "  "
        wrapped = textwrap.wrap(c[3], width - indent) or [""]
        out.append((head + wrapped[0]).rstrip())
        out += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(out)


def rows_of(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The conformance rows of a summary: every check that is a library row, with its verdict."""
    rows = []
    for c in summary["checks"]:
        if not c.get("labels"):
            continue
        d = c.get("diagnosis")
        why = d["sentence"] if d else c.get("reason", "") if c["status"] != "pass" else ""
        first = (d or {}).get("details", {}).get("first") or {}
        if first.get("sentence") and first["sentence"] not in why:  # the first wrong tensor: the maintainer's lead
            # (a restore diagnosis names its slots itself: "rank 1, local slot 0 holds ...")
            why = f"{why}; {'' if d['name'] in RESTORE_NAMES else 'it '}{first['sentence']}"
        rows.append({**c["labels"], "features": list(c["labels"].get("features", ())), "check": c["name"],
                     "verdict": c["status"], "diagnosis": (f"{d['name']}: {why}" if d else why) or None,
                     "diagnosis_name": d["name"] if d else None, "elapsed_s": c["elapsed_s"]})
    return rows


def with_rows(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its "rows" (for verify_parity's `decorate`)."""
    return {**summary, "rows": rows_of(summary)}
