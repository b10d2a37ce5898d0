"""`build_report`: read run folders, judge the chapter's claims, draw the figures, write the report.

Output: results/report/<id>/ with REPORT.md, report.html (self-contained), the PNGs and a
summary.json holding every verdict row (what `make all` prints at the end).
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Callable

from moebench import published, results, signals
from moebench.report import collect
from moebench.report.claims import DIFFERS, NOT_RUN, REPRODUCED
from moebench.report.render import Block, Heading, Para, Table, html_document, markdown
from moebench.report.sections import bench, checkpoint, env, gpu, library, parity, variants
from moebench.report.verdict_rows import is_chapter_run, parity_row, variant_rows, verdict_table


@dataclasses.dataclass(kw_only=True)
class ReportResult:
    path: Path
    rows: list[dict]
    counts: dict[str, int]
    runs: dict[str, list[collect.Run]]
    primary: dict[str, collect.Run | None]
    """Per kind, the run its claims were judged on."""
    damaged: dict[str, collect.Run] = dataclasses.field(default_factory=dict)
    """Per kind (env, fastmoe, deepspeed, parity, bench), the damaged run the report would have
    read: its claims or section are not judged, and the report says so."""
    libraries: list[collect.Run] = dataclasses.field(default_factory=list)
    """The `verify-parity --library` runs shown in their own section, newest first (never the parity verdict's
    run): every one since --since, else the latest of each thing verified (collect.library_runs)."""

    checkpoints: list[collect.Run] = dataclasses.field(default_factory=list)
    """The `moebench checkpoint` audits shown in their own section, newest first: the newest of each folder audited
    (since --since), or the ones given as RUN folders (collect.checkpoint_runs)."""

    @property
    def library(self) -> collect.Run | None:
        """The newest library run shown (None: none)."""
        return self.libraries[0] if self.libraries else None


def build_report(paths: list[str], *, root: str | None = None, since: str | None = None) -> ReportResult:
    """Read the runs (the given folders, or the latest of each kind, started at or after `since`),
    write the report folder."""
    from moebench.errors import Interrupted, UserError

    root_path = results.results_root(root)
    if since is not None and paths:
        raise UserError("applies to the latest runs only; drop it, or the RUN folders", flag="--since")
    since_time = collect.parse_since(since) if since is not None else None  # a bad flag before a missing folder
    if not paths and root_path.exists() and not root_path.is_dir():
        raise UserError(f"{root_path} is a file, not a results folder; pass the folder that holds "
                        "<kind>/<run-id> folders (default ./results)", flag="--results-dir")
    if not paths and not root_path.is_dir():
        raise UserError(f"{root_path} does not exist; point it at a results folder (default ./results)",
                        flag="--results-dir")
    prefer = {kind: is_chapter_run(kind) for kind in collect.VARIANT_KINDS}
    # the chapter's parity claim: the latest whole-suite run that ran to its end, else the latest whole-suite
    # run (reported as interrupted or failed); a --library run never (it has its own section)
    prefer["parity"] = collect.is_whole_suite_run
    chosen = collect.select(paths, root_path, since_time, prefer,
                            only={"parity": lambda run: not collect.is_library_run(run)})
    library_runs = ([r for r in chosen["parity"] if collect.is_library_run(r)] if paths
                    else collect.library_runs(root_path, since_time))
    chosen["parity"] = [r for r in chosen["parity"] if not collect.is_library_run(r)]
    given_audits = chosen.pop(collect.CHECKPOINT_KIND)
    audits = given_audits if paths else collect.checkpoint_runs(root_path, since_time)
    sweep, train = bench.latest(root_path, "rows"), bench.latest(root_path, "train")
    gpu_run = gpu.latest_run(root_path, since_time)
    # the runs read besides the chosen ones, listed with them (a damaged one as `damaged: <file>: <reason>`)
    others = [("bench", r) for r in (sweep, train) if r is not None]
    others = [(kind, r) for i, (kind, r) in enumerate(others) if all(r.path != o.path for _, o in others[:i])]
    others += [(gpu.KIND, gpu_run)] if gpu_run is not None else []
    run_dir = results.RunDir.create("report", root=root)
    run_dir.start({"inputs": [str(r.path) for kind in collect.KINDS for r in chosen[kind]]
                   + [str(r.path) for r in library_runs] + [str(r.path) for r in audits]
                   + [str(r.path) for _, r in others]})
    out = run_dir.path
    try:
        primary = {kind: _primary(kind, chosen[kind], prefer.get(kind)) for kind in collect.KINDS}
        rows = [row for kind in collect.VARIANT_KINDS
                for row in variant_rows(kind, primary[kind], _missing(kind, paths, since_time, root_path))]
        rows.append(parity_row(primary["parity"], _missing("parity", paths, since_time, root_path)))
        counts = {v: sum(r["verdict"] == v for r in rows) for v in (REPRODUCED, DIFFERS, NOT_RUN)}
        listed = ([(kind, r) for kind in collect.KINDS for r in chosen[kind]] + [("library", r) for r in library_runs]
                  + [(checkpoint.KIND, r) for r in audits] + others)

        blocks: list[Block] = [
            Heading("moebench report: did chapter 6 reproduce?", 1),
            Para(f"Compared with {published.CHAPTER}, sections 6.4.1-6.4.4. Built "
                 f"{datetime.datetime.now().isoformat(timespec='seconds')} from results files only."),
            Table(headers=("kind", "run", "status", "folder"),
                  rows=tuple((kind, r.run_id, r.error if r.damage else r.status, str(r.path))
                             for kind, r in listed),
                  classes=tuple(r.status for _, r in listed)),
            Heading("Verdicts"),
            Para(f"{counts[REPRODUCED]} reproduced, {counts[DIFFERS]} differ, {counts[NOT_RUN]} not run. "
                 "Tolerances are fixed in moebench/published.py, each with its reason; a claim outside its "
                 "tolerance is reported as `differs` with the likely cause, never hidden."),
            verdict_table(rows),
            *env.blocks(primary["env"]),
        ]
        for kind in collect.VARIANT_KINDS:
            signals.check()  # safe points between the report's steps (each draws a figure or two)
            blocks += variants.blocks(kind, primary[kind], out)
        signals.check()
        blocks += variants.expert_blocks(chosen, out)
        signals.check()
        blocks += parity.blocks(primary["parity"], out)
        signals.check()
        blocks += library.blocks(library_runs, out)
        blocks += checkpoint.blocks(audits)
        signals.check()
        blocks += variants.comparison_blocks(chosen, out)
        signals.check()
        blocks += bench.blocks(sweep, train, out)
        signals.check()
        blocks += gpu.blocks(gpu_run, root_path)
        damaged_libraries = [r for r in library_runs if r.damage]
        damaged_audits = [r for r in audits if r.damage]
        damaged = {kind: run for kind, run in [*primary.items(), ("bench", sweep or train), (gpu.KIND, gpu_run),
                                               *(("library" if i == 0 else f"library {r.run_id}", r)
                                                 for i, r in enumerate(damaged_libraries)),
                                               *((checkpoint.KIND if i == 0 else f"{checkpoint.KIND} {r.run_id}", r)
                                                 for i, r in enumerate(damaged_audits))]
                   if run is not None and run.damage}

        results.write_text_atomic(out / "REPORT.md", markdown(blocks))
        results.write_text_atomic(out / "report.html", html_document(blocks, title="moebench report"))
        run_dir.finish(results.STATUS_OK, {"verdicts": rows, "counts": counts, "report": "REPORT.md",
                                           "html": "report.html",
                                           **({"checkpoints": checkpoint.records(audits)} if audits else {}),
                                           **({"not_judged": {kind: f"{run.path}: {run.damage}" for kind, run
                                                              in damaged.items()}} if damaged else {}),
                                           "figures": sorted(p.name for p in out.glob("*.png"))})
    except BaseException as exc:  # the folder says how it ended, then the error goes on
        if run_dir.ended is None:  # (`finish` itself records an interruption it acts on)
            status = results.STATUS_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else results.STATUS_FAILED
            run_dir.finish(status, {"error": f"{type(exc).__name__}: {exc}"})
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(out) from exc  # the CLI names the folder it marked
        raise
    return ReportResult(path=out, rows=rows, counts=counts, runs=chosen, primary=primary, damaged=damaged,
                        libraries=library_runs, checkpoints=audits)


def _primary(kind: str, runs: list[collect.Run], prefer: Callable[[collect.Run], bool] | None):
    """The run a kind's claims are judged on: the first that is the chapter's experiment, else the first."""
    if not runs:
        return None
    return next((r for r in runs if prefer is not None and prefer(r)), runs[0])


COMMANDS = {"fastmoe": "moebench run fastmoe --preset chapter", "deepspeed": "moebench run deepspeed --preset chapter",
            "parity": "moebench verify-parity --world-size 4"}


def _missing(kind: str, paths: list[str], since, root: Path) -> str:
    """Why a kind has no run, in the words of how runs were chosen."""
    if paths:
        return f"no {kind} run among the RUN folders given (add one, or give no RUN for the latest)"
    if since is not None:
        return f"no {kind} run started since {since.isoformat(timespec='seconds')}: run `{COMMANDS[kind]}`"
    return f"no {kind} run under {root}: run `{COMMANDS[kind]}`"
