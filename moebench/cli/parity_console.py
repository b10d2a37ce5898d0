"""What `moebench verify-parity` prints for its checks: `--list` (checks and libraries) and the checks' table, in the
layouts that fit the terminal, widest first."""

from __future__ import annotations

import json
from typing import Optional

import typer


def print_list(as_json: bool) -> None:
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from moebench.libraries import registry as libraries
    from moebench.libraries.records import library_list
    from moebench.parity.registry import IMPORT_ERRORS, all_checks

    # Each library's probe (DeepSpeed's: an import in a child process, ~2.5 s) runs in a thread while this one
    # imports the check modules; the adapters themselves are imported here first, never in two threads at once.
    names = list(libraries.known())
    for name in names:
        libraries.load(name)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        pending = pool.map(libraries.status, names)
        checks = all_checks()
        statuses = list(pending)
    if as_json:
        typer.echo(json.dumps({"checks": [
            {"name": c.name, "seed": c.seed_source, "description": c.description,
             "min_world_size": c.min_world_size, "max_world_size": c.max_world_size,
             "requires": list(c.requires), "impl_keys": list(c.impl_keys)} for c in checks],
            "import_errors": {m: e.strip().splitlines()[-1] for m, e in IMPORT_ERRORS.items()},
            "libraries": [{**dataclasses.asdict(s), "can_run": s.why_not is None} for s in statuses],
            "compatibility": compatibility_records()}, indent=2))
        return
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="verify-parity checks")
    table.add_column("name", no_wrap=True)
    for col in ("seed", "ranks", "--impl", "asserts"):
        table.add_column(col)
    # narrower terminals: what each check asserts, with its seed, ranks and --impl keys beneath
    stacked = Table(box=box.SIMPLE_HEAD, title="verify-parity checks", pad_edge=False)
    stacked.add_column("name", no_wrap=True)
    stacked.add_column("asserts (seed; ranks; --impl keys)", overflow="fold")
    for c in checks:
        sizes = f">= {c.min_world_size}" + (f", <= {c.max_world_size}" if c.max_world_size else "")
        table.add_row(c.name, escape(c.seed_source), sizes, ",".join(c.impl_keys), escape(c.description))
        keys = f"; --impl {','.join(c.impl_keys)}" if c.impl_keys else ""
        stacked.add_row(c.name, f"{escape(c.description)}\n[dim]seed: {escape(c.seed_source)}; ranks {sizes}{keys}[/]",
                        end_section=True)
    console = _console()
    from moebench.console import print_fitting

    print_fitting(console, table, stacked)
    for module, error in IMPORT_ERRORS.items():
        console.print(f"[yellow]check module {module} did not import: {error.strip().splitlines()[-1]}[/]")
    typer.echo("\nlibraries (verify-parity --library NAME):")
    typer.echo(library_list(statuses))
    from moebench.libraries import compatibility
    from moebench.libraries.records import WIDTH

    typer.echo("")
    from importlib.metadata import version

    typer.echo("\n".join(compatibility.console_lines({s.name: s.version for s in statuses}, WIDTH, version("torch"))))


def compatibility_records() -> list[dict]:
    """The compatibility table as --list --json gives it: one record per declared release."""
    import dataclasses

    from moebench.libraries import compatibility

    return [{"library": name, **dataclasses.asdict(r)} for name, r in compatibility.entries()]


def print_rows(rows: list[dict], as_json: bool) -> None:
    """`--list --library NAME` (or --adapter): every row's key (what --row matches) and, for a row that cannot run
    here, why."""
    import textwrap

    from moebench.libraries.records import DIAGNOSIS_INDENT, WIDTH

    if as_json:
        typer.echo(json.dumps({"rows": rows}, indent=2))
        return
    runs = sum(1 for r in rows if r["skip"] is None)
    typer.echo(f"{len(rows)} row(s), {runs} can run here; their keys (--row takes a key or a glob):")
    for r in rows:
        typer.echo(f"  {r['check']}" + ("" if r["skip"] is None else "  (skips)"))
        if r["skip"] is not None:
            typer.echo("\n".join(textwrap.wrap(r["skip"], WIDTH, initial_indent=DIAGNOSIS_INDENT * 2,
                                               subsequent_indent=DIAGNOSIS_INDENT * 2, break_on_hyphens=False)))


