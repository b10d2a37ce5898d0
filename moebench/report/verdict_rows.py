"""The verdict table: one row per published claim of the chapter (variant runs) and one for the parity claim,
each judged from a run's files (reproduced / differs / not run, with its tolerance and reason)."""

from __future__ import annotations

from typing import Callable

from moebench import published
from moebench.report import chapter, collect
from moebench.report.claims import (
    DIFFERS,
    NOT_RUN,
    REPRODUCED,
    difference_text,
    format_number,
    format_published,
    verdicts,
)
from moebench.report.render import Table

FIGURES = {"fastmoe": published.FASTMOE, "deepspeed": published.DEEPSPEED}
PARAMS_PUBLISHED = {
    kind: {fig.key.rsplit(".", 1)[-1]: fig.value for fig in figs if fig.key.startswith("params.")}
    for kind, figs in FIGURES.items()
}
"""The chapter's parameter counts per category ("total", "moe", ...), for the bar charts."""


def chapter_config(kind: str) -> dict:
    """The chapter preset's resolved config, in config.json's shape."""
    return chapter.chapter_config(kind)


def is_chapter_run(kind: str) -> Callable[[collect.Run], bool]:
    chapter = chapter_config(kind)
    return lambda run: not collect.chapter_deviations(run, chapter)


def variant_rows(kind: str, run: collect.Run | None, missing: str) -> list[dict]:
    """The verdict rows of one variant's claims from its primary run (`missing`: why there is none)."""
    figs = FIGURES[kind]
    if run is None:
        reason = missing
    elif not run.ok:
        reason = run.not_ok_reason()
    else:
        deviations = collect.chapter_deviations(run, chapter_config(kind))
        preset = (run.config or {}).get("preset")
        reason = chapter.not_comparable(kind, preset, deviations) if deviations else ""  # the run: its row's run_id
    rows = verdicts(run.summary if run else None, figs, not_run_reason=reason)
    for row in rows:
        row["variant"] = kind
        row["run_id"] = run.run_id if run else None
    return rows


def parity_row(run: collect.Run | None, missing: str) -> dict:
    base = {"variant": "parity", "key": "parity", "label": "parity vs one process", "unit": "checks",
            "section": "seeds 000-003 (allclose assertions) and 6.4.1", "published": "all pass",
            "difference": None, "ratio": None, "tolerance": "per check", "run_id": run.run_id if run else None}
    if run is None:
        return {**base, "measured": None, "verdict": NOT_RUN, "reason": missing}
    counts = run.summary.get("counts") or {}
    checks = run.summary.get("checks") or []
    passed, failed, skipped = counts.get("pass", 0), counts.get("fail", 0), counts.get("skip", 0)
    measured = f"{passed} pass, {failed} fail, {skipped} skip at world size {run.summary.get('world_size', '?')}"
    vacuous = run.summary.get("vacuous_total", 0)
    if failed:
        names = ", ".join(c["name"] for c in checks if c.get("status") == "fail")
        user = user_code(run.summary)
        return {**base, "measured": measured, "verdict": DIFFERS,
                "reason": f"failed: {names}" + (f"; on user code: {user}" if user else "")}
    if not run.ok or not checks:
        why = run.not_ok_reason() if not run.ok else f"run {run.run_id} ran no check"
        return {**base, "measured": measured if checks else None, "verdict": NOT_RUN, "reason": why}
    missing = sorted(_registered_checks() - {c["name"] for c in checks})
    if missing:  # a --checks subset is not the chapter's parity claim
        return {**base, "measured": measured, "verdict": NOT_RUN,
                "reason": f"run {run.run_id} ran {len(checks)} of {len(missing) + len(checks)} checks (not "
                          f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): run "
                          "`moebench verify-parity --world-size 4` without --checks"}
    if vacuous:
        return {**base, "measured": measured, "verdict": DIFFERS,
                "reason": f"{vacuous} vacuous assertion(s) compared nothing"}
    user = user_code(run.summary)
    return {**base, "measured": measured, "verdict": REPRODUCED,
            "reason": f"{passed} checks pass" + (f"; {skipped} skipped (see the parity section)" if skipped else "")
            + (f"; on user code: {user}" if user else "")}


def user_code(summary: dict) -> str:
    """"user implementation X replaced moebench's for key K; ..." ("" when moebench's own code ran)."""
    return "; ".join(f"user implementation {target} replaced moebench's for key {key}"
                     for key, target in (summary.get("impls") or {}).items())


def _registered_checks() -> set[str]:
    from moebench.parity import registry

    return {check.name for check in registry.all_checks()}


def _measured_text(row: dict) -> str:
    return row["measured"] if isinstance(row["measured"], str) else format_number(row["measured"], row["unit"])


def _published_text(row: dict) -> str:
    return format_published(row["published"], row["unit"])


def verdict_table(rows: list[dict]) -> Table:
    return Table(
        headers=("claim", "variant", "measured", "chapter", "difference", "tolerance", "verdict", "why"),
        rows=tuple((r["label"], r["variant"], _measured_text(r), _published_text(r),
                    difference_text(r) if r["unit"] != "checks" else "—", r["tolerance"], r["verdict"],
                    _reason_text(rows, i)) for i, r in enumerate(rows)),
        classes=tuple(r["verdict"] for r in rows))


def _reason_text(rows: list[dict], i: int) -> str:
    """A row's reason, or "as above" when the row before gives the same one (a run that is not the
    chapter's says why once, not in every row)."""
    reason = rows[i]["reason"]
    return "as above" if i and reason and rows[i - 1]["reason"] == reason else reason
