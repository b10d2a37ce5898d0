"""`moebench gpu-check`: the chapter on a CUDA machine, step by step (moebench.gpucheck)."""

from __future__ import annotations

import json
import textwrap
from typing import Optional

import typer

from moebench import bounds
from moebench.cli import flags
from moebench.cli.help import PanelCommand
from moebench.errors import UserError

app = typer.Typer()

WIDTH = 80


def _step_names() -> list[str]:
    from moebench.gpucheck.steps import NAMES

    return list(NAMES)


SKIP_BOUND = bounds.Items(item=bounds.Name(what="step", choices=_step_names, listed_by="moebench gpu-check --list"),
                          example="bench", max_items=16)
SRC_BOUND = bounds.Path(folder=True, must_exist=True)
BUILD_BOUND = bounds.Path(folder=True, writable=True)

EXAMPLES = """Examples:

\b
  moebench gpu-check --list                 the steps and their budgets
  moebench gpu-check --fastmoe-src .        in a fastmoe clone: every step
  moebench gpu-check --skip bench,layers --json     an installed fmoe"""


def _print_list(as_json: bool) -> None:
    from moebench.gpucheck import steps

    if as_json:
        typer.echo(json.dumps({"steps": [dict(zip(("name", "budget", "needs", "title"), row))
                                         for row in steps.describe()],
                               "one_gpu_budget_s": steps.one_gpu_budget_s()}))
        return
    for name, budget, needs, title in steps.describe():
        typer.echo(f"{name:<19} {budget:<11} {needs}")
        typer.echo(textwrap.fill(title, WIDTH, initial_indent="    ", subsequent_indent="    "))
    typer.echo(f"one-GPU steps and overhead: {steps.one_gpu_budget_s():.0f} s at most "
               f"(target {steps.TOTAL_BUDGET_S:.0f} s)")


def _print_record(record: dict) -> None:
    head = f"{record['name']:<19} {record['status']:<8}"
    if record["status"] != "skip" and record["budget_s"]:
        head += f" {record['elapsed_s']:>5.0f} s of {record['budget_s']:.0f}"
    typer.echo(head)
    if record["reason"]:
        typer.echo(textwrap.fill(record["reason"], WIDTH, initial_indent="    ", subsequent_indent="    ",
                                 break_long_words=True))


@app.command("gpu-check", epilog=EXAMPLES, cls=PanelCommand)
def gpu_check(
    fastmoe_src: Optional[str] = flags.bounded_option(
        None, "--fastmoe-src", bound=SRC_BOUND, metavar="DIR",
        help="A fastmoe source tree (a clone of github.com/laekov/fastmoe) to build; never downloaded. "
             "Without it an installed fmoe is used, else the fmoe steps fail."),
    fastmoe_build: Optional[str] = flags.bounded_option(
        None, "--fastmoe-build", bound=BUILD_BOUND, metavar="DIR",
        help="Where fastmoe is built (default: the run's own folder); a build with the same inputs there "
             "is reused."),
    skip: Optional[str] = flags.bounded_option(
        None, "--skip", bound=SKIP_BOUND, metavar="STEPS", help="Comma list of steps not to run (--list names them)."),
    list_steps: bool = flags.shared_option("list_names"),
    as_json: bool = flags.shared_option("as_json"),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
) -> None:
    """On a CUDA machine: build the real fastmoe, compare it with the reference, run both chapter
    presets and DeepSpeed's on the GPU, bench the layers, NCCL with 2+ GPUs; one results folder.

    Exit code 0 when every step passed or was skipped, 1 when one failed or hit its deadline, 2 on bad
    flags or on a machine without a CUDA GPU (then nothing is created).
    """
    if list_steps:
        _print_list(as_json)
        raise typer.Exit(0)
    from moebench.gpucheck import build, preflight

    gpus = preflight.probe()
    refused = preflight.refusal(gpus)
    if refused is not None:
        raise UserError(refused)
    if fastmoe_src and build.source_problem(fastmoe_src):
        raise UserError(build.source_problem(fastmoe_src), flag="--fastmoe-src")
    from moebench import results

    results.check_root(results_dir, "gpu-check")
    from moebench.gpucheck.runner import run_gpu_check

    if not as_json:
        typer.echo(preflight.describe(gpus))
        typer.echo(f"python: {gpus.python}")  # its own line: a path is never folded
    doc, code = run_gpu_check(gpus, fastmoe_src=fastmoe_src, fastmoe_build=fastmoe_build, results_dir=results_dir,
                              skip=tuple(s.strip() for s in skip.split(",")) if skip else (),
                              log=None if as_json else _print_record)
    if as_json:
        typer.echo(json.dumps(results.to_jsonable(doc), indent=2))
    else:
        counts = doc["counts"]
        typer.echo(f"gpu-check: {counts['pass']} pass, {counts['fail']} fail, {counts['timeout']} timeout, "
                   f"{counts['skip']} skip in {doc['elapsed_s']:.0f} s")
        typer.echo(f"saved {doc['results_path']}")
    raise typer.Exit(code)
