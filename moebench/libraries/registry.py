"""Which library adapters exist, as data, loaded defensively: the built-in ones, the ones installed packages
register, and a user's own (`--adapter`).

- `BUILTIN` maps a library's name to "module:attribute" of its adapter (spec.Adapter).
- An installed package registers adapters through the entry-point group `moebench.adapters` (name =
  "module:attribute"), as pytest plugins do; they show in `--list` and run with `--library NAME`. A name a
  built-in adapter already has is not taken over (`--list` says so).
- `--adapter pkg.mod:ATTR` names one adapter object directly (`load_user`).
An adapter module that is missing or fails to import never breaks `--list` or the other libraries: its error
is kept in IMPORT_ERRORS and reported as that library's one-line why-not.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import traceback

from moebench.errors import UserError
from moebench.libraries.spec import Adapter, problems

BUILTIN = {
    "transformers": "moebench.libraries.transformers:ADAPTER",
    "fairscale": "moebench.libraries.fairscale:ADAPTER",
    "deepspeed": "moebench.libraries.deepspeed:ADAPTER",
    "torchtitan": "moebench.libraries.torchtitan:ADAPTER",
    "automodel": "moebench.libraries.automodel:ADAPTER",
    "megatron": "moebench.libraries.megatron:ADAPTER",
    "autoep": "moebench.libraries.autoep:ADAPTER",
}
"""Library name -> its adapter object ("module:attribute")."""
ENTRY_POINT_GROUP = "moebench.adapters"
"""The entry-point group through which installed packages register adapters."""

IMPORT_ERRORS: dict[str, str] = {}
"""Library name -> the traceback of its adapter module's failed import (or why it was not taken)."""
_loaded: dict[str, Adapter] = {}


def plugins() -> dict[str, str]:
    """Adapters installed packages register (entry points of ENTRY_POINT_GROUP): name -> "module:attribute"."""
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # noqa: BLE001 - broken metadata of some package must not break moebench
        return {}
    return {ep.name: ep.value for ep in sorted(found, key=lambda ep: ep.name)}


def known() -> dict[str, str]:
    """Every adapter by name: the built-in ones, then the installed packages' (a clashing name stays built-in)."""
    extra = {n: v for n, v in plugins().items() if n not in BUILTIN}
    return {**BUILTIN, **extra}


