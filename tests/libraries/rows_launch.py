"""Run an adapter's rows on W real gloo ranks, several rows per launch (one process group): the frameworks' tests.

The --library runner starts fresh ranks for each row; the tests save that start-up by driving the adapter's runners
themselves: one `moebench.distributed.launch` per (adapter, world, seed, rows), every rank runs every row in order (a
row the adapter's skip_reason names is skipped, as the runner does), and the comparisons come back grouped per row,
flattened over ranks. Patches applied in the test process before the launch reach the ranks (they are forked)."""

from __future__ import annotations

import time

from libraries.hf_launch import ROW_DEADLINE_S, RowResult

from moebench.distributed.launch import check, launch
from moebench.libraries.spec import Adapter, Row
from moebench.parity.registry import CheckOptions, Refused, SkipCheck


def _rank(ctx, adapter: Adapter, rows: list[Row], opts: CheckOptions) -> list:
    out = []
    for row in rows:
        start = time.monotonic()
        reason = adapter.skip_reason(row)
        if reason is not None:
            out.append(("skip", reason, 0.0))
            continue
        try:
            out.append(("ok", adapter.runner(row.kind)(ctx, row, opts), time.monotonic() - start))
        except SkipCheck as exc:
            out.append(("skip", str(exc), time.monotonic() - start))
        except Refused as exc:  # the library refused what the row asks: the runner's "refused" verdict
            out.append(("refused", str(exc), time.monotonic() - start))
    return out


def run_rows(adapter: Adapter, rows: list[Row], world_size: int, seed: int = 0) -> list[RowResult]:
    """Every row on `world_size` ranks in one launch; raises LaunchError when a rank fails or hangs."""
    from moebench.preload import import_present

    import_present(adapter.preload)  # imported once here, inherited by the forked ranks
    result = check(launch(_rank, world_size, args=(adapter, rows, CheckOptions(seed=seed)), backend="gloo",
                          timeout_s=ROW_DEADLINE_S * max(1, len(rows)), label=f"{adapter.name} rows"))
    out = []
    for i, row in enumerate(rows):
        per_rank = [returned[i] for returned in result.returns]
        seconds = max(r[2] for r in per_rank)
        if per_rank[0][0] == "skip":
            out.append(RowResult(row=row, skipped=per_rank[0][1], comparisons=[], seconds=seconds))
        elif per_rank[0][0] == "refused":
            out.append(RowResult(row=row, skipped=None, comparisons=[], seconds=seconds, refused=per_rank[0][1]))
        else:
            out.append(RowResult(row=row, skipped=None, comparisons=[c for r in per_rank for c in r[1]],
                                 seconds=seconds))
    return out
