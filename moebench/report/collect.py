"""Which run folders a report reads, and what they hold (files only: results copied from another
machine work, and nothing here imports torch)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Callable

from moebench import results
from moebench.errors import UserError
from moebench.report import chapter

VARIANT_KINDS = ("fastmoe", "deepspeed")
"""The training variants a report has a section for (moebench.variants.VARIANTS, without the import)."""
KINDS = ("env", *VARIANT_KINDS, "parity")
"""Every kind of run a report reads, in report order."""
CHECKPOINT_KIND = "checkpoint"
"""`moebench checkpoint` audits (moebench.checkpoint_audit.run.KIND, not imported): their own section, no claim."""
GIVEN_KINDS = (*KINDS, CHECKPOINT_KIND)
"""The kinds of run folder a report takes as RUN."""

IGNORED_FOR_CHAPTER = chapter.IGNORED_FOR_CHAPTER
"""Kept for callers of collect (moebench.report.chapter holds it)."""


@dataclasses.dataclass(kw_only=True)
class Run:
    """One run folder, as read from its files."""

    path: Path
    kind: str
    status: str
    """ok / failed / interrupted / abandoned / running / damaged."""
    summary: dict
    """summary.json ({} for a damaged run: nothing in its folder is trusted)."""
    config: dict | None
    error: str = ""
    damage: str = ""
    """"<file>: <reason>" when a file of the run is damaged (results.read_run)."""
    documents: dict = dataclasses.field(default_factory=dict, repr=False)
    """Every validated file of the run folder (results.RunFiles.documents; {} when damaged)."""
    hints: dict = dataclasses.field(default_factory=dict, repr=False)
    """A damaged run's summary.json and config.json as far as they parse, unvalidated ({"summary": {...},
    "config": {...}}): used only to tell which section reports its damage (a `verify-parity --library` run's
    in the library section), never as a measurement."""

    @property
    def metrics(self) -> list[dict]:
        """metrics.jsonl's lines, validated ([] when absent or the run is damaged)."""
        return self.documents.get("metrics.jsonl") or []

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def ok(self) -> bool:
        return self.status == results.STATUS_OK

    def not_ok_reason(self) -> str:
        if self.damage:
            return f"not judged: run {self.run_id} is damaged ({self.damage})"
        what = {"failed": "failed", "interrupted": "was interrupted", "abandoned": "was abandoned (its writer died)",
                "running": "is still running"}.get(self.status, self.status)
        return f"run {self.run_id} {what}" + (f": {self.error.strip().splitlines()[-1]}" if self.error else "")


def is_library_run(run: Run) -> bool:
    """A `verify-parity --library` run (its checks are library rows, so it is not the whole suite the
    chapter's parity verdict is judged on): its summary has conformance "rows", or (a run that ended before
    writing them) the checks config.json names are rows, whose names are library/model/... paths."""
    if run.kind != "parity":
        return False
    summary, config = _facts(run)
    return "rows" in summary or any("/" in str(name) for name in _list(config.get("checks")))


