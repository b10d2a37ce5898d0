"""Import, once in the parent, what forked ranks would each import lazily: only what the installed release has.

A library adapter or a parity check declares its `preload` as data: module names, which may include modules
that only some releases of the library have (transformers 5.17 has no `transformers.distributed.expert_parallel`,
DeepSpeed 0.14 no `deepspeed.comm.mori`). `present(names)` keeps the ones this installation has, read off the
files without importing anything; `import_present(names)` imports them. A module that is present but fails to
import is left alone here: the ranks import it themselves and the row reports the error as its own failure.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from pathlib import Path
from typing import Iterable


def has_module(name: str) -> bool:
    """Whether the dotted module `name` exists in this installation, read off the files: nothing is imported
    (importing DeepSpeed before a run sets DS_ACCELERATOR makes it probe, and log, its accelerator)."""
    top, *parts = name.split(".")
    try:
        spec = find_spec(top)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return False
    if spec is None or not parts:
        return spec is not None
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    for i, part in enumerate(parts):
        packages = [f / part for f in folders if (f / part / "__init__.py").is_file()]
        if i == len(parts) - 1:
            return bool(packages) or any((f / f"{part}.py").is_file() for f in folders)
        folders = packages
    return False


def present(names: Iterable[str]) -> tuple[str, ...]:
    """The names of `names` this installation has (has_module), in order."""
    return tuple(n for n in names if has_module(n))


def import_present(names: Iterable[str]) -> list[str]:
    """Import every module of `names` this installation has; returns those that raised on import (their
    error is the ranks' to report, where the row that needs them fails with it)."""
    failed = []
    for name in present(names):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken release is a row's finding, not the parent's crash
            failed.append(name)
    return failed
