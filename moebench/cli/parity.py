"""`moebench verify-parity`: multi-rank parity checks against single-process references."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from moebench.bounds import Items, Name, Path, Text
from moebench.cli import flags, parity_console
from moebench.errors import UserError
from moebench.rankenv import debug
from moebench.rankenv import is_printer as _is_printer

app = typer.Typer()

TOLERANCES = ("strict", "seed")


def _check_names() -> list[str]:
    from moebench.parity.registry import all_checks

    return [c.name for c in all_checks()]


def _library_names_known() -> list[str]:
    from moebench.libraries.registry import known

    return list(known())


BOUNDS = {
    "--checks": Items(item=Name(what="check", choices=_check_names,
                                 listed_by="moebench verify-parity --list"), example="experts"),
    "--tolerance": Name(what="tolerance", choices=lambda: list(TOLERANCES)),
    "--library": Items(item=Name(what="library", choices=_library_names_known,
                                  listed_by="moebench verify-parity --list"), example="fairscale"),
    "--impl": Text(what="KEY=package.module:attribute", pattern=r"[a-z-]+=[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"),
    "--ds-config": Path(folder=False, must_exist=True),
    "--hf-config": Path(folder=False, must_exist=True),
    "--recipe": Path(folder=False, must_exist=True),
    "--torchtitan-args": Text(what="torchtitan.train argument list", max_chars=4096),
    "--allow-import": Text(what="Python module name", pattern=r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*",
                           hint="a dotted module name, e.g. my_pkg.models"),
    "--repro": Path(folder=True, writable=True),
    "--adapter": Text(what="package.module:ATTRIBUTE", pattern=r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"),
    "--row": Text(what="row key or glob", pattern=r"[^\s,]+"),
}
"""verify-parity's own valued options (the shared ones carry their config field's bound)."""


def _print_library_end(summary: dict) -> None:
    """The close of a library run's console (its table was printed row by row, as each ended)."""
    counts = summary["counts"]
    refused = f", {counts['refused']} refused" if counts.get("refused") else ""
    typer.echo(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped{refused}; "
               f"{summary['vacuous_total']} vacuous comparison(s); {summary['wall_time_s']:.1f} s")
    typer.echo(f"saved to {summary['run_path']}")


def _print_notes(summary_extra: dict) -> None:
    """What the rows take from the user's own setup: the flags given, then one line per note."""
    import os
    import textwrap

    from moebench.libraries.records import WIDTH

    setup = summary_extra["setup"]
    given = [f"{flag} {value if flag == '--torchtitan-args' else os.path.basename(value)}"  # whole paths: summary.json
             for flag, value in setup["given"].items()]
    typer.echo("\n".join(textwrap.wrap(", ".join(given) + ":", WIDTH, subsequent_indent="    ",
                                       break_on_hyphens=False)))
    notes = list(setup["notes"])
    if "ds_config" in summary_extra:
        from moebench.libraries.deepspeed.user_config import verified_line

        notes.insert(0, verified_line(summary_extra["ds_config"]["settings"]))
    for note in notes:
        typer.echo("\n".join(textwrap.wrap(note, WIDTH, initial_indent="  ", subsequent_indent="    ",
                                           break_on_hyphens=False)))


EXAMPLES = """Examples:

\b
  moebench verify-parity -n 4            every check on 4 local ranks
  moebench verify-parity -n 2 --checks ddp-sgd,experts
  moebench verify-parity -n 9 --checks experts --tolerance seed \\
      --impl experts=soft_moe_pytorch.soft_moe:Experts
  moebench verify-parity --library fairscale,transformers
  moebench verify-parity --library deepspeed --resume -n 4
  moebench verify-parity --library deepspeed -n 2 --row '*/zero0/ep=2/w2/clip'
  moebench verify-parity --adapter my_pkg.moe_adapter:ADAPTER -n 2
  moebench verify-parity --list"""