def _import(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load(name: str) -> Adapter | None:
    """The adapter of `name` (None when it does not import or is no Adapter; see IMPORT_ERRORS)."""
    if name not in _loaded and name not in IMPORT_ERRORS:
        target = known()[name]
        module = target.partition(":")[0]
        try:
            adapter = _import(target)
        except ModuleNotFoundError as exc:
            IMPORT_ERRORS[name] = (f"ModuleNotFoundError: no adapter module {module}" if exc.name == module
                                   else traceback.format_exc())
        except Exception:  # noqa: BLE001 - one broken adapter must not break the others
            IMPORT_ERRORS[name] = traceback.format_exc()
        else:
            if isinstance(adapter, Adapter) and adapter.name == name:
                _loaded[name] = adapter
            else:
                what = f"named {adapter.name!r}" if isinstance(adapter, Adapter) else f"a {type(adapter).__name__}"
                IMPORT_ERRORS[name] = f"TypeError: {target} is {what}, not the Adapter named {name!r}"
    return _loaded.get(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status:
    """What `--list` says about one library."""

    name: str
    """The library's name."""
    version: str | None
    """Installed version (None: not installed)."""
    why_not: str | None
    """One line: why it cannot run here (None: it can)."""
    extra: str
    """Its pip extra ("" for an installed package's adapter)."""
    note: str | None = None
    """One line beside a library that runs here (Adapter.note), or None."""
    source: str = "built-in"
    """"built-in", or the entry point ("module:attribute") an installed package registered."""
    releases: str | None = None
    """One line: which releases run here and why the others do not (the adapter's releases())."""


def status(name: str) -> Status:
    adapter = load(name)
    source = "built-in" if name in BUILTIN else known()[name]
    if adapter is None:
        last = IMPORT_ERRORS[name].strip().splitlines()[-1]
        return Status(name=name, version=None, why_not=f"adapter did not import: {last.partition(': ')[2] or last}",
                      extra=name if name in BUILTIN else "", source=source)
    try:
        version, why_not, releases = adapter.version(), adapter.unavailable(), adapter.releases()
        note = None if why_not else adapter.note()
    except Exception as exc:  # noqa: BLE001 - probing a library must not break --list
        version, why_not, releases, note = None, f"probe failed: {type(exc).__name__}: {exc}", None, None
    return Status(name=name, version=version, why_not=why_not, extra=adapter.extra, source=source, releases=releases,
                  note=note)


def statuses() -> list[Status]:
    return [status(name) for name in known()]


def require(names: list[str]) -> list[Adapter]:
    """The adapters of `names` (--library), each able to run here; else one UserError line."""
    every = known()
    unknown = [n for n in names if n not in every]
    if unknown:
        raise UserError(f"unknown library {', '.join(unknown)}; one of {', '.join(every)} "
                        "(see `moebench verify-parity --list`)", flag="--library")
    adapters = []
    for name in names:
        st = status(name)
        if st.why_not:
            raise UserError(f"{name} cannot run here: {st.why_not}", flag="--library")
        adapters.append(load(name))
    return adapters


USER_CHECK_TIMEOUT_S = 120.0
"""How long importing and checking a user's adapter (--adapter) may take in its child process."""


def load_user(target, *, world_size: int, timeout_s: float = USER_CHECK_TIMEOUT_S) -> Adapter:
    """--adapter pkg.mod:ATTR: the user's adapter, first imported and checked against the protocol in a child
    process (an import that hangs, exits or raises cannot take the command with it), then imported here. The
    Python API may give the Adapter object itself (checked here: it is already imported). Anything wrong is one
    UserError line naming --adapter, as is an adapter whose `unavailable()` says it cannot run here."""
    from moebench.parity.registry import import_problem

    def check(obj) -> str:
        found = problems(obj, world_size)
        return f"does not meet the adapter protocol: {found[0]}" + (f" (and {len(found) - 1} more)"
                                                                    if len(found) > 1 else "") if found else ""

    if isinstance(target, Adapter):
        adapter, shown = target, f"{type(target).__name__} {target.name!r}"
        problem = check(adapter)
    elif isinstance(target, str):
        if ":" not in target or not all(target.partition(":")[::2]):
            raise UserError(f"expected package.module:ATTRIBUTE, got {target[:80]!r}", flag="--adapter")
        shown = target
        problem = import_problem(target, timeout_s, validate=check)
        adapter = None if problem else _import(target)
    else:
        raise UserError(f"takes an Adapter object or 'package.module:ATTRIBUTE', got a {type(target).__name__}",
                        flag="--adapter")
    if problem:
        raise UserError(f"{shown} {problem} (docs/adding-a-library.md)", flag="--adapter")
    if adapter.name in known():
        raise UserError(f"{shown} is named {adapter.name!r}, which `--library {adapter.name}` already runs; "
                        "give your adapter a name of its own", flag="--adapter")
    try:
        why_not = adapter.unavailable()
    except Exception as exc:  # noqa: BLE001 - the user's code: its error is the finding
        raise UserError(f"{shown}: its unavailable() raised {type(exc).__name__}: {exc}"[:300],
                        flag="--adapter") from None
    if why_not is not None and not isinstance(why_not, str):
        raise UserError(f"{shown}: its unavailable() returned a {type(why_not).__name__}; it must return a "
                        "string (why it cannot run here) or None", flag="--adapter")
    if why_not:
        raise UserError(f"{shown} cannot run here: {one_line(why_not)}", flag="--adapter")
    return adapter


def one_line(text: str, limit: int = 300) -> str:
    """A user's text as one printable line: control characters (escape sequences, newlines) shown escaped."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(text.split()))
    return out if len(out) <= limit else out[:limit - 3] + "..."
