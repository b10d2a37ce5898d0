"""`moebench verify-parity`: multi-rank parity checks against single-process references."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from moebench.bounds import Items, Name, Path, Text
from moebench.cli import flags, parity_console
from moebench.cli.help import LISTS, PanelCommand
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


def _listed(item: str) -> str:
    """A pattern for one item, or several separated by commas (the list convention: moebench.cli.help.LISTS)."""
    return rf"{item}(?:,{item})*"


BOUNDS = {
    "--checks": Items(item=Name(what="check", choices=_check_names,
                                 listed_by="moebench verify-parity --list"), example="experts"),
    "--tolerance": Name(what="tolerance", choices=lambda: list(TOLERANCES)),
    "--library": Items(item=Name(what="library", choices=_library_names_known,
                                  listed_by="moebench verify-parity --list"), example="fairscale"),
    "--impl": Text(what="KEY=package.module:attribute", pattern=_listed(r"[a-z-]+=[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")),
    "--ds-config": Path(folder=False, must_exist=True),
    "--hf-config": Path(folder=False, must_exist=True),
    "--recipe": Path(folder=False, must_exist=True),
    "--torchtitan-args": Text(what="torchtitan.train argument list", max_chars=4096),
    "--allow-import": Text(what="Python module name", pattern=_listed(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"),
                           hint="a dotted module name, e.g. my_pkg.models"),
    "--repro": Path(folder=True, writable=True),
    "--adapter": Text(what="package.module:ATTRIBUTE", pattern=r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*"),
    "--row": Text(what="row key or glob", pattern=_listed(r"[^\s,]+")),
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


EXAMPLES = f"""Examples:

\b
  moebench verify-parity -n 4            every built-in check on 4 local ranks
  moebench verify-parity -n 2 --checks ddp-sgd,experts
  moebench verify-parity -n 9 --checks experts --tolerance seed \\
      --impl experts=soft_moe_pytorch.soft_moe:Experts
  moebench verify-parity --list          the checks, the libraries, releases
  moebench verify-parity --library fairscale,transformers
  moebench verify-parity --library deepspeed --resume -n 4
  moebench verify-parity --library deepspeed -n 2 --row '*/zero0/ep=2/w2/clip'
  moebench verify-parity --torchtitan-args '--module qwen3 \\
      --config qwen3_30b_a3b --parallelism.expert_parallel_degree 8 \\
      --training.disable_cuda_graphs'
  moebench verify-parity --adapter my_pkg.moe_adapter:ADAPTER -n 2

{LISTS}

Exit status: 0 every check or row that ran passed; 1 one failed, or none ran;
2 bad input (one line naming the flag)."""

CHECKS = "The built-in checks"
LIBRARY = "A library"
LAUNCH = "Your launch (read by the framework's own parser)"
LAYER = "Your layer"
RESUME = "Resume and repro"


def _joined(values: List[str], flag: str) -> Optional[str]:
    """A list flag's values, repeated or comma-separated, as one comma list (None: not given); an item given twice
    is refused as a comma list's repeat is."""
    if not values:
        return None
    items = [item for value in values for item in value.split(",")]
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise UserError(f"{', '.join(twice)} given twice; name each once", flag=flag)
    return ",".join(items)


def _split(values: List[str]) -> List[str]:
    """A repeatable flag's values with comma-separated ones split (the list convention)."""
    return [item for value in values for item in value.split(",")]


