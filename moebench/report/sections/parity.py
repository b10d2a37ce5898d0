"""The parity section: the whole-suite verify-parity run behind the chapter's parity claim, check by check."""

from __future__ import annotations

from pathlib import Path

from moebench.report import collect, figures
from moebench.report.render import Block, Figure, Heading, Para, Table
from moebench.report.verdict_rows import user_code


def blocks(run: collect.Run | None, out: Path) -> list[Block]:
    blocks: list[Block] = [Heading("Parity")]
    if run is None:
        return blocks + [Para("Not run: no parity run found (run `moebench verify-parity --world-size 4`).")]
    checks = run.summary.get("checks") or []
    blocks.append(Para(f"verify-parity {run.run_id}: world size {run.summary.get('world_size')}, "
                       f"{run.summary.get('comm_backend')}, tolerance {run.summary.get('tolerance')}; status "
                       f"{run.status}" + ("" if run.ok else f" ({run.not_ok_reason()})")
                       + (f". Tested: {user_code(run.summary)}." if run.summary.get("impls") else "")))
    rows = []
    for check in checks:
        ratio = figures.check_ratio(check)
        vacuous = check.get("vacuous", 0)
        rows.append((check["name"], check.get("status", ""),
                     figures.ratio_text(ratio, missing="— (none with a tolerance)"),
                     f"{check.get('comparisons_total', 0)}" + (f" ({vacuous} VACUOUS)" if vacuous else ""),
                     check.get("catches") or check.get("description", ""),
                     check.get("reason") or ""))
    if rows:
        blocks.append(Table(headers=("check", "status", "largest diff / tolerance", "comparisons", "would catch",
                                     "note"), rows=tuple(rows), classes=tuple(c.get("status", "") for c in checks)))
    png = figures.plot_parity(checks, out / "parity.png", title="parity: largest difference over its tolerance")
    if png:
        blocks.append(Figure(png, "Every check: the largest |difference| over its allowed difference (log scale); "
                                  "a check passes below 1. Exactly equal results are a stub at 1e-9, labelled exact. "
                                  "A check whose assertions have no tolerance (two things must differ, a call must "
                                  "raise) or that was skipped has no bar: its status and why stand in its place; "
                                  "nor has one whose largest difference or tolerance is NaN: "
                                  f"{figures.NONFINITE_RATIO}, in red."))
    return blocks
