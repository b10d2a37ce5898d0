"""The conformance matrix inside a library's own test suite: one call runs an adapter's rows and returns their records;
`Layer(...)` makes the adapter of your own MoE layer from its factory (moebench.libraries.harness).

    from moebench.testing import assert_rows_pass, run_rows
    from my_pkg.moebench_adapter import ADAPTER  # written against moebench.libraries.spec

    def test_expert_parallelism_matches_one_process():
        assert_rows_pass(run_rows(ADAPTER, world_size=2))

The ranks are forked from the calling process on the CPU and talk over gloo on loopback, under a deadline; no
results folder is written. A record is what `moebench verify-parity --json` prints per row (labels and settings,
`verdict`, `diagnosis_name`, `diagnosis`); `run_summary` returns the whole summary, every comparison included.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from moebench.libraries.harness import Layer
from moebench.libraries.spec import Adapter, problems

__all__ = ["Layer", "run_rows", "run_summary", "assert_rows_pass"]


def run_summary(adapter: Adapter, world_size: int = 2, *, rows: Sequence[str] = (), seed: int = 0,
                resume: bool = False, user_config: Mapping[str, Any] | None = None, tolerance: str = "strict",
                timeout_s: float = 120.0) -> dict[str, Any]:
    """Run `adapter`'s rows at `world_size` (only those whose key matches a glob of `rows`, when given) and
    return the summary: "rows" (one record each) and "checks" (every comparison). An adapter that does not meet
    the protocol raises TypeError naming what is wrong."""
    from moebench.libraries.matrix import registered, row_checks
    from moebench.libraries.records import with_rows
    from moebench.parity.runner import ParityConfig, run_checks

    found = problems(adapter, world_size)
    if found:
        raise TypeError(f"{type(adapter).__name__} does not meet the adapter protocol: {'; '.join(found)}")
    user_configs = {adapter.name: user_config} if user_config is not None else None
    checks = row_checks([adapter], (world_size,), resume=resume, user_configs=user_configs, patterns=tuple(rows))
    with registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, checks=tuple(c.name for c in checks), seed=seed,
                                          tolerance=tolerance, timeout_s=timeout_s))
    return with_rows(summary)


def run_rows(adapter: Adapter, world_size: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """The row records of `run_summary(adapter, world_size, **kwargs)`."""
    return run_summary(adapter, world_size, **kwargs)["rows"]


def assert_rows_pass(records: list[dict[str, Any]]) -> None:
    """Fail (AssertionError) naming every row that did not pass, with its diagnosis; a row skipped with a reason
    passes this (it says why it could not run here)."""
    bad = [r for r in records if r["verdict"] not in ("pass", "skip")]
    if not records:
        raise AssertionError("no row ran")
    if bad:
        lines = [f"{r['check']}: {r['verdict']}: {(r['diagnosis'] or '').splitlines()[0][:300]}" for r in bad]
        raise AssertionError(f"{len(bad)} of {len(records)} row(s) did not pass:\n" + "\n".join(lines))
