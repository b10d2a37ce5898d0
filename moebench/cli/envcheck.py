"""`moebench env-check`: probe the environment, print a table (or JSON, or a bug-report block), save the JSON."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moebench.cli import flags
from moebench.cli.help import PanelCommand
from moebench.envcheck.check import PROBE_TIMEOUT_BOUND  # torch-free: the one limit
from moebench.errors import UserError

app = typer.Typer()


EXAMPLES = """Examples:

\b
  moebench env-check                       every item, a live 2-rank probe
  moebench env-check --strict --no-probe   a warning fails too; no probe
  moebench env-check --json > env.json"""


@app.command("env-check", epilog=EXAMPLES, cls=PanelCommand)
def env_check(
    as_json: bool = flags.shared_option("as_json"),
    no_probe: bool = typer.Option(False, "--no-probe", help="Skip the live collective probe (2 local ranks)."),
    probe_timeout: float = flags.bounded_option(
        30.0,
        "--probe-timeout",
        bound=PROBE_TIMEOUT_BOUND,
        metavar="SECONDS",
        help="Deadline of the collective probe; a probe still running then is reported as hung.",
    ),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 on warnings too, not only on failures."),
    report: bool = typer.Option(
        False, "--report", help="Print a plain block to paste into a bug report instead of the table."
    ),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
) -> None:
    """Probe torch / CUDA / NCCL / gloo / DeepSpeed / fastmoe: per item ok / warn / fail / skip and the fix.

    Exit code 0 when nothing failed, 1 when something failed (--strict: or warned), 2 on bad flags.
    """
    from moebench.envcheck.check import require_probe_timeout

    require_probe_timeout(probe_timeout)
    if as_json and report:
        raise UserError("cannot be combined with --json (pick one output)", flag="--report")
    from moebench import results
    from moebench.rankenv import is_printer

    results.check_root(results_dir, "env")
    if not is_printer():  # under torchrun: rank 0 probes, prints and saves; the others stay quiet
        raise typer.Exit(0)

    from moebench.envcheck import render
    from moebench.envcheck.runner import check_and_record

    outcome, document, code = check_and_record(probe=not no_probe, probe_timeout_s=probe_timeout, strict=strict,
                                                results_dir=results_dir)

    if as_json:
        typer.echo(json.dumps(results.to_jsonable(document), indent=2))
    elif report:
        typer.echo(render.bug_report_block(outcome))
    else:
        from moebench.console import terminal_console

        console = terminal_console()
        render.print_report(outcome, console)
        console.print(f"saved {outcome.results_path}", style="dim")
    raise typer.Exit(code)
