"""What the console and `--json` print of a parity summary (the run's summary.json always holds it whole)."""

from __future__ import annotations

from typing import Any


def tested_lines(summary: dict[str, Any]) -> list[str]:
    """What was tested, for the console and the report: one line per --impl key that replaced
    moebench's code (naming the checks that ran it), or one line saying moebench's own code."""
    impls = summary.get("impls") or {}
    if not impls:
        return ["tested: moebench's own implementations (no --impl)"]
    lines = []
    for key, target in impls.items():
        users = [c["name"] for c in summary.get("checks", []) if key in (c.get("user_impls") or {})]
        lines.append(f"user implementation {target} replaced moebench's for key {key}"
                     + (f" (checks: {', '.join(users)})" if users else ""))
    return lines


PRINTED_COMPARISONS = "failed"
"""What `--json` (and the Python API) print of each check's comparisons: the ones that failed, each in its printed
form (`_printed`: what failed, on which rank, by how much, named how). The check itself keeps its diagnosis and the
first failures described in full (`reason`). Every comparison, whole, is in the run's summary.json (and printed
with `--json-full`): the W = 4 DeepSpeed matrix with --resume compares 300,000 tensors, 13 MB of JSON."""
PRINTED_FIELDS = ("name", "rank", "group", "max_abs_diff", "max_rel_diff")
NOTE_CHARS = 200
"""A failed assertion's note (what broke, when no number says it) is printed up to this long."""


def _printed(c: dict) -> dict:
    out = {k: float(f"{c[k]:.4g}") if isinstance(c[k], float) else c[k] for k in PRINTED_FIELDS
           if c.get(k) not in (None, "")}
    if c.get("note"):
        out["note"] = c["note"][:NOTE_CHARS]
    if c.get("diagnosis"):
        out["diagnosis"] = c["diagnosis"]["name"]
    return out


def failed_only(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as `--json` prints it: each check with only its failed comparisons, each in its printed form
    (PRINTED_COMPARISONS); the counts (comparisons_total, comparisons_failed, vacuous) are the whole check's."""
    checks = [{**c, "comparisons": [_printed(x) for x in c.get("comparisons") or () if not x.get("passed", True)]}
              for c in summary.get("checks") or ()]
    return {**summary, "checks": checks, "comparisons_printed": PRINTED_COMPARISONS}
