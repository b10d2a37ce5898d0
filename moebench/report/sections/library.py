"""The library section: `verify-parity --library` runs, their conformance tables and figures (never the chapter's
parity claim, which comes from the whole-suite run)."""

from __future__ import annotations

from pathlib import Path

from moebench.report import collect, figures
from moebench.report.render import Block, Figure, Heading, Para, Table


def blocks(runs: list[collect.Run], out: Path) -> list[Block]:
    """The `verify-parity --library` runs, newest first: one table and one figure per run (its own section:
    the chapter's parity verdict stays the whole suite's)."""
    if not runs:
        return []
    listed = "; ".join(f"{r.run_id} ({_names(r)})" for r in runs)
    section: list[Block] = [Heading("Library conformance (verify-parity --library)"), Para(
        f"{len(runs)} run(s), newest first: {listed}. Each row is one library version x model x expert backend x "
        "EP mode x world size, compared with the same block on one process with identical weights "
        "(docs/libraries/README.md). They do not judge the chapter's parity claim, which comes from the latest "
        "complete whole-suite run.")]
    for index, run in enumerate(runs):
        section += _run_blocks(run, out / ("library.png" if index == 0 else f"library-{run.run_id}.png"),
                               heading=len(runs) > 1)
    return section


def _names(run: collect.Run) -> str:
    rows = run.summary.get("rows") or []
    names = list(dict.fromkeys(str(r["library"]) for r in rows if r.get("library"))) or sorted(
        {str(n).split("/")[0] for n in (run.config or {}).get("checks") or ()})
    return ", ".join(names) or "no row"


def _setup_words(summary: dict) -> str:
    """"; --hf-config PATH; ..." for the user's own setup the rows were built from (older runs: --ds-config)."""
    setup = summary.get("setup")
    given = setup.get("given") if isinstance(setup, dict) else None
    if isinstance(given, dict):
        return "".join(f"; {flag} {value}" for flag, value in given.items())
    ds_config = summary.get("ds_config")
    return f"; --ds-config {ds_config.get('path', '')}" if isinstance(ds_config, dict) else ""


def _run_blocks(run: collect.Run, png_path: Path, *, heading: bool) -> list[Block]:
    if run.damage:  # none of its files is used: what is damaged, and no table or figure
        why = run.not_ok_reason()
        return ([Heading(f"verify-parity --library: {run.run_id}", 3)] if heading else []) + [
            Para(f"verify-parity --library {run.run_id}: {why}.")]
    summary = run.summary
    rows = summary.get("rows") or []
    names = _names(run)
    counts = {v: sum(r.get("verdict") == v for r in rows) for v in ("pass", "fail", "skip", "refused")}
    refused = f", {counts['refused']} refused by the library" if counts["refused"] else ""
    ds_config = _setup_words(summary)
    blocks: list[Block] = [Heading(f"verify-parity --library {names}: {run.run_id}", 3)] if heading else []
    blocks.append(Para(
        f"verify-parity --library {run.run_id} ({names}): status {run.status}"
        + ("" if run.ok else f" ({run.not_ok_reason()})") + f", {summary.get('comm_backend')}, tolerance "
        f"{summary.get('tolerance')}{ds_config}; {len(rows)} row(s): {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['skip']} skip{refused}."))
    checks = {c["name"]: c for c in summary.get("checks") or []}
    # a features column (as on the console) when some row has features: it tells the DeepSpeed engine rows apart
    with_features = any(r.get("features") for r in rows)
    cells = []
    for r in rows:
        check = checks.get(r.get("check"), {})
        ratio = figures.check_ratio(check)
        shown = figures.ratio_text(ratio)
        if ratio is not None and figures.by_noise_model(check):
            shown += " (noise model)"
        features = ("+".join(r.get("features") or ()) or "-",) if with_features else ()
        cells.append((*(str(r.get(key, "?")) for key in ("library", "version", "model", "backend", "ep_mode")),
                      *features, str(r.get("world_size", "?")), str(r.get("verdict", "?")), shown,
                      r.get("diagnosis") or ""))
    if cells:
        headers = ("library", "version", "model", "backend", "EP mode", *(("features",) if with_features else ()),
                   "world", "verdict", "largest diff / allowance", "diagnosis")
        blocks.append(Table(headers=headers, rows=tuple(cells),
                            classes=tuple(str(r.get("verdict", "")) for r in rows)))
    png = figures.plot_library(rows, list(checks.values()), png_path,
                               title=f"verify-parity --library {names} ({run.run_id}): largest difference / "
                                     "allowance per row")
    if png:
        blocks.append(Figure(png, "Every row (library/model/backend/EP mode/world size): the largest |difference| "
                                  "over its allowance (log scale), coloured by verdict: blue passed, red failed; a "
                                  "row passes below 1; inf: a difference where equality was required; "
                                  f"{figures.NONFINITE_RATIO}: a difference, tolerance or noise-model ratio recorded "
                                  "as NaN, no bar and never a pass. Low-precision "
                                  "rows (noise model) are their distance from fp32 over the allowed multiple of the "
                                  "one-process baseline's. Skipped and refused rows have no bar: their status and "
                                  "reason stand in its place."))
    return blocks
