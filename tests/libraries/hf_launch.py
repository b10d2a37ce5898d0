"""Run transformers adapter rows on W real gloo ranks, several rows per launch (one process group).

The --library runner starts fresh ranks for each row; the tests save that start-up by driving the adapter's
runners themselves: one `moebench.distributed.launch` per (world, seed, rows), every rank runs every row in
order (a row the adapter's skip_reason names is skipped, as the runner does), and the comparisons come back
grouped per row, flattened over ranks. Patches applied in the test process before the launch reach the ranks
(they are forked)."""

from __future__ import annotations

import dataclasses
import time

from moebench.distributed.launch import check, launch
from moebench.libraries.spec import Row
from moebench.libraries.transformers import ADAPTER
from moebench.parity.diagnose import group_of
from moebench.parity.registry import CheckOptions, SkipCheck

# A row takes ~1.5 s at W = 2 and ~3 s at W = 4 on 2 shared cores; 60 s per row is a hang, not slowness.
ROW_DEADLINE_S = 60.0


@dataclasses.dataclass
class RowResult:
    row: Row
    skipped: str | None
    comparisons: list
    seconds: float
    refused: str | None = None
    """What the library refused (parity.registry.Refused raised in the ranks), or None."""

    @property
    def failed(self) -> list:
        return [c for c in self.comparisons if c.asserted and not c.passed]

    @property
    def passed(self) -> bool:
        return self.skipped is None and bool(self.comparisons) and not self.failed

    def failed_groups(self) -> set[str]:
        return {c.group or group_of(c.name) for c in self.failed}

    def describe(self) -> str:
        lines = [f"{self.row.key()}: {len(self.failed)} of {len(self.comparisons)} comparisons failed"
                 + (f"; refused: {self.refused}" if self.refused else "")]
        lines += [f"  rank {c.rank}: {c.name}: {c.max_abs_diff} {c.note} {(c.diagnosis or {}).get('sentence', '')}"
                  for c in self.failed[:12]]
        return "\n".join(lines)


def _rank(ctx, rows: list[Row], opts: CheckOptions) -> list:
    out = []
    for row in rows:
        start = time.monotonic()
        reason = ADAPTER.skip_reason(row)
        if reason is not None:
            out.append(("skip", reason, 0.0))
            continue
        try:
            out.append(("ok", ADAPTER.runner(row.kind)(ctx, row, opts), time.monotonic() - start))
        except SkipCheck as exc:
            out.append(("skip", str(exc), time.monotonic() - start))
    return out


def run_rows(rows: list[Row], world_size: int, seed: int = 0) -> list[RowResult]:
    """Every row on `world_size` ranks in one launch; raises LaunchError when a rank fails or hangs."""
    from moebench.preload import import_present

    import_present(ADAPTER.preload)  # imported once here, inherited by the forked ranks

    result = check(launch(_rank, world_size, args=(rows, CheckOptions(seed=seed)), backend="gloo",
                          timeout_s=ROW_DEADLINE_S * max(1, len(rows)), label="transformers rows"))
    out = []
    for i, row in enumerate(rows):
        per_rank = [returned[i] for returned in result.returns]
        kind, _, _ = per_rank[0]
        seconds = max(r[2] for r in per_rank)
        if kind == "skip":
            out.append(RowResult(row=row, skipped=per_rank[0][1], comparisons=[], seconds=seconds))
        else:
            out.append(RowResult(row=row, skipped=None, comparisons=[c for r in per_rank for c in r[1]],
                                 seconds=seconds))
    return out


def row(model: str, backend: str, ep_mode: str, world_size: int) -> Row:
    return Row(library="transformers", model=model, backend=backend, ep_mode=ep_mode, world_size=world_size,
               features=("loss-curve",))
