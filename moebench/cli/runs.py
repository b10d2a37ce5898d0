"""`moebench runs`: every run folder under the results root, newest first, with its status as a
reader should see it ("abandoned" where the writer died while the files said "running")."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moebench.bounds import Name
from moebench.cli import flags

app = typer.Typer()

KIND_BOUND = Name(what="kind")
"""--kind: a run kind's folder name (fastmoe, parity, ...): a name, not a path."""


EXAMPLES = """Examples:

\b
  moebench runs
  moebench runs --kind fastmoe --json"""


@app.command("runs", epilog=EXAMPLES)
def runs(
    kind: Optional[str] = flags.bounded_option(None, "--kind", bound=KIND_BOUND, metavar="KIND",
                                               help="Only this kind (fastmoe, deepspeed, parity, env, ...)."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """List the runs under the results root: kind, run id, status, wall time."""
    from moebench import results
    from moebench.errors import UserError

    if kind is not None and not kind.strip():
        raise UserError("is empty; give a kind or leave the flag out", flag="--kind")
    if results_dir is not None and not results_dir.strip():
        raise UserError("is empty; pass a folder (or leave it out for ./results)", flag="--results-dir")
    root = results.results_root(results_dir)
    kinds = [kind] if kind else sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    rows = []
    for name in kinds:
        for run in results.latest_runs(name, root):
            try:
                summary = results.read_json(run / "summary.json")
            except (OSError, ValueError):
                summary = {}
            rows.append({"kind": name, "run_id": run.name, "status": results.status_of(run),
                         "wall_time_s": summary.get("wall_time_s"), "run_path": str(run)})
    if as_json:
        typer.echo(json.dumps({"runs": rows}, indent=2))
        return
    if not rows:
        typer.echo(f"no runs under {root}")
        return
    for row in rows:
        wall = "-" if row["wall_time_s"] is None else f"{row['wall_time_s']:.1f} s"
        typer.echo(f"{row['kind']:<10} {row['run_id']:<36} {row['status']:<12} {wall:>9}")
