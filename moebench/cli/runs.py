"""`moebench runs`: every run folder under the results root, newest first, with its status as a
reader should see it ("abandoned" where the writer died while the files said "running")."""

from __future__ import annotations

import json
import textwrap
from typing import Optional

import typer

from moebench.cli import flags

app = typer.Typer()


@app.command("runs")
def runs(
    kind: Optional[str] = typer.Option(None, "--kind", metavar="KIND",
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
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is a file, not a results folder; pass the folder that holds <kind>/<run-id> "
                        "folders (default ./results)", flag="--results-dir")
    kinds = [kind] if kind else sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    rows = []
    for name in kinds:
        for run in results.latest_runs(name, root):
            files = results.read_run(run)  # every file through its schema: damage is named, never a crash
            summary = files.summary if not files.damage else {}
            rows.append({"kind": name, "run_id": run.name, "status": files.status,
                         "wall_time_s": summary.get("wall_time_s"), "run_path": str(run),
                         **({"damage": files.damage} if files.damage else {})})
    if as_json:
        typer.echo(json.dumps({"runs": rows}, indent=2))
        return
    if not rows:
        typer.echo(f"no runs under {root}")
        return
    for row in rows:
        wall = "-" if row["wall_time_s"] is None else f"{row['wall_time_s']:.1f} s"
        typer.echo(f"{row['kind']:<10} {row['run_id']:<36} {row['status']:<12} {wall:>9}")
        if row.get("damage"):
            typer.echo(textwrap.fill(row["damage"], width=DAMAGE_WIDTH, initial_indent="  damaged: ",
                                     subsequent_indent="    "))


DAMAGE_WIDTH = 80
"""The damage line under a run is wrapped at 80 columns."""
