"""What the run commands share: their `--json` documents."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moebench import results
from moebench.errors import RunFailed


def echo_failure_json(exc: RunFailed) -> None:
    """--json and the run failed: the run's summary.json (status "failed", error) and its path."""
    try:
        summary = results.read_json(Path(exc.run_path) / "summary.json")
    except (OSError, ValueError):  # died before summary.json was written
        summary = {"status": "failed", "error": str(exc)}
    typer.echo(json.dumps(results.to_jsonable({**summary, "run_path": str(exc.run_path)})))
