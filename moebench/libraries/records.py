"""A library run's row records (what the console, `--json` and the report read) and their plain-text forms.

`rows_of(summary)` turns the checks that are library rows into one record each: the row's labels and settings
(spec.Row.labels), its check name, verdict, diagnosis and time. `conformance` prints them at most WIDTH columns
wide; `library_list` prints `--list`'s libraries.
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable

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
    """Column widths and the gap: two spaces when everything fits, else one; past that the widest columns are
    narrowed until the line fits `width` (their cells then wrap onto more lines: nothing is ever cut)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    # names, versions and numbers are never broken; labels made of parts (model, backend, features) wrap at them
    floor = [w if h in WHOLE else max(len(h), 4) for h, w in zip(header, widths)]
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= width else " "
    while sum(widths) + len(gap) * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda k: widths[k] - floor[k])
        if widths[i] <= floor[i]:
            break
        widths[i] -= 1
    return widths, gap


def _pieces(text: str, width: int) -> list[str]:
    """A cell as the lines it takes at `width`: broken after "+", "_", "/", "-" or "=" where it can, else hard."""
    out = []
    while len(text) > width:
        cut = max((text.rfind(sep, 0, width) + 1 for sep in "+_/-="), default=0)
        cut = cut if cut > 0 else width
        out.append(text[:cut])
        text = text[cut:]
    return out + [text]


def _lines(cells: list[str], widths: list[int], gap: str = "  ") -> list[str]:
    """One row as lines: each cell wrapped within its column, the row as tall as its tallest cell."""
    split = [_pieces(c, w) for c, w in zip(cells, widths)]
    height = max(len(p) for p in split)
    return [gap.join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(split, widths)).rstrip()
            for k in range(height)]


WHOLE = ("library", "version", "world", "verdict", "time")
"""Columns whose cells are never wrapped: a library name or a version broken over two lines reads as two."""
FEATURES_COLUMN = ("features", "features")
"""Shown (after EP mode) when some row has features: what tells rows with the same model/backend/EP apart."""
VERDICT_WIDTH = len("refused")
TIME_WIDTH = len("999.9s")


def _value(r: dict[str, Any], key: str) -> str:
    if key == "time":
        return f"{r['elapsed_s']:.1f}s"
    value = r.get(key, "")
    return "+".join(value) or "-" if isinstance(value, (list, tuple)) else str(value)


class Table:
    """The conformance table of a set of rows, at most `width` columns: the header, then each row's lines (cells
    wrapped, never cut), its resume line and, under a row that did not pass, its diagnosis and the command that
    reruns it alone. Built from the rows' labels before they run, so a run prints each row once, as it ends."""

    def __init__(self, rows: list[dict[str, Any]], width: int = WIDTH) -> None:
        self.width = width
        self.columns = list(COLUMNS)
        if any(r.get("features") for r in rows):
            self.columns.insert(5, FEATURES_COLUMN)
        header = [h for h, _ in self.columns]
        known = [[_value(r, key) if key not in ("verdict", "time") else "" for _, key in self.columns] for r in rows]
        for cells in known:  # every verdict and time a row can end with fits
            cells[header.index("verdict")], cells[header.index("time")] = "-" * VERDICT_WIDTH, "-" * TIME_WIDTH
        self.widths, self.gap = _fit(known, header, width)
        self.header = header

    def head(self) -> list[str]:
        return _lines(self.header, self.widths, self.gap) + _lines(["-" * w for w in self.widths], self.widths,
                                                                   self.gap)

    def row(self, r: dict[str, Any]) -> list[str]:
        out = _lines([_value(r, key) for _, key in self.columns], self.widths, self.gap)
        if "resume" in r.get("features", ()):
            out += textwrap.wrap(_resume_line(r), self.width, subsequent_indent=DIAGNOSIS_INDENT * 2)
        if r.get("note"):
            out += textwrap.wrap(r["note"], self.width, initial_indent=DIAGNOSIS_INDENT,
                                 subsequent_indent=DIAGNOSIS_INDENT * 2, break_on_hyphens=False)
        if r["verdict"] != "pass" and r.get("diagnosis"):
            first = r["diagnosis"].strip().splitlines()[0]
            out += textwrap.wrap(first, self.width, initial_indent=DIAGNOSIS_INDENT,
                                 subsequent_indent=DIAGNOSIS_INDENT, break_on_hyphens=False)
        if r.get("rerun"):
            out += command_lines(f"rerun alone: {r['rerun']}", self.width)
        return out


