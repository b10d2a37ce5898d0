"""`moebench runs`: every run folder under the results root, newest first, with its status as a
reader should see it ("abandoned" where the writer died while the files said "running")."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Optional

import typer

from moebench.bounds import Name
from moebench.cli import flags
from moebench.cli.help import PanelCommand

app = typer.Typer()

KIND_BOUND = Name(what="kind")
"""--kind: a run kind's folder name (fastmoe, parity, ...): a name, not a path."""
COMMAND_KINDS = ("env", "parity", "bench", "report", "gpu-check")
"""Kinds the commands other than `run` write (results/<kind>/); `run`'s are the variants' names."""
GAP = "  "
"""Between two columns of the listing."""


EXAMPLES = """Examples:

\b
  moebench runs
  moebench runs --kind fastmoe --json"""


@app.command("runs", epilog=EXAMPLES, cls=PanelCommand)
def runs(
    kind: Optional[str] = flags.bounded_option(
        None, "--kind", bound=KIND_BOUND, metavar="KIND",
        help="Only this kind (fastmoe, deepspeed, parity, env, bench, report, gpu-check)."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """List the runs under the results root, newest first: kind, run id, status, start, preset (or what a parity
    run verified: its checks, or its libraries' rows), ranks, launcher, final loss, wall time."""
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
    present = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if kind is not None and kind not in present:
        known = sorted(set(known_kinds()) | set(present))
        if kind not in known:
            raise UserError(f"unknown kind {kind}; expected one of {', '.join(known)}", flag="--kind")
    rows = [_row(name, run) for name in ([kind] if kind else present) for run in results.latest_runs(name, root)]
    rows.sort(key=lambda r: (r["started_at"] or "", results.run_order(Path(r["run_path"]))), reverse=True)
    if as_json:
        typer.echo(json.dumps({"runs": rows}, indent=2))
        return
    if not rows:
        typer.echo(f"no {kind + ' ' if kind else ''}runs under {root}")
        return
    from moebench.console import terminal_console

    typer.echo("\n".join(listing(rows, root, terminal_console().width, kind)))


def known_kinds() -> list[str]:
    from moebench import variants

    return [v.name for v in variants.VARIANTS] + list(COMMAND_KINDS)


def _row(kind: str, run) -> dict:
    """What the listing shows of one run folder (None where its files do not say)."""
    from moebench import results

    files = results.read_run(run)  # every file through its schema: damage is named, never a crash
    summary, config = (files.summary or {}, files.config or {}) if not files.damage else ({}, {})
    loss = summary.get("loss")
    ranks = summary.get("world_size") or (config.get("launch") or {}).get("world_size")
    if ranks is None and config.get("world_sizes"):  # bench: the world sizes it swept
        ranks = ",".join(str(w) for w in config["world_sizes"])
    verified = None
    if kind == "parity":
        verified, worlds = _verified(summary)
        ranks = worlds or ranks
    return {"kind": kind, "run_id": run.name, "status": files.status,
            "started_at": summary.get("started_at"), "wall_time_s": summary.get("wall_time_s"),
            "preset": config.get("preset") if kind != "bench" or config.get("train") else None,
            "verified": verified, "world_size": ranks, "launcher": summary.get("launcher"),
            "final_loss": loss.get("last") if isinstance(loss, dict) else None, "run_path": str(run),
            **({"damage": files.damage} if files.damage else {})}


def _verified(summary: dict) -> tuple[str | None, str | int | None]:
    """What a parity run verified ("13 checks", "deepspeed 46 rows, fairscale 4 rows") and its world sizes
    ("2,4" for library rows at two sizes); (None, None) when its summary does not say."""
    rows, checks = summary.get("rows"), summary.get("checks")
    if rows:
        per = {}
        for r in rows:
            per[r.get("library", "?")] = per.get(r.get("library", "?"), 0) + 1
        worlds = sorted({r["world_size"] for r in rows if isinstance(r.get("world_size"), int)})
        shown = ",".join(map(str, worlds)) if len(worlds) > 1 else (worlds[0] if worlds else None)
        return ", ".join(f"{lib} {n} row{'s' if n > 1 else ''}" for lib, n in per.items()), shown
    if checks:
        return f"{len(checks)} check{'s' if len(checks) > 1 else ''}", None
    return None, None


def _cells(row: dict) -> dict[str, str]:
    wall, loss, started = row["wall_time_s"], row["final_loss"], row["started_at"]
    return {"kind": row["kind"], "run id": row["run_id"], "status": row["status"],
            "started": str(started).replace("T", " ") if started else "-",
            "what": row["preset"] or row.get("verified") or "-",
            "ranks": "-" if row["world_size"] is None else str(row["world_size"]),
            "launcher": row["launcher"] or "-",
            "final loss": f"{loss:.5g}" if isinstance(loss, (int, float)) else "-",
            "wall": f"{wall:.1f} s" if isinstance(wall, (int, float)) else "-"}


RIGHT = ("ranks", "final loss", "wall")
"""Columns aligned right (numbers)."""
WIDE = ("kind", "run id", "status", "started", "what", "ranks", "launcher", "final loss", "wall")
"""One line per run, when the terminal is wide enough. `what`: a run's preset, or what a parity run verified
(its checks, or its libraries' rows)."""
NARROW = ("kind", "run id", "status", "final loss", "wall")
"""First line of a run on a narrower terminal; a second line under the run id says the rest."""


def listing(rows: list[dict], root, width: int, kind: str | None = None) -> list[str]:
    """The runs as lines at most `width` wide when they can be: one line per run if every column fits,
    else two (start, preset, ranks and launcher on the second). Nothing is cut."""
    cells = [_cells(r) for r in rows]
    head = [f"{len(rows)} {kind + ' ' if kind else ''}run(s) under {root}, newest first"]
    line = _table(WIDE, cells)
    if max(len(s) for s in line) <= width:
        return head + line[:1] + [x for row, first in zip(rows, line[1:]) for x in [first] + _damage(row, width)]
    out = _table(NARROW, cells)
    indent = " " * (len(out[0]) - len(out[0].lstrip(" ")) + _width("kind", cells) + len(GAP))
    lines = [out[0], indent + "started, what, ranks, launcher"]
    for source, row, first in zip(rows, cells, out[1:]):
        ranks = "" if row["ranks"] == "-" else "1 rank" if row["ranks"] == "1" else f"{row['ranks']} ranks"
        what = f"preset {source['preset']}" if source["preset"] else source.get("verified") or ""
        rest = [row["started"], what, ranks,
                f"via {row['launcher']}" if row["launcher"] != "-" else ""]
        lines += [first, indent + ", ".join(p for p in rest if p)] + _damage(source, width)
    return head + lines


def _damage(row: dict, width: int) -> list[str]:
    """A damaged run's "damaged: <file>: <reason>", wrapped under its line(s)."""

    if not row.get("damage"):
        return []
    return textwrap.wrap(row["damage"], width, initial_indent="  damaged: ", subsequent_indent="    ")



def _width(column: str, cells: list[dict]) -> int:
    return max([len(column)] + [len(c[column]) for c in cells])


def _table(columns: tuple[str, ...], cells: list[dict]) -> list[str]:
    widths = {c: _width(c, cells) for c in columns}

    def line(values: dict) -> str:
        return GAP.join(values[c].rjust(widths[c]) if c in RIGHT else values[c].ljust(widths[c])
                        for c in columns).rstrip()

    return [line({c: c for c in columns})] + [line(c) for c in cells]
