"""`verify-parity --library / --adapter`, from what the user asks to the summary: the one path the CLI and the Python
API (`moebench.verify_parity(library=...)`) both take. Every input is checked here, before the run folder
exists: a bad one is a UserError naming its flag (exit 2 on the CLI), with nothing written.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Any, Callable, Sequence

from moebench.errors import UserError
from moebench.libraries import registry, setups
from moebench.libraries.matrix import DEFAULT_WORLD_SIZES, config_fields, row_checks, verify_libraries
from moebench.libraries.spec import Adapter

FIRST_ROW_TIMEOUT_S = 120.0
"""How long a user adapter's import and first row may take when it is tried before the run (its ranks' deadline
too), unless --timeout says otherwise."""
TRIAL_SLACK_S = 10.0
"""What the trial row's process gets beyond its ranks' deadline: the launch's grace for a failing rank (5 s), the
stack dump (1 s) and the kill."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LibraryRequest:
    """What a library run was asked for (each field is the flag of the same name)."""

    libraries: tuple[str, ...] = ()
    """--library: built-in or installed adapters by name."""
    adapter: str | Adapter | None = None
    """--adapter: a user's adapter object, "package.module:ATTRIBUTE" (the Python API: or the object itself)."""
    world_size: int | None = None
    """--world-size (None: DEFAULT_WORLD_SIZES)."""
    ds_config: str | None = None
    """--ds-config: a DeepSpeed config file the engine rows take their settings from (implies deepspeed)."""
    hf_config: str | None = None
    """--hf-config: a model's config.json (implies transformers; autoep and automodel read it too)."""
    recipe: str | None = None
    """--recipe: an NeMo Automodel recipe YAML (implies automodel)."""
    torchtitan_args: str | None = None
    """--torchtitan-args: the arguments given to torchtitan.train, one string (implies torchtitan)."""
    allow_imports: tuple[str, ...] = ()
    """--allow-import: modules outside the framework a recipe or --torchtitan-args may name (consent to import)."""
    resume: bool = False
    """--resume: add the resume rows."""
    repro: str | None = None
    """--repro: a new or empty folder for the failing rows' standalone scripts."""
    rows: tuple[str, ...] = ()
    """--row: run only the rows whose key matches one of these shell globs."""
    timeout_s: float = FIRST_ROW_TIMEOUT_S
    """--timeout: also bounds importing a user's adapter and its trial row."""

    @property
    def adapter_shown(self) -> str:
        """--adapter as the console names it."""
        import sys

        a = self.adapter
        if isinstance(a, str) or a is None:
            return a
        module = type(a).__module__  # the object's name in its class's module, as --adapter would take it
        attr = next((k for k, v in vars(sys.modules.get(module) or object()).items() if v is a), None)
        return f"{module}:{attr}" if attr else f"{module}:{type(a).__name__}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """A checked request: the adapters, world sizes and user settings a run takes."""

    adapters: tuple[Adapter, ...]
    world_sizes: tuple[int, ...]
    previews: tuple[dict[str, Any], ...]
    """Each row's labels, before it runs (the console's table is laid out from them)."""
    user_configs: dict[str, Any]
    summary_extra: dict[str, Any]
    request: LibraryRequest


def names_of(library: str | Sequence[str] | None) -> tuple[str, ...]:
    """--library's names, each once, in order ("a,b" or a sequence); empty: a UserError."""
    parts = library.split(",") if isinstance(library, str) else list(library or ())
    if not all(isinstance(p, str) for p in parts):
        raise UserError(f"names libraries by their names (strings), got {library!r}", flag="--library")
    names = tuple(dict.fromkeys(n.strip() for n in parts if n.strip()))
    if not names:
        raise UserError("names no library; give one or more (see --list), e.g. --library fairscale", flag="--library")
    return names


