"""What the run commands share: running, the `--json` documents, the parameter table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import typer

from moebench import results
from moebench.errors import RunFailed


def echo_failure_json(exc: RunFailed) -> None:
    """--json and the run failed: the run's summary.json (status "failed", error) and its path."""
    try:
        summary = results.read_back(Path(exc.run_path) / "summary.json")
    except (OSError, ValueError):  # died before summary.json was written (or could not write it whole)
        summary = {"status": "failed", "error": str(exc), "run_path": str(exc.run_path)}
    if summary.get("status") == results.STATUS_RUNNING:  # the end could not be written (read-only)
        summary = {**summary, "status": "failed", "error": str(exc)}
    typer.echo(json.dumps(results.to_jsonable(summary)))


def run_and_report(run: Callable[[], object], *, as_json: bool,
                   print_report: Callable[[dict, Path], None]) -> None:
    """Run; with --json print one document (the summary, or the failed run's), else the report.

    A failed run without --json propagates as RunFailed: the root group prints it once.
    """
    try:
        outcome = run()
    except RunFailed as exc:
        if not (as_json and exc.run_path):
            raise
        echo_failure_json(exc)
        raise typer.Exit(exc.exit_code) from None
    if outcome.run_path is None:  # a non-writing torchrun rank
        return
    if as_json:
        typer.echo(json.dumps(results.to_jsonable(outcome.summary)))
        return
    print_report(outcome.summary, outcome.run_path)


def params_table(params: dict, title: str):
    """A rich table of parameter counts by category."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("category")
    table.add_column("parameters", justify="right", no_wrap=True)
    for name, count in params.items():
        table.add_row(name, f"{count:,}  ({count / 1e6:,.3f} M)")
    return table
