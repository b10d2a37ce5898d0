"""The library section: `verify-parity --library` runs, their conformance tables and figures (never the chapter's
parity claim, which comes from the whole-suite run)."""

from __future__ import annotations

from pathlib import Path

from moebench.report import collect, figures
from moebench.report.render import Block, Figure, Heading, Para, Table


def blocks(run: collect.Run | None, out: Path) -> list[Block]:
    """The latest `verify-parity --library` run: its conformance table and a figure (its own section:
    the chapter's parity verdict stays the whole suite's)."""
    if run is None:
        return []
    summary = run.summary
    rows = summary.get("rows") or []
    names = ", ".join(dict.fromkeys(r["library"] for r in rows)) or "no row"
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "fail", "skip", "refused")}
    refused = f", {counts['refused']} refused by the library" if counts["refused"] else ""
    blocks: list[Block] = [Heading("Library conformance (verify-parity --library)"), Para(
        f"verify-parity --library {run.run_id} ({names}): status {run.status}"
        + ("" if run.ok else f" ({run.not_ok_reason()})") + f", {summary.get('comm_backend')}, tolerance "
        f"{summary.get('tolerance')}; {len(rows)} row(s): {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['skip']} skip{refused}. Each row is one library version x model x expert backend x EP mode x world "
        "size, compared with the same block on one process with identical weights (docs/libraries.md). "
        "It does not judge the chapter's parity claim, which comes from the latest whole-suite run.")]
    checks = {c["name"]: c for c in summary.get("checks") or []}
    # a features column (as on the console) when some row has features: it tells the DeepSpeed engine rows apart
    with_features = any(r.get("features") for r in rows)
    cells = []
    for r in rows:
        ratio = figures.check_ratio(checks.get(r.get("check"), {}))
        features = ("+".join(r.get("features") or ()) or "-",) if with_features else ()
        cells.append((r["library"], r["version"], r["model"], r["backend"], r["ep_mode"], *features,
                      str(r["world_size"]), r["verdict"],
                      "—" if ratio is None else "exact" if ratio == 0 else f"{ratio:.2e}", r.get("diagnosis") or ""))
    if cells:
        headers = ("library", "version", "model", "backend", "EP mode", *(("features",) if with_features else ()),
                   "world", "verdict", "largest diff / tolerance", "diagnosis")
        blocks.append(Table(headers=headers, rows=tuple(cells), classes=tuple(r["verdict"] for r in rows)))
    png = figures.plot_library(rows, list(checks.values()), out / "library.png",
                               title=f"verify-parity --library {names}: largest difference / tolerance per row")
    if png:
        blocks.append(Figure(png, "Per row (library/model/backend/EP mode/world size), the largest |difference| "
                                  "over its allowed difference (log scale), coloured by verdict: blue passed, red "
                                  "failed; a row passes below 1; inf: a difference where equality was required. "
                                  "Not drawn: skipped and refused rows (nothing compared) and bf16 rows (judged by "
                                  "a noise model, not a tolerance)."))
    return blocks
