"""`moebench env-check`: probe the environment, print a table (or JSON, or a bug-report block), save the JSON."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from moebench.bounds import Number
from moebench.cli import flags
from moebench.errors import UserError

app = typer.Typer()

MAX_PROBE_TIMEOUT_S = 3600.0
"""The probe starts 2 ranks for one all-reduce: an hour is far past any working machine."""
PROBE_TIMEOUT_BOUND = Number(integer=False, min=0, above=True, max=MAX_PROBE_TIMEOUT_S, why="1 h")
REPORT_FILE = "envcheck.json"


EXAMPLES = """Examples:

\b
  moebench env-check                       every item, a live 2-rank probe
  moebench env-check --strict --no-probe   a warning fails too; no probe
  moebench env-check --json > env.json"""


@app.command("env-check", epilog=EXAMPLES)
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
    if not 0 < probe_timeout <= MAX_PROBE_TIMEOUT_S:
        raise UserError(
            f"must be in (0, {MAX_PROBE_TIMEOUT_S:.0f}] seconds, got {probe_timeout:g}", flag="--probe-timeout"
        )
    if as_json and report:
        raise UserError("cannot be combined with --json (pick one output)", flag="--report")
    from moebench import results
    from moebench.distributed.env import is_printer

    results.check_root(results_dir, "env")
    if not is_printer():  # under torchrun: rank 0 probes, prints and saves; the others stay quiet
        raise typer.Exit(0)
    root = results.results_root(results_dir)

    from moebench.envcheck import render, run_all

    started = time.time()
    outcome = run_all(probe=not no_probe, probe_timeout_s=probe_timeout)
    run = results.RunDir.create("env", root=root, started=started)  # its wall time is the checks' time
    outcome.results_path = str(run.path / REPORT_FILE)
    document = outcome.to_dict()
    run.write_json(REPORT_FILE, document)
    code = outcome.exit_code(strict)
    run.finish(results.STATUS_OK if outcome.status != "fail" else results.STATUS_FAILED,
               {"counts": document["counts"], "exit_code": code,
                "strict": strict, "report": REPORT_FILE})

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
