"""`moebench report [RUN ...]`: did the chapter reproduce? A verdict per claim, the figures, the page."""

from __future__ import annotations

import json
import textwrap
from typing import List, Optional

import typer

from moebench import bounds
from moebench.bounds import Name
from moebench.cli import flags
from moebench.cli.help import PanelCommand

app = typer.Typer()

RUN_BOUND = bounds.Path(folder=True, must_exist=True)
"""RUN: an existing run folder."""
SINCE_BOUND = Name(what="time", max_chars=40, pattern=r"[0-9][0-9T:. +-]*", hint="e.g. 2026-11-23T15:04:05")
"""--since: a time stamp (its format is checked by report.collect.parse_since)."""


EXAMPLES = """Examples:

\b
  moebench report                        the latest run of each kind
  moebench report --since 20261123-150405
  moebench report results/fastmoe/<run-id> results/fastmoe/<run-id>"""


@app.command("report", epilog=EXAMPLES, cls=PanelCommand)
def report(
    runs: Optional[List[str]] = typer.Argument(
        None, metavar="RUN", parser=bounds.Parser(RUN_BOUND, ("RUN",)),
        help="Run folders (results/<kind>/<run-id>) to read; several of one kind are compared. "
             "Default: the latest run of each kind under the results root (for a variant, its latest "
             "run of the chapter's experiment, if there is one)."),
    since: Optional[str] = flags.bounded_option(
        None, "--since", bound=SINCE_BOUND, metavar="TIME",
        help="Only runs started at or after TIME (2026-11-23T15:04:05 or 20261123-150405); an older latest run "
             "counts as not run. `make all` passes its own start."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """Build results/report/<id>/: REPORT.md, report.html (self-contained) and PNG figures, with a
    verdict per chapter claim (reproduced / differs / not run). Reads results files only."""
    from moebench.errors import UserError
    from moebench.report.build import build_report

    if results_dir is not None and not results_dir.strip():
        raise UserError("is empty; pass a folder (or leave it out for ./results)", flag="--results-dir")
    from moebench.results import check_root

    check_root(results_dir, "report")  # the folder it will write (and read): a run folder is no results folder
    outcome = build_report(list(runs or []), root=results_dir, since=since)
    if as_json:
        from moebench.report.sections.checkpoint import records

        typer.echo(json.dumps({"report_path": str(outcome.path), "counts": outcome.counts,
                               "verdicts": outcome.rows, "checkpoints": records(outcome.checkpoints),
                               "not_judged": {kind: f"{run.path}: {run.damage}"
                                              for kind, run in outcome.damaged.items()}}, default=str))
        return
    from rich.console import Console

    from moebench.report.render_console import not_run_reasons, verdict_table

    console = Console(highlight=False)
    for kind, run in outcome.primary.items():  # say which runs were judged: never a silent choice
        if run is not None:
            typer.echo(f"{kind:<10} {run.run_id} ({run.status})")
    for run in outcome.libraries:  # their own section: never the parity verdict's run
        lib_rows = run.summary.get("rows") or []
        typer.echo(f"{'library':<10} {run.run_id} ({run.status}): {len(lib_rows)} rows, "
                   + ", ".join(f"{sum(r.get('verdict') == v for r in lib_rows)} {v}" for v in ("pass", "fail", "skip"))
                   + "".join(f", {n} refused" for n in [sum(r.get("verdict") == "refused" for r in lib_rows)] if n))
    from moebench.report.sections.checkpoint import console_lines

    for line in console_lines(outcome.checkpoints):  # their own section: audits of checkpoints, no claim
        typer.echo(line)
    from moebench.console import print_fitting

    print_fitting(console, verdict_table(outcome.rows), verdict_table(outcome.rows, stacked=True))
    for line in not_run_reasons(outcome.rows):
        console.print(line)
    for kind, run in outcome.damaged.items():  # what could not be judged, and why
        claims = sum(r["variant"] == kind for r in outcome.rows)
        what = f"{claims} {kind} claim(s)" if claims else f"the {kind} section"
        typer.echo(f"not judged ({what}): run {run.run_id} is damaged:")
        typer.echo(textwrap.fill(run.damage, width=80, initial_indent="  ", subsequent_indent="    "))
    c = outcome.counts
    console.print(f"{c['reproduced']} reproduced, {c['differs']} differ, {c['not run']} not run; "
                  "reasons in REPORT.md")
    # Plain prints: a path folded at the terminal's width could not be copied.
    typer.echo(f"report: {outcome.path / 'REPORT.md'}")
    typer.echo(f"        {outcome.path / 'report.html'}")
