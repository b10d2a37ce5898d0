"""Which library adapters exist, as data, loaded defensively.

`ADAPTERS` maps a library's name to "module:attribute" of its adapter (base.Adapter). An adapter
module that is missing or fails to import never breaks `--list` or the other libraries: its error
is kept in IMPORT_ERRORS and reported as that library's one-line why-not.
"""

from __future__ import annotations

import dataclasses
import importlib
import traceback

from moebench.errors import UserError
from moebench.libraries.base import Adapter

ADAPTERS = {
    "transformers": "moebench.libraries.transformers:ADAPTER",
    "fairscale": "moebench.libraries.fairscale:ADAPTER",
    "deepspeed": "moebench.libraries.deepspeed:ADAPTER",
    "torchtitan": "moebench.libraries.torchtitan:ADAPTER",
}
"""Library name -> its adapter object ("module:attribute")."""

IMPORT_ERRORS: dict[str, str] = {}
"""Library name -> the traceback of its adapter module's failed import."""
_loaded: dict[str, Adapter] = {}


def load(name: str) -> Adapter | None:
    """The adapter of `name` (None when its module does not import; see IMPORT_ERRORS)."""
    if name not in _loaded and name not in IMPORT_ERRORS:
        module, _, attr = ADAPTERS[name].partition(":")
        try:
            _loaded[name] = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            IMPORT_ERRORS[name] = (f"ModuleNotFoundError: no adapter in this moebench ({module})" if exc.name == module
                                   else traceback.format_exc())
        except Exception:  # noqa: BLE001 - one broken adapter must not break the others
            IMPORT_ERRORS[name] = traceback.format_exc()
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
    """Its pip extra."""


def status(name: str) -> Status:
    adapter = load(name)
    if adapter is None:
        last = IMPORT_ERRORS[name].strip().splitlines()[-1]
        return Status(name=name, version=None, why_not=f"adapter did not import: {last.partition(': ')[2] or last}",
                      extra=name)
    try:
        version, why_not = adapter.version(), adapter.unavailable()
    except Exception as exc:  # noqa: BLE001 - probing a library must not break --list
        version, why_not = None, f"probe failed: {type(exc).__name__}: {exc}"
    return Status(name=name, version=version, why_not=why_not, extra=adapter.extra)


def statuses() -> list[Status]:
    return [status(name) for name in ADAPTERS]


def require(names: list[str]) -> list[Adapter]:
    """The adapters of `names` (--library), each able to run here; else one UserError line."""
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise UserError(f"unknown library {', '.join(unknown)}; one of {', '.join(ADAPTERS)} "
                        "(see `moebench verify-parity --list`)", flag="--library")
    adapters = []
    for name in names:
        st = status(name)
        if st.why_not:
            raise UserError(f"{name} cannot run here: {st.why_not}", flag="--library")
        adapters.append(load(name))
    return adapters
