"""`moebench verify-parity`: multi-rank parity checks against single-process references."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from moebench.cli import flags
from moebench.distributed.env import is_printer as _is_printer
from moebench.errors import UserError

app = typer.Typer()


def _list(as_json: bool) -> None:
    import dataclasses

    from moebench.libraries import registry as libraries
    from moebench.libraries.table import library_list
    from moebench.parity.registry import IMPORT_ERRORS, all_checks

    checks = all_checks()
    statuses = libraries.statuses()
    if as_json:
        typer.echo(json.dumps({"checks": [
            {"name": c.name, "seed": c.seed_source, "description": c.description,
             "min_world_size": c.min_world_size, "max_world_size": c.max_world_size,
             "requires": list(c.requires), "impl_keys": list(c.impl_keys)} for c in checks],
            "import_errors": {m: e.strip().splitlines()[-1] for m, e in IMPORT_ERRORS.items()},
            "libraries": [{**dataclasses.asdict(s), "can_run": s.why_not is None} for s in statuses]}, indent=2))
        return
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="verify-parity checks")
    table.add_column("name", no_wrap=True)
    for col in ("seed", "ranks", "--impl", "asserts"):
        table.add_column(col)
    for c in checks:
        sizes = f">= {c.min_world_size}" + (f", <= {c.max_world_size}" if c.max_world_size else "")
        table.add_row(c.name, escape(c.seed_source), sizes, ",".join(c.impl_keys), escape(c.description))
    console = _console()
    console.print(table)
    for module, error in IMPORT_ERRORS.items():
        console.print(f"[yellow]check module {module} did not import: {error.strip().splitlines()[-1]}[/]")
    typer.echo("\nlibraries (verify-parity --library NAME):")
    typer.echo(library_list(statuses))


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped / captured: do not squeeze the table into 80 columns
        console = Console(width=120)
    return console


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def _print_table(summary: dict) -> None:
    from rich import box
    from rich.table import Table

    console = _console()
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"verify-parity: {summary['world_size']} rank(s), {summary['comm_backend']}, "
        f"tolerance {summary['tolerance']}",
    )
    table.add_column("check", no_wrap=True)
    for col in ("result", "max abs", "max rel", "rtol/atol", "magnitude", "vacuous", "time"):
        table.add_column(col)
    colour = {"pass": "green", "fail": "red", "skip": "yellow"}
    for c in summary["checks"]:
        vac = f"[yellow]{c['vacuous']} VACUOUS[/]" if c["vacuous"] else "0"
        if c.get("unasserted"):
            vac += f" ({c['unasserted']} unasserted)"
        table.add_row(c["name"], f"[{colour[c['status']]}]{c['status']}[/]", _fmt(c["max_abs_diff"]),
                      _fmt(c["max_rel_diff"]), c["tolerance"] or "-", _fmt(c["magnitude"]), vac,
                      f"{c['elapsed_s']:.1f}s")
    console.print(table)
    for c in summary["checks"]:
        if c["reason"] and (c["status"] != "pass" or c.get("unasserted_outside")):
            console.print(f"[bold]{c['name']}[/] ({c['status']}):", highlight=False)
            if c.get("diagnosis"):
                console.print(f"diagnosis: {c['diagnosis']['name']}: {c['diagnosis']['sentence']}",
                              markup=False, highlight=False)
            console.print(c["reason"], markup=False, highlight=False)
    counts = summary["counts"]
    console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped; "
                  f"{summary['vacuous_total']} vacuous comparison(s); {summary['wall_time_s']:.1f} s; "
                  f"saved to {summary['run_path']}", highlight=False)
    if summary["vacuous_total"]:
        console.print("[yellow]vacuous: the tolerance is not below the magnitude compared (or the comparison "
                      "is not asserted at all), so an all-zero result would pass.[/]")


def _print_library_table(summary: dict) -> None:
    from moebench.libraries.table import conformance

    typer.echo(f"verify-parity --library: {len(summary['rows'])} row(s), {summary['comm_backend']}, "
               f"tolerance {summary['tolerance']}")
    typer.echo(conformance(summary["rows"]))
    counts = summary["counts"]
    typer.echo(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped; "
               f"{summary['vacuous_total']} vacuous comparison(s); {summary['wall_time_s']:.1f} s")
    typer.echo(f"saved to {summary['run_path']}")


def _library_names(library: Optional[str]) -> list[str]:
    names = list(dict.fromkeys(n.strip() for n in (library or "").split(",") if n.strip()))
    if not names:
        raise UserError("names no library; give one or more (see --list), e.g. --library fairscale",
                        flag="--library")
    return names


@app.command("verify-parity")
def verify_parity(
    world_size: Optional[int] = flags.leaf_option(flags.SHARED_FIELDS["world_size"], value=None,
                                                  shown="4; with --library: 2 and 4"),
    checks: Optional[str] = typer.Option(
        None, "--checks", metavar="NAMES", help="Comma-separated check names (default: all; see --list)."
    ),
    list_checks: bool = flags.shared_option("list_names"),
    timeout: float = flags.shared_option("timeout_s", 120.0),
    comm_backend: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = flags.shared_option("comm_backend", "auto"),
    backend_old: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = typer.Option(
        None, "--backend", hidden=True, case_sensitive=False, help="Old spelling of --comm-backend."
    ),
    tolerance: str = typer.Option(
        "strict", "--tolerance", help="strict (relative to magnitude) or seed (the seeds' own)."
    ),
    impl: List[str] = typer.Option(
        [],
        "--impl",
        metavar="KEY=MOD:ATTR",
        help="Verify your code: KEY all-gather, experts, ddp, replicate, moe, moe-sync or switch-gate "
        "(repeatable; contracts: docs/verify-parity.md).",
    ),
    as_json: bool = flags.shared_option("as_json"),
    debug_collectives: bool = typer.Option(
        False, "--debug-collectives", help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every rank."
    ),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    seed: int = flags.shared_option("seed", 0),
    library: Optional[str] = typer.Option(
        None, "--library", metavar="NAME[,NAME]",
        help="Verify installed MoE libraries instead of the checks: each library's rows (model x backend x "
        "EP mode) at world sizes 2 and 4, or at --world-size when given (see --list; docs/libraries.md).",
    ),
) -> None:
    """Run the parity checks: exit 0 when all ran passed, 1 when any failed or none ran, 2 on bad input."""
    if list_checks:
        _list(as_json)
        return
    if library is not None and checks is not None:
        raise UserError("runs the library rows, not checks; drop --checks or --library", flag="--library")
    import contextlib
    import functools

    from moebench.console import stdout_to_stderr
    from moebench.parity.registry import parse_impls
    from moebench.parity.runner import ParityConfig
    from moebench.parity.runner import verify_parity as run
    from moebench.results import check_root

    check_root(results_dir, "parity")
    names = tuple(n.strip() for n in checks.split(",") if n.strip()) if checks is not None else ()
    if checks is not None and not names:
        raise UserError("names no check; give check names (see --list) or leave the flag out", flag="--checks")
    config = ParityConfig(
        world_size=4 if world_size is None else world_size,
        checks=names,
        timeout_s=timeout,
        comm_backend=backend_old or comm_backend,
        tolerance=tolerance,
        impls=parse_impls(impl, timeout_s=timeout),
        debug_collectives=debug_collectives,
        seed=seed,
    )

    def progress(record) -> None:
        if _is_printer() and not as_json:
            typer.echo(f"  {record.name}: {record.status} ({record.elapsed_s:.1f} s)", err=True)

    # --json: stdout carries the one document; whatever else writes there (DeepSpeed's warnings
    # at import in this process, C++ prints) goes to stderr for the whole run.
    quiet_stdout = stdout_to_stderr() if as_json else contextlib.nullcontext()
    execute = run
    if library is not None:  # the library rows instead of the checks, through the same runner
        from moebench.libraries.runner import DEFAULT_WORLD_SIZES, config_fields, verify_libraries

        names = _library_names(library)
        sizes = DEFAULT_WORLD_SIZES if world_size is None else (world_size,)
        execute = functools.partial(verify_libraries, names, sizes, config_fields=config_fields(config))
    try:
        with quiet_stdout:
            summary = execute(config, results_dir=results_dir, on_record=progress) if library is None else \
                execute(results_dir=results_dir, on_record=progress)
    except KeyboardInterrupt:
        if _is_printer():
            typer.echo("verify-parity: interrupted; every rank was stopped", err=True)
        raise typer.Exit(130) from None
    if _is_printer():
        if as_json:
            typer.echo(json.dumps(_jsonable(summary), indent=2))
        elif library is not None:
            _print_library_table(summary)
        else:
            _print_table(summary)
        if summary.get("reason"):
            typer.echo(summary["reason"], err=True)
    raise typer.Exit(0 if summary["status"] == "ok" else 1)


def _jsonable(doc):
    from moebench.results import to_jsonable

    return to_jsonable(doc)