@app.command("verify-parity", epilog=EXAMPLES)
def verify_parity(
    ctx: typer.Context,
    world_size: Optional[int] = flags.leaf_option(flags.SHARED_FIELDS["world_size"], value=None,
                                                  shown="4; with --library: 2 and 4"),
    checks: Optional[str] = flags.bounded_option(
        None, "--checks", bound=BOUNDS["--checks"], metavar="NAMES",
        help="Comma-separated check names (default: all; see --list)."
    ),
    list_checks: bool = flags.shared_option("list_names"),
    timeout: float = flags.shared_option("timeout_s", 120.0),
    comm_backend: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = flags.shared_option("comm_backend", "auto"),
    backend_old: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = typer.Option(
        None, "--backend", hidden=True, case_sensitive=False, help="Old spelling of --comm-backend."
    ),
    tolerance: str = flags.bounded_option(
        "strict", "--tolerance", bound=BOUNDS["--tolerance"], metavar="strict|seed",
        help="strict: relative to the magnitude compared, with an absolute floor; seed: each seed's own "
             "assertions, exactly (docs/verify-parity.md).",
    ),
    impl: List[str] = flags.bounded_option(
        [],
        "--impl",
        bound=BOUNDS["--impl"],
        metavar="KEY=MOD:ATTR",
        help="Verify your code: KEY all-gather, experts, ddp, replicate, moe, moe-sync or switch-gate "
        "(repeatable; contracts: docs/verify-parity.md).",
    ),
    as_json: bool = flags.shared_option("as_json"),
    json_full: bool = typer.Option(
        False, "--json-full", help="With --json: print every comparison of every check (--json alone prints each "
        "check's failed comparisons; summary.json always holds them all).",
    ),
    debug_collectives: bool = typer.Option(
        False, "--debug-collectives", help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every rank."
    ),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    seed: int = flags.shared_option("seed", 0),
    library: Optional[str] = flags.bounded_option(
        None, "--library", bound=BOUNDS["--library"], metavar="NAME[,NAME]",
        help="Verify installed MoE libraries instead of the checks: each library's rows (model x backend x "
        "EP mode) at world sizes 2 and 4, or at --world-size when given (see --list; docs/libraries.md).",
    ),
    ds_config: Optional[str] = flags.bounded_option(
        None, "--ds-config", bound=BOUNDS["--ds-config"], metavar="FILE",
        help="Verify your DeepSpeed config: its ZeRO stage, gradient_clipping, gradient_accumulation_steps "
        "and precision on the engine rows (and AutoEP's, with --library autoep), optimizer replaced by SGD "
        "(implies --library deepspeed).",
    ),
    hf_config: Optional[str] = flags.bounded_option(
        None, "--hf-config", bound=BOUNDS["--hf-config"], metavar="FILE",
        help="Verify your model: a config.json (as from_pretrained reads it), its MoE settings kept, its sizes "
        "shrunk (implies --library transformers; autoep and automodel read it too).",
    ),
    recipe: Optional[str] = flags.bounded_option(
        None, "--recipe", bound=BOUNDS["--recipe"], metavar="FILE",
        help="Verify your NeMo Automodel recipe YAML, read by Automodel's own loader (implies --library "
        "automodel).",
    ),
    torchtitan_args: Optional[str] = flags.bounded_option(
        None, "--torchtitan-args", bound=BOUNDS["--torchtitan-args"], metavar="ARGS",
        help="Verify your torchtitan launch: the arguments you give torchtitan.train, in one string, e.g. "
        "--torchtitan-args='--module deepseek_v3 --config deepseek_v3_16b' (implies --library torchtitan).",
    ),
    allow_import: List[str] = flags.bounded_option(
        [], "--allow-import", bound=BOUNDS["--allow-import"], metavar="MODULE",
        help="Let a --recipe _target_ or a --torchtitan-args --module name code outside its framework: that "
        "module (and those under it) is imported (repeatable).",
    ),
    repro: Optional[str] = flags.bounded_option(
        None, "--repro", bound=BOUNDS["--repro"], metavar="DIR",
        help="With --library: write a standalone script (python, torch and the library only) reproducing each "
        "failing row into DIR, for an upstream bug report (docs/libraries.md).",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="With --library: add the resume rows (save, load into a fresh model at the same "
        "and another layout, continue; vs the uninterrupted run). A load the library refuses is verdict "
        "'refused' (its message), which does not fail the run.",
    ),
    adapters: List[str] = flags.bounded_option(
        [], "--adapter", bound=BOUNDS["--adapter"], metavar="MOD:ATTR",
        help="Verify your own MoE: run the rows of your adapter object (package.module:ATTRIBUTE, written against "
        "moebench.libraries.spec; docs/adding-a-library.md) like a built-in library's.",
    ),
    row: List[str] = flags.bounded_option(
        [], "--row", bound=BOUNDS["--row"], metavar="KEY",
        help="With --library or --adapter: run only the rows whose key matches (shell glob; repeatable), e.g. "
        "--row 'deepspeed/engine/zero0/ep=2/w2/clip'.",
    ),
) -> None:
    """Run the parity checks: exit 0 when all ran passed, 1 when any failed or none ran, 2 on bad input."""
    if json_full and not as_json:
        raise UserError("prints every comparison of --json's document; add --json", flag="--json-full")
    if len(adapters) > 1:
        raise UserError(f"given {len(adapters)} times ({', '.join(adapters)}); one adapter a run: verify each in "
                        "a run of its own", flag="--adapter")
    adapter = adapters[0] if adapters else None
    setup = dict(ds_config=ds_config, hf_config=hf_config, recipe=recipe, torchtitan_args=torchtitan_args,
                 allow_imports=tuple(allow_import))
    setup_flag = next((f for f, v in (("--ds-config", ds_config), ("--hf-config", hf_config), ("--recipe", recipe),
                                      ("--torchtitan-args", torchtitan_args)) if v is not None), None)
    if allow_import and setup_flag is None:
        raise UserError("lets a --recipe or --torchtitan-args import code outside its framework; give one of them "
                        "too, or drop it", flag="--allow-import")
    rows_asked = library is not None or adapter is not None or setup_flag is not None
    if list_checks:
        if rows_asked:  # the rows they would run, with their keys (for --row)
            from moebench.libraries import verify

            request = verify.LibraryRequest(libraries=verify.names_of(library) if library is not None else (),
                                            adapter=adapter, world_size=world_size, resume=resume,
                                            rows=tuple(row), timeout_s=timeout, **setup)
            parity_console.print_rows(verify.list_rows(request), as_json)
            return
        parity_console.print_list(as_json)
        return
    if rows_asked and checks is not None:
        flag = "--library" if library is not None else "--adapter" if adapter is not None else setup_flag
        raise UserError("runs the library rows, not checks; drop --checks or " + flag, flag=flag)
    needs_rows = (("--repro", repro is not None, "writes scripts for failing library rows; add --library NAME"),
                  ("--resume", resume, "adds resume rows to a library's matrix; give --library NAME too, e.g. "
                                       "--library deepspeed"),
                  ("--row", bool(row), "selects library rows; give --library NAME (or --adapter) too"))
    for flag, given, why in needs_rows:
        if given and not rows_asked:
            raise UserError(why, flag=flag)
    import contextlib
    import dataclasses
    import functools

    from moebench.config import require_launch_env, require_launched_world
    from moebench.console import stdout_to_stderr
    from moebench.libraries import verify
    from moebench.libraries.records import Table, row_record
    from moebench.parity.runner import parity_config
    from moebench.parity.runner import verify_parity as run
    from moebench.rankenv import is_launched_rank
    from moebench.resources import require_ranks_fit
    from moebench.results import check_root

    require_launch_env()
    check_root(results_dir, "parity")
    if is_launched_rank() and ctx.get_parameter_source("world_size").name == "COMMANDLINE":
        require_launched_world(world_size)  # torchrun's WORLD_SIZE decides: a flag saying otherwise is refused
    if not rows_asked:
        require_ranks_fit(4 if world_size is None else world_size)

    table = None

    def progress(record) -> None:
        if not _is_printer() or as_json:
            return
        if table is None:
            typer.echo(f"  {record.name}: {record.status} ({record.elapsed_s:.1f} s)", err=True)
            return
        row = row_record(dataclasses.asdict(record))  # a library row: its table line(s), once, as it ends
        for line in table.row({**row, **verify.annotation(prepared, config)(row)}):
            typer.echo(line)
        if debug() and record.launch_status not in ("ok", ""):  # --debug: the ranks' own words, whole
            typer.echo(record.reason, err=True)

    # --json: stdout carries the one document; whatever else writes there (DeepSpeed's warnings at import in this
    # process, C++ prints, a user's --adapter or --impl module printing at import) goes to stderr for the whole run.
    quiet_stdout = stdout_to_stderr() if as_json else contextlib.nullcontext()
    try:
        with quiet_stdout:
            config = parity_config(world_size=4 if world_size is None else world_size, checks=checks,
                                   timeout_s=timeout, comm_backend=backend_old or comm_backend, tolerance=tolerance,
                                   impls=impl, debug_collectives=debug_collectives, seed=seed)
            execute = run
            if rows_asked:  # the library rows instead of the checks, through the same runner
                request = verify.LibraryRequest(
                    libraries=verify.names_of(library) if library is not None else (), adapter=adapter,
                    world_size=world_size, resume=resume, repro=repro, rows=tuple(row), timeout_s=timeout,
                    **setup)
                prepared = verify.prepare(request, results_dir)
                execute = functools.partial(verify.run, prepared)
                if _is_printer() and not as_json:
                    if prepared.summary_extra.get("setup"):
                        _print_notes(prepared.summary_extra)
                    table = Table(list(prepared.previews))
                    typer.echo(f"verify-parity --library: {len(prepared.previews)} row(s), tolerance {tolerance}")
                    for line in table.head():
                        typer.echo(line)
            summary = execute(config, results_dir=results_dir, on_record=progress)
    except KeyboardInterrupt as exc:
        if _is_printer():
            from moebench import signals

            typer.echo(f"verify-parity: {signals.interrupted_message(getattr(exc, 'run_path', None))}", err=True)
        raise typer.Exit(130) from None
    if _is_printer():
        if as_json:
            from moebench.parity.printed import failed_only

            typer.echo(json.dumps(_jsonable(summary if json_full else failed_only(summary)), indent=2))
        elif rows_asked:
            _print_library_end(summary)
            from moebench.libraries.repro import lines as repro_lines

            for line in repro_lines(summary):
                typer.echo(line, err=line.startswith("error:"))
        else:
            parity_console.print_table(summary)
            from moebench.parity.printed import tested_lines

            for line in tested_lines(summary):
                typer.echo(line)
        if summary.get("reason"):
            typer.echo(summary["reason"], err=True)
        if summary.get("unsaved"):
            typer.echo(f"error: {summary['unsaved']}; the verdicts above are not saved", err=True)
    failed = summary["status"] != "ok" or summary.get("unsaved") or summary.get("repro_error")
    raise typer.Exit(1 if failed else 0)


def _jsonable(doc):
    from moebench.results import to_jsonable

    return to_jsonable(doc)