@app.command("verify-parity", epilog=EXAMPLES, cls=PanelCommand)
def verify_parity(
    ctx: typer.Context,
    checks: List[str] = flags.bounded_option(
        [], "--checks", bound=BOUNDS["--checks"], metavar="NAME,...", rich_help_panel=CHECKS,
        help="Which checks to run (default: all; see --list).",
    ),
    tolerance: str = flags.bounded_option(
        "strict", "--tolerance", bound=BOUNDS["--tolerance"], metavar="strict|seed", rich_help_panel=CHECKS,
        help="strict: relative to the magnitude compared, with an absolute floor; seed: each seed's own "
             "assertions, exactly (docs/verify-parity.md).",
    ),
    impl: List[str] = flags.bounded_option(
        [], "--impl", bound=BOUNDS["--impl"], metavar="KEY=MOD:ATTR", rich_help_panel=CHECKS,
        help="Your function or class in place of moebench's inside a built-in check: KEY all-gather, experts, "
        "ddp, replicate, moe, moe-sync or switch-gate (contracts: docs/verify-parity.md).",
    ),
    library: List[str] = flags.bounded_option(
        [], "--library", bound=BOUNDS["--library"], metavar="NAME,...", rich_help_panel=LIBRARY,
        help="An installed MoE library's expert parallelism against one process: its rows (model x backend x "
        "EP mode) at 2 and 4 ranks, or at --world-size (see --list; docs/libraries/README.md).",
    ),
    row: List[str] = flags.bounded_option(
        [], "--row", bound=BOUNDS["--row"], metavar="KEY", rich_help_panel=LIBRARY,
        help="Only the rows whose key matches (a shell glob; --list --library NAME prints the keys), e.g. "
        "--row 'deepspeed/engine/zero0/ep=2/w2/clip'.",
    ),
    ds_config: Optional[str] = flags.bounded_option(
        None, "--ds-config", bound=BOUNDS["--ds-config"], metavar="FILE", rich_help_panel=LAUNCH,
        help="Your DeepSpeed config: its ZeRO stage, gradient_clipping, gradient_accumulation_steps and "
        "precision on the engine rows (and AutoEP's, with --library autoep); its optimizer replaced by SGD "
        "(implies --library deepspeed).",
    ),
    hf_config: Optional[str] = flags.bounded_option(
        None, "--hf-config", bound=BOUNDS["--hf-config"], metavar="FILE", rich_help_panel=LAUNCH,
        help="Your model's config.json (as from_pretrained reads it): its MoE settings kept, its sizes shrunk "
        "(implies --library transformers; autoep and automodel read it too).",
    ),
    recipe: Optional[str] = flags.bounded_option(
        None, "--recipe", bound=BOUNDS["--recipe"], metavar="FILE", rich_help_panel=LAUNCH,
        help="Your NeMo Automodel recipe YAML, read by Automodel's own loader (implies --library automodel).",
    ),
    torchtitan_args: Optional[str] = flags.bounded_option(
        None, "--torchtitan-args", bound=BOUNDS["--torchtitan-args"], metavar="ARGS", rich_help_panel=LAUNCH,
        help="Your torchtitan launch: the arguments you give torchtitan.train, in one string, e.g. "
        "--torchtitan-args='--module deepseek_v3 --config deepseek_v3_16b' (implies --library torchtitan).",
    ),
    allow_import: List[str] = flags.bounded_option(
        [], "--allow-import", bound=BOUNDS["--allow-import"], metavar="MODULE", rich_help_panel=LAUNCH,
        help="Let a --recipe _target_ or a --torchtitan-args --module name code outside its framework: that "
        "module (and those under it) is imported.",
    ),
    adapters: List[str] = flags.bounded_option(
        [], "--adapter", bound=BOUNDS["--adapter"], metavar="MOD:ATTR", rich_help_panel=LAYER,
        help="Your whole MoE layer, verified like a library: an adapter object (package.module:ATTRIBUTE; "
        "moebench.testing.Layer makes one from your layer's factory in a few lines; docs/adding-a-library.md).",
    ),
    resume: bool = typer.Option(
        False, "--resume", rich_help_panel=RESUME,
        help="Add the resume rows: the framework's own save and load on a tiny model (not your checkpoint "
        "files), into a fresh model at the same and another layout, then continue; vs the uninterrupted run. A "
        "load the library refuses reads 'refused' (its message) and does not fail the run.",
    ),
    repro: Optional[str] = flags.bounded_option(
        None, "--repro", bound=BOUNDS["--repro"], metavar="DIR", rich_help_panel=RESUME,
        help="Write a standalone script (python, torch and the library only) reproducing each failing row "
        "into DIR, for an upstream bug report.",
    ),
    world_size: Optional[int] = flags.leaf_option(flags.SHARED_FIELDS["world_size"], value=None,
                                                  shown="4; with --library: 2 and 4"),
    timeout: float = flags.shared_option("timeout_s", 120.0),
    comm_backend: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = flags.shared_option("comm_backend", "auto"),
    backend_old: flags.annotation(flags.SHARED_FIELDS["comm_backend"]) = typer.Option(
        None, "--backend", hidden=True, case_sensitive=False, help="Old spelling of --comm-backend."
    ),
    seed: int = flags.shared_option("seed", 0),
    list_checks: bool = typer.Option(
        False, "--list", help="List the checks and the libraries (with their releases) and exit; with --library "
        "or --adapter, the rows and their keys."),
    as_json: bool = flags.shared_option("as_json"),
    json_full: bool = typer.Option(
        False, "--json-full", help="With --json: print every comparison of every check (--json alone prints each "
        "check's failed comparisons; summary.json always holds them all).",
    ),
    debug_collectives: bool = typer.Option(
        False, "--debug-collectives", help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every rank."
    ),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
) -> None:
    """Check expert-parallel MoE code on several ranks against the same mathematics on one process.

    What it checks: moebench's built-in checks (the chapter's seeds), an installed library (--library), your
    launch's settings, or your own layer (--adapter). Each failure is named by the mechanism it matches."""
    checks = _joined(checks, "--checks")
    library = _joined(library, "--library")
    impl, row, allow_import = _split(impl), _split(row), _split(allow_import)
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