def prepare(request: LibraryRequest, results_dir: str | None = None) -> Prepared:
    """Check the request and resolve its adapters (UserError on anything wrong; nothing written)."""
    from moebench.resources import require_ranks_fit

    libraries = setups.libraries_for(request)
    user_configs, summary_extra = setups.read(request, libraries)
    if not libraries and request.adapter is None:
        raise UserError("names no library; give --library NAME or --adapter pkg.mod:ADAPTER", flag="--library")
    sizes = DEFAULT_WORLD_SIZES if request.world_size is None else (request.world_size,)
    require_ranks_fit(max(sizes))
    if request.repro is not None:
        check_repro_dir(request.repro, results_dir)
    adapters = registry.require(list(libraries)) if libraries else []
    if request.adapter is not None:
        user = registry.load_user(request.adapter, world_size=max(sizes), timeout_s=request.timeout_s)
        adapters.append(user)
    flag = "--adapter" if request.adapter is not None and not libraries else "--library"
    listed = (f"--list --library {','.join(libraries)} {' '.join(setups.rerun_words(request))}"
              if setups.given(request) else None)  # the user's rows are listed with the same setup flags
    checks = row_checks(adapters, sizes, resume=request.resume, user_configs=user_configs,
                        patterns=request.rows, flag=flag, listed_by=listed)  # no row, or a --row matching none
    if all(c.skip for c in checks):  # nothing would run: decided here, as for a world size with no rows
        first = checks[0]
        raise UserError(f"none of the {len(checks)} row(s) of {', '.join(a.name for a in adapters)} at world size "
                        f"{', '.join(map(str, sizes))} can run here; {first.name}: {first.skip}"
                        + (f" (and {len(checks) - 1} more skip)" if len(checks) > 1 else ""), flag=flag)
    if request.adapter is not None:
        problem = first_row_problem(user, max(sizes), request.timeout_s)
        if problem:
            raise UserError(f"{request.adapter_shown}: {problem} (docs/adding-a-library.md)", flag="--adapter")
    previews = tuple({**dict(c.check.labels), "check": c.name} for c in checks)
    return Prepared(adapters=tuple(adapters), world_sizes=sizes, previews=previews, user_configs=user_configs,
                    summary_extra=summary_extra, request=request)


def list_rows(request: LibraryRequest) -> list[dict[str, Any]]:
    """`--list --library NAME` / `--list --adapter X`: the rows a run would take, nothing run (each row's key, which
    --row matches, and why it would skip here, when it would)."""
    sizes = DEFAULT_WORLD_SIZES if request.world_size is None else (request.world_size,)
    libraries = setups.libraries_for(request)
    user_configs, _ = setups.read(request, libraries)  # the rows of the user's own setup, when one is given
    adapters = registry.require(list(libraries)) if libraries else []
    if request.adapter is not None:
        adapters.append(registry.load_user(request.adapter, world_size=max(sizes), timeout_s=request.timeout_s))
    flag = "--adapter" if request.adapter is not None and not libraries else "--library"
    checks = row_checks(adapters, sizes, resume=request.resume, user_configs=user_configs, patterns=request.rows,
                        flag=flag)
    return [{"check": c.name, "library": c.row.library, "world_size": c.row.world_size, "kind": c.row.kind,
             "skip": c.skip} for c in checks]


def first_row_problem(adapter: Adapter, world_size: int, timeout_s: float = FIRST_ROW_TIMEOUT_S) -> str:
    """A user's adapter (--adapter) runs its first row once, in a child process, before the run folder exists: one
    line when its rank code raised there (what, where), "" when the row ran (passing or failing). A broken adapter
    is then bad input (exit 2), not a row of findings."""
    import multiprocessing as mp

    from moebench.orphans import kill_tree

    rows = [c.row for c in row_checks([adapter], (world_size,), flag="--adapter") if not c.skip]
    if not rows:
        return ""
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_try_row, args=(adapter, rows[0], timeout_s, writer))  # it starts ranks: no daemon
    child.start()
    writer.close()
    child.join(timeout_s + TRIAL_SLACK_S)
    if child.is_alive():
        kill_tree(child.pid)  # its ranks, and whatever they started
        child.join(5)
        return f"its first row {rows[0].key()} did not finish within {timeout_s:g} s (--timeout)"
    try:
        return reader.recv() if reader.poll() else f"its first row ended the process (exit code {child.exitcode})"
    except EOFError:
        return f"its first row ended the process (exit code {child.exitcode})"


