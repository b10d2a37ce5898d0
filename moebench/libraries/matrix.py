"""Library rows -> parity checks -> the parity runner (launch, deadlines, diagnoses, results files).

Each Row becomes one `Check` named `row.key()` that runs at the row's own world size. The parent asks the
adapter's `skip_reason(row)` first (a row that cannot run here starts no rank); every rank then runs
`adapter.runner(row.kind)(ctx, row, opts)`. The summary gains "rows": one record per row (records.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
from typing import Any, Callable, Iterator, Mapping

from moebench.errors import UserError
from moebench.libraries.records import with_rows
from moebench.libraries.spec import RESUME, Adapter, Row
from moebench.parity.registry import REGISTRY, Check, CheckOptions, load_all, register

DEFAULT_WORLD_SIZES = (2, 4)
"""`--library` without --world-size runs every row at these world sizes: the smallest expert-parallel
world, and one where each rank exchanges with more than one peer."""
ROW_ORDER = 10_000
"""Row checks come after every built-in check in the registry's order."""


@dataclasses.dataclass(frozen=True)
class RowRank:
    """What every rank of a row's check runs: the adapter's runner for the row's kind."""

    adapter: Adapter
    row: Row

    def __call__(self, ctx, opts: CheckOptions) -> list:
        from moebench.parity.raised import AdapterProtocolError, not_comparisons

        fn = self.adapter.runner(self.row.kind)
        out = fn(ctx, self.row, opts)
        got = not_comparisons(out)
        if got:
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
            raise AdapterProtocolError(f"the runner of row kind {self.row.kind!r} ({name}) returned {got}; a runner "
                                       "must return a list of comparisons (moebench.parity.compare.compare)")
        return out


@dataclasses.dataclass(frozen=True)
class RowCheck:
    """A row, its adapter and the parity check that runs it."""

    check: Check
    adapter: Adapter
    row: Row
    skip: str | None = None
    """Why the row cannot run here (the adapter's skip_reason, asked once, in the parent), or None."""

    @property
    def name(self) -> str:
        return self.check.name


def _description(row: Row) -> str:
    where = f"{row.library} {row.model} ({row.backend}, {row.ep_mode}) over {row.world_size} ranks"
    if row.kind == RESUME:
        return f"{where}: save, load into a fresh model, continue; vs the uninterrupted run"
    return f"{where} vs one process with the same weights"


def adapter_rows(adapter: Adapter, world_sizes: tuple[int, ...], *, resume: bool = False,
                 user_config: Mapping[str, Any] | None = None) -> list[Row]:
    """The adapter's rows at each world size, in that order; with `resume` its resume rows too (an adapter
    that has none: a UserError)."""
    rows = [r for w in world_sizes for r in adapter.rows(w, resume=resume, user_config=user_config)]
    if resume and rows and not any(r.kind == RESUME for r in rows):
        raise UserError(f"{adapter.name} has no resume rows; drop --resume or pick a library that has them",
                        flag="--resume")
    return rows


def select_rows(rows: list[Row], patterns: tuple[str, ...], listed_by: str = "--list --library NAME") -> list[Row]:
    """The rows whose key matches one of `patterns` (shell globs; `*` spans slashes); all when none is given.
    A pattern that matches no row is a UserError naming it."""
    if not patterns:
        return rows
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(r.key(), p) for r in rows)]
    if unmatched:
        raise UserError(f"matches no row: {', '.join(unmatched)} (row keys look like {rows[0].key() if rows else '-'};"
                        f" {listed_by} lists them)", flag="--row")
    return [r for r in rows if any(fnmatch.fnmatchcase(r.key(), p) for p in patterns)]