def command_lines(text: str, width: int = WIDTH) -> list[str]:
    """A shell command over lines of at most `width`, each but the last ending in " \\" (so the lines paste as
    one command), words never broken."""
    lines, line = [], DIAGNOSIS_INDENT
    for word in text.split(" "):
        if line.strip() and len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = DIAGNOSIS_INDENT * 2
        line += ("" if not line.strip() else " ") + word
    return lines + [line]


def conformance(rows: list[dict[str, Any]], width: int = WIDTH) -> str:
    """The whole table: one row (or a few lines of it) per record; under a failing (or skipped) row its
    diagnosis, wrapped and indented."""
    table = Table(rows, width)
    return "\n".join(table.head() + [line for r in rows for line in table.row(r)])


def library_list(statuses: list, width: int = WIDTH) -> str:
    """One line per library: version, whether it runs here, and the one line why not (or its note, when it runs),
    then which releases run here, when the adapter says."""
    header = ["library", "version", "runs", "why not / note"]
    cells = [[s.name, s.version or "-", "no" if s.why_not else "yes",
              " ".join(filter(None, [s.why_not or getattr(s, "note", None),
                                     f"(releases: {s.releases})" if getattr(s, "releases", None) else ""]))]
             for s in statuses]
    fixed, _ = _fit([c[:3] for c in cells], header[:3], width // 2)
    indent = sum(fixed) + 2 * 3
    out = [_lines(header, [*fixed, width - indent])[0]]
    for c in cells:
        head = "  ".join(x.ljust(w) for x, w in zip(c[:3], fixed)) + "  "
        wrapped = textwrap.wrap(c[3], width - indent) or [""]
        out.append((head + wrapped[0]).rstrip())
        out += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(out)


def row_record(check: dict[str, Any]) -> dict[str, Any] | None:
    """The conformance record of one check's record (None for a check that is no library row): its labels and
    settings, check name, verdict, diagnosis (name and sentence, with the first wrong tensor) and time."""
    if not check.get("labels"):
        return None
    d = check.get("diagnosis")
    why = d["sentence"] if d else check.get("reason", "") if check["status"] != "pass" else ""
    first = (d or {}).get("details", {}).get("first") or {}
    if first.get("sentence") and first["sentence"] not in why:  # the first wrong tensor: the maintainer's lead
        # (a restore diagnosis names its slots itself: "rank 1, local slot 0 holds ...")
        why = f"{why}; {'' if d['name'] in RESTORE_NAMES else 'it '}{first['sentence']}"
    return {**check["labels"], "features": list(check["labels"].get("features", ())), "check": check["name"],
            "verdict": check["status"], "diagnosis": (f"{d['name']}: {why}" if d else why) or None,
            "diagnosis_name": d["name"] if d else None, "elapsed_s": check["elapsed_s"]}


def rows_of(summary: dict[str, Any], annotate: Callable[[dict[str, Any]], dict[str, Any]] | None = None
            ) -> list[dict[str, Any]]:
    """The conformance rows of a summary: every check that is a library row, with its verdict (and what
    `annotate(record)` adds to it, e.g. the command that reruns a failing row alone)."""
    records = [r for r in map(row_record, summary["checks"]) if r is not None]
    return [{**r, **annotate(r)} for r in records] if annotate else records


def with_rows(summary: dict[str, Any], annotate: Callable[[dict[str, Any]], dict[str, Any]] | None = None
              ) -> dict[str, Any]:
    """The summary with its "rows" (for verify_parity's `decorate`)."""
    return {**summary, "rows": rows_of(summary, annotate)}
