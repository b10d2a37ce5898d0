"""Measured values against the chapter's published figures: the difference, and a verdict each.

A verdict is `reproduced` (within the figure's tolerance, moebench.published), `differs` (outside
it: the row carries the known difference or the likely cause) or `not run` (no measurement).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from moebench.published import PublishedFigure
from moebench.report.numbers import nonfinite_text, real

REPRODUCED = "reproduced"
DIFFERS = "differs"
NOT_RUN = "not run"
VERDICTS = (REPRODUCED, DIFFERS, NOT_RUN)


def _epoch_drop(summary: dict) -> float | None:
    first, fifth = real(lookup(summary, "epoch_loss.1")), real(lookup(summary, "epoch_loss.5"))
    if first is None or fifth is None or not first:
        return None
    return 100.0 * (first - fifth) / first


DERIVED = {"derived.epoch_loss_drop_pct": _epoch_drop}
"""Measured values a summary does not hold but implies (computed here, so old results work too)."""


def lookup(measured: dict, dotted_key: str) -> Any:
    """measured["params"]["total"] for "params.total"; list indices are 1-based ("epoch_loss.5")."""
    if dotted_key in DERIVED:
        return DERIVED[dotted_key](measured)
    value: Any = measured
    for part in dotted_key.split("."):
        if isinstance(value, list):
            idx = int(part) - 1
            value = value[idx] if 0 <= idx < len(value) else None
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
        if value is None:
            return None
    return value


def judge(fig: PublishedFigure, value: Any) -> tuple[str, str]:
    """(verdict, reason) for one measured value."""
    if value is None:
        return NOT_RUN, "not measured by this run"
    if isinstance(fig.value, tuple):
        ok = list(value) == list(fig.value)
    elif isinstance(value, (int, float)):
        ok = abs(value - fig.value) <= fig.allowed() + 1e-12 * abs(fig.value)  # float noise only
    else:
        ok = False
    if ok:
        return REPRODUCED, fig.tolerance_reason
    return DIFFERS, fig.known_difference or fig.if_differs or "outside the tolerance"


def compare(measured: dict, figures: Iterable[PublishedFigure]) -> list[dict]:
    """One row per published figure: measured, published, difference, ratio, tolerance, verdict."""
    rows = []
    for fig in figures:
        value = lookup(measured, fig.key)
        if not isinstance(fig.value, tuple):  # a number ("nan" decoded, anything else none: numbers.real)
            value = real(value)
        elif not isinstance(value, list):
            value = None
        numeric = value is not None and not isinstance(fig.value, tuple)
        diff = value - fig.value if numeric else None
        verdict, reason = judge(fig, value)
        rows.append({
            "key": fig.key, "label": fig.label, "unit": fig.unit, "section": fig.section,
            "measured": value, "published": list(fig.value) if isinstance(fig.value, tuple) else fig.value,
            "difference": diff, "ratio": value / fig.value if numeric and fig.value else None,
            "tolerance": fig.tolerance_text(), "verdict": verdict, "reason": reason,
        })
    return rows


def verdicts(summary: dict | None, figures: Iterable[PublishedFigure], *, not_run_reason: str = "") -> list[dict]:
    """`compare` rows for one variant, or every row `not run` with `not_run_reason`."""
    if summary is None or not_run_reason:
        rows = compare({}, figures)
        for row in rows:
            row["reason"] = not_run_reason or "no run"
        return rows
    return compare(summary, figures)


def format_number(value, unit: str = "") -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(str(v) for v in value) + ")"
    value = real(value)
    if value is None:
        return "—"
    if not math.isfinite(value):
        return nonfinite_text(value)
    if unit == "params":
        return f"{value / 1e6:,.3f} M"
    if unit == "%":
        return f"{value:.1f} %"
    if unit == "value":
        return f"{value:.3f}"
    return f"{value:.6g}"


def format_published(value, unit: str = "") -> str:
    """A published figure with the precision the chapter printed (273 M, 45 %, 1.784354)."""
    if isinstance(value, (str, list, tuple)) or value is None:
        return format_number(value, unit) if not isinstance(value, str) else value
    if unit == "params":
        return f"{value / 1e6:g} M"
    if unit == "%":
        return f"{value:g} %"
    return f"{value:.10g}"


def difference_text(row: dict) -> str:
    diff = row["difference"]
    if diff is None:
        if row["measured"] is None:
            return "—"
        return "equal" if row["verdict"] == REPRODUCED else "not equal"
    diff, ratio = real(diff), real(row["ratio"])
    if diff is None or not math.isfinite(diff):
        return "—" if diff is None else nonfinite_text(diff)
    if row["unit"] == "%":  # a difference of percentages is in percentage points
        return f"{diff:+.1f} pp"
    text = ("+" if diff >= 0 else "") + format_number(diff, row["unit"])
    # a relative change of a signed extreme misleads
    relative = ratio is not None and math.isfinite(ratio) and row["unit"] != "value"
    return text + (f" ({100 * (ratio - 1):+.1f} %)" if relative else "")


def comparison_table(rows: list[dict], title: str, *, stacked: bool = False):
    """A rich Table of `compare` rows (differences shown, never hidden). Numbers are never wrapped or
    cut; `stacked` (for narrow terminals) puts the relative difference under the absolute one."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("figure", "measured", "chapter", "difference", "chapter section"):
        number = col in ("measured", "chapter", "difference")
        table.add_column(col, justify="right" if number else "left", no_wrap=number)
    for r in rows:
        difference = difference_text(r)
        table.add_row(r["label"], format_number(r["measured"], r["unit"]), format_published(r["published"], r["unit"]),
                      difference.replace(" (", "\n(") if stacked else difference, r["section"])
    return table