def row_checks(adapters: list[Adapter], world_sizes: tuple[int, ...], *, resume: bool = False,
               user_configs: Mapping[str, Mapping[str, Any]] | None = None,
               patterns: tuple[str, ...] = (), flag: str = "--library",
               listed_by: str | None = None) -> list[RowCheck]:
    """One check per row of the adapters at each world size, in that order (not registered: see `registered`).
    `user_configs` maps a library's name to the user's own settings (--ds-config); `patterns` (--row) keeps
    the rows whose key matches; `flag` is the one a refusal names (--library, or --adapter for a user's adapter);
    `listed_by` the command a --row refusal points to (default: --list with the flag).
    Each row's skip_reason is asked here, once (an adapter's answer that is no string is a UserError)."""
    out: list[RowCheck] = []
    rows_of: list[tuple[Adapter, Row, str]] = []
    for adapter in adapters:
        version = adapter.version() or "?"
        user_config = (user_configs or {}).get(adapter.name)
        rows_of += [(adapter, row, version) for row in adapter_rows(adapter, world_sizes, resume=resume,
                                                                     user_config=user_config)]
    listed = listed_by or f"--list {flag} {adapters[0].name if flag == '--library' and adapters else '...'}"
    kept = set(map(id, select_rows([row for _, row, _ in rows_of], patterns, listed_by=listed)))
    for adapter, row, version in rows_of:
        if id(row) not in kept:
            continue
        skip = checked_skip_reason(adapter, row, flag)
        check = Check(
            name=row.key(), order=ROW_ORDER + len(out), seed_source=f"{row.library} {version}",
            description=_description(row), catches=adapter.catches, rank_fn=RowRank(adapter, row),
            world_size=row.world_size, requires=(adapter.import_name,), labels=tuple(row.labels(version).items()),
            timeout_s=adapter.timeout_s, preload=adapter.preload, skip_if=lambda skip=skip: skip)
        out.append(RowCheck(check=check, adapter=adapter, row=row, skip=skip))
    if not out:
        names = ", ".join(a.name for a in adapters)
        raise UserError(f"{names} has no rows at world size {', '.join(map(str, world_sizes))}", flag=flag)
    return out


def checked_skip_reason(adapter: Adapter, row: Row, flag: str = "--library") -> str | None:
    """adapter.skip_reason(row), held to the protocol: a string (one printable line) or None; else a UserError."""
    from moebench.libraries.registry import one_line

    try:
        reason = adapter.skip_reason(row)
    except Exception as exc:  # noqa: BLE001 - an adapter's code: its error is the finding
        raise UserError(f"{adapter.name}: skip_reason({row.key()}) raised {type(exc).__name__}: "
                        f"{one_line(str(exc), 200)}", flag=flag) from None
    if reason is not None and not isinstance(reason, str):
        raise UserError(f"{adapter.name}: skip_reason({row.key()}) returned a {type(reason).__name__}; it must return "
                        "a string (why the row cannot run here) or None", flag=flag)
    return None if reason is None else one_line(reason, limit=2000) or "skipped by the adapter"


@contextlib.contextmanager
def registered(row_checks: list[RowCheck]) -> Iterator[list[RowCheck]]:
    """The row checks in the parity registry for the duration (the ranks fork inside it, so they
    see them); afterwards the registry holds the built-in checks only again."""
    load_all()  # the built-in checks first, so a later load_all() adds nothing behind the rows
    clashes = [c.name for c in row_checks if c.name in REGISTRY]
    if clashes:
        raise RuntimeError(f"row checks already registered: {', '.join(clashes)}")
    for c in row_checks:
        register(c.check)
    try:
        yield row_checks
    finally:
        for c in row_checks:
            REGISTRY.pop(c.name, None)


def verify_libraries(adapters: list[Adapter], world_sizes: tuple[int, ...], *, config_fields: dict[str, Any],
                     results_dir: str | None = None, on_record: Callable | None = None,
                     user_configs: Mapping[str, Mapping[str, Any]] | None = None,
                     summary_extra: dict[str, Any] | None = None, repro_dir: str | None = None,
                     resume: bool = False, patterns: tuple[str, ...] = (),
                     annotate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the adapters' rows at `world_sizes` (`resume`: with their resume rows; `patterns`: only the rows
    matching) through verify_parity; the summary has "rows" (each with what `annotate` adds) and the keys of
    `summary_extra` (e.g. "ds_config"). With `repro_dir`, a reproduction script per failing row that has one."""
    from moebench.distributed.launch import under_torchrun
    from moebench.parity.runner import ParityConfig, verify_parity

    if under_torchrun():  # the job's world is the only one there is
        world_sizes = (int(os.environ["WORLD_SIZE"]),)
    checks = row_checks(adapters, world_sizes, resume=resume, user_configs=user_configs, patterns=patterns)
    with registered(checks):
        config = ParityConfig(**{**config_fields, "world_size": max(world_sizes),
                                 "checks": tuple(c.name for c in checks)})
        by_name = {c.name: c for c in checks}

        def labelled(summary: dict[str, Any]) -> dict[str, Any]:  # also an interrupted run's: the rows it ran
            return {**with_rows(summary, annotate), **(summary_extra or {})}

        def decorate(summary: dict[str, Any]) -> dict[str, Any]:
            summary = labelled(summary)
            if repro_dir is None:
                return summary
            from moebench.libraries.repro import write_scripts

            return write_scripts(repro_dir, summary, by_name, config_fields.get("seed", 0))

        return verify_parity(config, results_dir=results_dir, on_record=on_record, decorate=decorate,
                             decorate_partial=labelled)


def config_fields(config) -> dict[str, Any]:
    """A ParityConfig's fields other than world_size / checks (which the rows decide)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in ("world_size", "checks")}