def _try_row(adapter: Adapter, row, timeout_s: float, writer) -> None:
    from moebench.libraries.matrix import registered
    from moebench.orphans import die_with_parent
    from moebench.parity.diagnosis import LIBRARY_RAISED, PROTOCOL
    from moebench.parity.raised import RANK_RAISED
    from moebench.parity.runner import ParityConfig, run_checks
    from moebench.rankenv import debug

    die_with_parent()  # a killed command leaves no trial row behind
    # The trial's ranks talk to neither stdout (--json's) nor stderr: what they print, and torch's C++ warnings
    # when a peer goes away, would bury the one line that says what broke (MOEBENCH_DEBUG=1 shows it).
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(2 if debug() else quiet, 1)
    if not debug():
        os.dup2(quiet, 2)
    os.close(quiet)
    try:
        checks = row_checks([adapter], (row.world_size,), patterns=(row.key(),))
        with registered(checks):
            record = run_checks(ParityConfig(world_size=row.world_size, checks=(row.key(),),
                                             timeout_s=timeout_s))["checks"][0]
        d = record.get("diagnosis") or {}
        if record["launch_status"] == "ok" or d.get("name") not in (LIBRARY_RAISED, RANK_RAISED, PROTOCOL):
            writer.send("")  # it ran (passing or failing), or hung or died: the run's rows say so
            return
        details = d["details"]
        if d["name"] == PROTOCOL:
            writer.send(f"on row {row.key()}, {details['exception'].split(': ', 1)[-1]}")
            return
        at = f" at {os.path.basename(details['file'])}:{details['line']}" if "file" in details else ""
        writer.send(f"its rank code raised on row {row.key()}: {details['exception'][:200]}{at}")
    except BaseException as exc:  # noqa: BLE001 - whatever the user's adapter does is the user's input
        writer.send(f"its first row could not run: {type(exc).__name__}: {exc}"[:300])


def check_repro_dir(path: str, results_dir: str | None = None) -> None:
    """--repro must be a folder that is new or empty, writable, and not inside the results folder (other runs')."""
    from moebench.results import cannot_write_in, nearest_existing, results_root, run_folder_around

    folder = Path(path).expanduser().absolute()
    try:
        real, root = folder.resolve(), results_root(results_dir).expanduser().resolve()
    except (OSError, RuntimeError):  # a link loop
        raise UserError(f"{path} cannot be resolved (a link loop?); give a new or empty folder", flag="--repro") \
            from None
    if real == root or root in real.parents:
        raise UserError(f"{path} is inside the results folder {root}; give a folder of its own, e.g. "
                        "--repro ./repro", flag="--repro")
    run = run_folder_around(folder)
    if run is not None:
        raise UserError(f"{path} is inside the run folder {run}; give a folder of its own, e.g. --repro ./repro",
                        flag="--repro")
    existing = nearest_existing(folder)
    if existing == folder:
        if not folder.is_dir():
            raise UserError(f"{path} exists and is not a folder; give a new or empty folder", flag="--repro")
        if any(folder.iterdir()):
            raise UserError(f"{path} is not empty; give a new or empty folder (scripts of an earlier run are "
                            "never overwritten)", flag="--repro")
    elif not existing.is_dir():
        raise UserError(f"{path} cannot be created: {existing} is a file, not a folder", flag="--repro")
    why = cannot_write_in(existing)
    if why is not None:
        raise UserError(f"{path} cannot be created: {why}", flag="--repro")


def rerun_command(prepared: Prepared, record: dict[str, Any], config) -> str:
    """The command that runs this one row again, as it ran: the library (or --adapter), its world size, --resume,
    --ds-config, the seed and tolerance when not the defaults, and --row with the row's key."""
    request = prepared.request
    adapter = next((a for a in prepared.adapters if a.name == record["library"]), None)
    user = request.adapter is not None and adapter is not None and adapter.name not in request.libraries
    which = f"--adapter {request.adapter_shown}" if user else f"--library {record['library']}"
    words = ["moebench verify-parity", which,
             f"-n {record['world_size']}"]
    if "resume" in record.get("features", ()):
        words.append("--resume")
    words += setups.rerun_words(request, record["library"])
    if config.seed:
        words.append(f"--seed {config.seed}")
    if config.tolerance != "strict":
        words.append(f"--tolerance {config.tolerance}")
    return " ".join([*words, f"--row {shlex.quote(record['check'])}"])


def annotation(prepared: Prepared, config) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What a row record gains: `rerun`, for a row that failed or was refused."""
    return lambda r: {"rerun": rerun_command(prepared, r, config)} if r["verdict"] in ("fail", "refused") else {}


def run(prepared: Prepared, config, *, results_dir: str | None = None,
        on_record: Callable | None = None) -> dict[str, Any]:
    """The rows of a prepared request through the parity runner (config: the run's ParityConfig)."""
    request = prepared.request
    return verify_libraries(list(prepared.adapters), prepared.world_sizes, config_fields=config_fields(config),
                            results_dir=results_dir, on_record=on_record, user_configs=prepared.user_configs,
                            summary_extra=prepared.summary_extra, repro_dir=request.repro, resume=request.resume,
                            patterns=request.rows, annotate=annotation(prepared, config))
