"""The environment section: the env-check run's items, failures first."""

from __future__ import annotations

from moebench.report import collect
from moebench.report.render import Block, Heading, Para, Table


def blocks(run: collect.Run | None) -> list[Block]:
    blocks: list[Block] = [Heading("Environment")]
    if run is None:
        return blocks + [Para("No env-check run found: run `moebench env-check`.")]
    counts = run.summary.get("counts") or {}
    blocks.append(Para(f"env-check {run.run_id}: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in
                                                                 ("ok", "warn", "fail", "skip"))
                       + ("" if run.ok else f" ({run.not_ok_reason()})")))
    checks = (run.documents.get("envcheck.json") or {}).get("checks", [])
    order = {"fail": 0, "warn": 1, "ok": 2, "skip": 3}
    checks = sorted(checks, key=lambda c: order.get(c.get("status"), 4))
    if checks:
        blocks.append(Table(headers=("status", "item", "found", "how to fix"),
                            rows=tuple((c.get("status", ""), c.get("id", ""), c.get("found", ""),
                                        c.get("hint", "") if c.get("status") in ("fail", "warn") else "")
                                       for c in checks),
                            classes=tuple(c.get("status", "") for c in checks)))
    return blocks
