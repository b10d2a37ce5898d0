"""Library rows -> parity checks -> the parity runner (launch, deadlines, diagnoses, results files).

Each Row becomes one registered `Check` named `row.key()` that runs at the row's own world size;
its rank function asks the row's adapter to build the library's block on every rank and compare it
with the one-process reference. The summary gains "rows": one record per row with library,
version, model, backend, ep_mode, world_size, features, verdict, diagnosis (and its time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Iterator

from moebench.errors import UserError
from moebench.libraries import registry
from moebench.libraries.base import Row
from moebench.parity import restore
from moebench.parity.registry import REGISTRY, Check, CheckOptions, load_all, register

DEFAULT_WORLD_SIZES = (2, 4)
"""`--library` without --world-size runs every row at these world sizes: the smallest expert-parallel
world, and one where each rank exchanges with more than one peer."""
RESTORE_NAMES = (restore.NOT_RESTORED, restore.PERMUTATION, restore.SPLIT_RESTORE, restore.UNEXPLAINED)
"""Diagnoses of a resume row's restored state (moebench.parity.restore)."""
ROW_ORDER = 10_000
"""Row checks come after every built-in check in the registry's order."""


def _row_rank(name: str, row: Row, ctx, opts: CheckOptions) -> list:
    """Runs on every rank: the row's adapter builds, runs and compares."""
    adapter = registry.load(name)
    return adapter.run_row(ctx, row, opts)


def _rows(adapter, world_size: int, resume: bool, user_config: dict[str, Any] | None) -> list[Row]:
    """The adapter's rows; with `user_config` (--ds-config) the rows of the user's settings; with `resume`
    its resume rows too (an adapter without any: a UserError)."""
    kwargs: dict[str, Any] = {} if user_config is None else {"user_config": user_config}
    if not resume:
        return adapter.rows(world_size, **kwargs)
    if "resume" not in inspect.signature(adapter.rows).parameters:
        raise UserError(f"{adapter.name} has no resume rows; drop --resume or pick a library that has them",
                        flag="--resume")
    return adapter.rows(world_size, resume=True, **kwargs)


def _description(row: Row) -> str:
    if "resume" in row.features:
        return (f"{row.library} {row.model} ({row.backend}, {row.ep_mode}) over {row.world_size} ranks: save, load "
                "into a fresh model, continue; vs the uninterrupted run")
    return (f"{row.library} {row.model} ({row.backend}, {row.ep_mode}) over {row.world_size} ranks vs one process "
            "with the same weights")


def row_checks(names: list[str], world_sizes: tuple[int, ...], *, resume: bool = False,
               user_configs: dict[str, dict[str, Any]] | None = None) -> list[Check]:
    """One check per row of the named libraries at each world size, in that order (not registered:
    see `registered`); `resume` adds each library's resume rows. `user_configs` maps a library's name to
    the user's own settings (--ds-config): that adapter's rows are then `adapter.rows(world_size,
    user_config=...)`."""
    checks: list[Check] = []
    for adapter in registry.require(names):
        version = adapter.version() or "?"
        user_config = (user_configs or {}).get(adapter.name)
        for world_size in world_sizes:
            for row in _rows(adapter, world_size, resume, user_config):
                labels = {"library": row.library, "version": version, "model": row.model, "backend": row.backend,
                          "ep_mode": row.ep_mode, "world_size": row.world_size, "features": tuple(row.features),
                          **dict(row.params)}
                check = Check(
                    name=row.key(), order=ROW_ORDER + len(checks), seed_source=f"{row.library} {version}",
                    description=_description(row),
                    catches=getattr(adapter, "catches", "an expert-parallel path whose outputs or gradients "
                                                        "differ from one process"),
                    rank_fn=functools.partial(_row_rank, adapter.name, row), world_size=row.world_size,
                    requires=(adapter.import_name,), labels=tuple(labels.items()),
                    timeout_s=getattr(adapter, "timeout_s", None), preload=tuple(getattr(adapter, "preload", ())))
                checks.append(check)
    if not checks:
        raise UserError(f"{', '.join(names)} has no rows at world size {', '.join(map(str, world_sizes))}",
                        flag="--library")
    return checks


@contextlib.contextmanager
def registered(checks: list[Check]) -> Iterator[list[Check]]:
    """The row checks in the parity registry for the duration (the ranks fork inside it, so they
    see them); afterwards the registry holds the built-in checks only again."""
    load_all()  # the built-in checks first, so a later load_all() adds nothing behind the rows
    clashes = [c.name for c in checks if c.name in REGISTRY]
    if clashes:
        raise RuntimeError(f"row checks already registered: {', '.join(clashes)}")
    for check in checks:
        register(check)
    try:
        yield checks
    finally:
        for check in checks:
            REGISTRY.pop(check.name, None)


def rows_of(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The conformance rows of a summary: every check that is a library row, with its verdict."""
    rows = []
    for c in summary["checks"]:
        if not c.get("labels"):
            continue
        d = c.get("diagnosis")
        why = d["sentence"] if d else c.get("reason", "") if c["status"] != "pass" else ""
        first = (d or {}).get("details", {}).get("first") or {}
        if first.get("sentence") and first["sentence"] not in why:  # the first wrong tensor: the maintainer's lead
            # (a restore diagnosis names its slots itself: "rank 1, local slot 0 holds ...")
            why = f"{why}; {'' if d['name'] in RESTORE_NAMES else 'it '}{first['sentence']}"
        rows.append({**c["labels"], "features": list(c["labels"].get("features", ())), "check": c["name"],
                     "verdict": c["status"], "diagnosis": (f"{d['name']}: {why}" if d else why) or None,
                     "diagnosis_name": d["name"] if d else None, "elapsed_s": c["elapsed_s"]})
    return rows


def with_rows(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its "rows" (for verify_parity's `decorate`)."""
    return {**summary, "rows": rows_of(summary)}


def verify_libraries(names: list[str], world_sizes: tuple[int, ...], *, config_fields: dict[str, Any],
                     results_dir: str | None = None, on_record: Callable | None = None,
                     user_configs: dict[str, dict[str, Any]] | None = None,
                     summary_extra: dict[str, Any] | None = None,
                     repro_dir: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Run the rows of `names` at `world_sizes` (`resume`: with
    their resume rows) through verify_parity; the summary has "rows" (and the
    keys of `summary_extra`, e.g. "ds_config"). `user_configs`: see row_checks. With `repro_dir`, a
    reproduction script per failing row that has one (libraries/repro.py)."""
    from moebench.distributed.launch import under_torchrun
    from moebench.parity.runner import ParityConfig, verify_parity

    if under_torchrun():  # the job's world is the only one there is
        world_sizes = (int(os.environ["WORLD_SIZE"]),)
    with registered(row_checks(names, world_sizes, resume=resume, user_configs=user_configs)) as checks:
        config = ParityConfig(**{**config_fields, "world_size": max(world_sizes),
                                 "checks": tuple(c.name for c in checks)})
        rows = {c.name: (registry.load(c.rank_fn.args[0]), c.rank_fn.args[1]) for c in checks}

        def decorate(summary: dict[str, Any]) -> dict[str, Any]:
            summary = {**with_rows(summary), **(summary_extra or {})}
            if repro_dir is None:
                return summary
            from moebench.libraries.repro import write_scripts

            return write_scripts(repro_dir, summary, rows, config_fields.get("seed", 0))

        return verify_parity(config, results_dir=results_dir, on_record=on_record, decorate=decorate)


def config_fields(config) -> dict[str, Any]:
    """A ParityConfig's fields other than world_size / checks (which the rows decide)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in ("world_size", "checks")}