def _console():
    from moebench.console import terminal_console

    return terminal_console()


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def _vacuous(c: dict, narrow: bool = False) -> str:
    vac = f"[yellow]{c['vacuous']} VACUOUS[/]" if c["vacuous"] else "0"
    if not c.get("unasserted"):
        return vac
    return vac + (f"\n{c['unasserted']} unasserted" if narrow else f" ({c['unasserted']} unasserted)")


def _tables(summary: dict, width: int) -> list:
    """Layouts of the checks' table, widest first: one line per check; the same without the vacuous
    column when no comparison is vacuous (the closing line says "0 vacuous"); two lines per check (max
    abs over max rel, rtol over atol); a block per check. Numbers are never wrapped or cut."""
    title = (f"verify-parity: {summary['world_size']} rank(s), {summary['comm_backend']}, "
             f"tolerance {summary['tolerance']}")
    colour = {"pass": "green", "fail": "red", "skip": "yellow", "refused": "yellow"}
    nothing_vacuous = not any(c["vacuous"] or c.get("unasserted") for c in summary["checks"])
    layouts = [_table(summary, title, colour, stacked=False, vacuous=True)]
    if nothing_vacuous:
        layouts.append(_table(summary, title, colour, stacked=False, vacuous=False))
    return layouts + [_table(summary, title, colour, stacked=True, vacuous=True),
                      _blocks(summary, title, colour, width)]


def _table(summary: dict, title: str, colour: dict, *, stacked: bool, vacuous: bool):
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title=title, pad_edge=False, collapse_padding=True, show_edge=False)
    table.add_column("check", no_wrap=not stacked, overflow="fold")
    columns = ["result", "max abs\nmax rel" if stacked else "max abs", *([] if stacked else ["max rel"]),
               "rtol\natol" if stacked else "rtol/atol", "magnitude", *(["vacuous"] if vacuous else []), "time"]
    for col in columns:
        wraps = col == "vacuous" and stacked  # "3 VACUOUS", "2 unasserted" on two lines
        table.add_column(col, no_wrap=not wraps, max_width=12 if wraps else None,
                         justify="left" if col in ("result", "vacuous") else "right")
    for c in summary["checks"]:
        status = f"[{colour[c['status']]}]{c['status']}[/]"
        tolerance = c["tolerance"] or "-"
        if stacked:
            diffs = [f"{_fmt(c['max_abs_diff'])}\n{_fmt(c['max_rel_diff'])}", "\n".join(tolerance.split("/"))]
        else:
            diffs = [_fmt(c["max_abs_diff"]), _fmt(c["max_rel_diff"]), tolerance]
        table.add_row(c["name"], status, *diffs, _fmt(c["magnitude"]), *([_vacuous(c, stacked)] if vacuous else []),
                      f"{c['elapsed_s']:.1f}s")
    return table


def _blocks(summary: dict, title: str, colour: dict, width: int):
    """Narrowest: a block per check, `name  status  time` then its figures as `label value` pairs that
    wrap between pairs, never inside one."""
    from rich.console import Group
    from rich.text import Text

    out = [Text(title, style="bold")]
    for c in summary["checks"]:
        head = Text(c["name"], style="bold")
        head.append(f"  {c['status']}", style=colour[c["status"]])
        head.append(f"  {c['elapsed_s']:.1f}s")
        rtol, _, atol = (c["tolerance"] or "-/-").partition("/")
        pairs = [f"max abs {_fmt(c['max_abs_diff'])}", f"max rel {_fmt(c['max_rel_diff'])}", f"rtol {rtol}",
                 f"atol {atol or rtol}", f"magnitude {_fmt(c['magnitude'])}",
                 f"{c['vacuous']} VACUOUS" if c["vacuous"] else "vacuous 0"]
        if c.get("unasserted"):
            pairs.append(f"{c['unasserted']} unasserted")
        out.append(head)
        line = ""
        for pair in pairs:
            if line and len(line) + 3 + len(pair) > width:
                out.append(Text(line))
                line = ""
            line = f"{line}   {pair}" if line else f"  {pair}"
        out.append(Text(line))
    return Group(*out)


def print_table(summary: dict) -> None:
    from moebench.console import print_fitting

    console = _console()
    print_fitting(console, *_tables(summary, console.width))
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
                  + ("not saved" if summary.get("unsaved") else f"saved to {summary['run_path']}"), highlight=False)
    if summary["vacuous_total"]:
        console.print("[yellow]vacuous: the tolerance is not below the magnitude compared (or the comparison "
                      "is not asserted at all), so an all-zero result would pass.[/]")