def _facts(run: Run) -> tuple[dict, dict]:
    """(summary, config) of a run: its validated files, or for a damaged run what of them parses (`hints`)."""
    if run.damage:
        return run.hints.get("summary") or {}, run.hints.get("config") or {}
    return run.summary, run.config or {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def is_whole_suite_run(run: Run) -> bool:
    """A parity run of the built-in checks that ran to its end (ok or failed): what the chapter's parity
    claim is judged on; never a library run, an interrupted or abandoned one, or a damaged one."""
    return (run.kind == "parity" and not is_library_run(run) and not run.damage
            and run.status in (results.STATUS_OK, results.STATUS_FAILED))


def library_identity(run: Run) -> tuple:
    """What a library run verified, to tell runs apart: its libraries, the user's setup (--ds-config, --hf-config,
    ...), with or without the
    resume rows, the rows it was limited to (the latest run of each is the one a report shows)."""
    summary, config = _facts(run)
    names = _list(config.get("checks")) or [r.get("check", "") for r in _list(summary.get("rows"))
                                             if isinstance(r, dict)]
    libraries = tuple(sorted({str(name).split("/")[0] for name in names}))
    resume = any("resume" in str(name) for name in names)
    return libraries, repr(summary.get("setup", summary.get("ds_config"))), resume, len(names)


def load_run(path: Path) -> Run:
    """One run folder, every file read back through its schema (results.read_run): a damaged
    file makes the run "damaged", with none of its files used."""
    files = results.read_run(path)
    if files.damage:
        return Run(path=path, kind=path.parent.name, status=files.status, summary={}, config=None,
                   error=f"damaged: {files.damage}", damage=files.damage,
                   hints={"summary": _parsed(path / "summary.json"), "config": _parsed(path / "config.json")})
    summary = files.summary
    return Run(path=path, kind=summary["kind"], status=files.status, summary=summary, config=files.config,
               error=str(summary.get("error") or ""), documents=files.documents)


def _parsed(path: Path) -> dict:
    """A damaged run's file as far as it parses as a JSON object (unvalidated), else {}."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return document if isinstance(document, dict) else {}


def latest(root: Path, kind: str, since: datetime.datetime | None = None,
           prefer: Callable[[Run], bool] | None = None, only: Callable[[Run], bool] | None = None) -> Run | None:
    """The newest run of one kind, whatever its status (a failed latest run is reported as failed);
    with `prefer`, the newest run it accepts if there is one (the newest run otherwise); with
    `since`, only runs started at or after it (an older one is not this session's); with `only`, runs it
    rejects are never taken."""
    newest = None
    for run in every_run(root, kind, since):
        if only is not None and not only(run):
            continue
        if prefer is None or prefer(run):
            return run
        newest = newest or run
    return newest


def every_run(root: Path, kind: str, since: datetime.datetime | None = None):
    """The runs of one kind, newest first (started at or after `since`, when given)."""
    for path in results.latest_runs(kind, root):
        if not (path / "summary.json").exists():
            continue
        run = load_run(path)
        if since is not None and _started(run) < since:
            break  # run ids sort by time: every later one is older still
        yield run


def library_runs(root: Path, since: datetime.datetime | None = None) -> list[Run]:
    """The `verify-parity --library` runs a report shows, newest first: every one started since `since`;
    without it, the latest of each thing verified (library_identity: a fairscale run and a DeepSpeed
    --ds-config run made before the latest DeepSpeed run are still shown)."""
    runs = [run for run in every_run(root, "parity", since) if is_library_run(run)]
    if since is not None:
        return runs
    seen: set[tuple] = set()
    latest_each = []
    for run in runs:
        if library_identity(run) not in seen:
            seen.add(library_identity(run))
            latest_each.append(run)
    return latest_each


def checkpoint_identity(run: Run) -> str:
    """The folder a checkpoint audit read (its checkpoint.json's `path`); for a damaged run, what of that file
    parses, else the run's own folder (an audit whose path cannot be read is one of its own)."""
    document = run.documents.get("checkpoint.json") if not run.damage else _parsed(run.path / "checkpoint.json")
    path = (document or {}).get("path")
    return path if isinstance(path, str) and path else f"run {run.path}"


def checkpoint_runs(root: Path, since: datetime.datetime | None = None) -> list[Run]:
    """The `moebench checkpoint` audits a report shows, newest first: the newest audit of each folder audited
    (started since `since`, when given)."""
    seen: set[str] = set()
    newest_each = []
    for run in every_run(root, CHECKPOINT_KIND, since):
        if checkpoint_identity(run) not in seen:
            seen.add(checkpoint_identity(run))
            newest_each.append(run)
    return newest_each


def _started(run: Run) -> datetime.datetime:
    """summary.json's start, else the run id's (a damaged run's summary is not trusted)."""
    try:
        return datetime.datetime.fromisoformat(run.summary["started_at"])
    except (KeyError, TypeError, ValueError):
        pass
    try:
        return datetime.datetime.strptime(run.run_id[:15], "%Y%m%d-%H%M%S")
    except ValueError:
        return datetime.datetime.min


def parse_since(text: str) -> datetime.datetime:
    """--since: ISO local time (2026-11-23T15:04:05) or a run id's prefix (20261123-150405)."""
    for fmt in ("%Y%m%d-%H%M%S", None):
        try:
            return datetime.datetime.strptime(text, fmt) if fmt else datetime.datetime.fromisoformat(text)
        except ValueError:
            continue
    raise UserError(f"{text!r} is not a time; give 2026-11-23T15:04:05 or 20261123-150405", flag="--since")


def select(paths: list[str], root: Path, since: datetime.datetime | None = None,
           prefer: dict[str, Callable[[Run], bool]] | None = None,
           only: dict[str, Callable[[Run], bool]] | None = None) -> dict[str, list[Run]]:
    """Runs per kind: the given folders (in the order given), or the latest of each kind (for a kind
    in `prefer`, the latest that predicate accepts, if any; for a kind in `only`, never one it rejects)."""
    chosen: dict[str, list[Run]] = {kind: [] for kind in GIVEN_KINDS}
    if not paths:
        for kind in KINDS:
            run = latest(root, kind, since, (prefer or {}).get(kind), (only or {}).get(kind))
            if run is not None:
                chosen[kind].append(run)
        return chosen
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UserError(f"{raw} does not exist; pass results/<kind>/<run-id> folders, or nothing for the "
                            "latest run of each kind", flag="RUN")
        if not (path / "summary.json").is_file():
            raise UserError(f"{raw} is not a run folder (no summary.json in it); pass results/<kind>/<run-id> "
                            "folders, or nothing for the latest run of each kind", flag="RUN")
        run = load_run(path)  # a damaged run is reported as such (its claims not judged)
        if run.kind not in chosen:
            raise UserError(f"{raw} is a {run.kind!r} run; a report reads {', '.join(GIVEN_KINDS)} runs", flag="RUN")
        if any(r.path.resolve() == path.resolve() for r in chosen[run.kind]):
            raise UserError(f"{raw} is given twice", flag="RUN")
        chosen[run.kind].append(run)
    return chosen


def chapter_deviations(run: Run, chapter_cfg: dict) -> list[str]:
    """How a run's config differs from the chapter preset's, as "field value (chapter value)"."""
    return chapter.deviations(run.config, chapter_cfg)
