"""Answers of slow probes ("does `import deepspeed` work here?"), remembered per installation.

A library's import probe runs in a child interpreter (a failing import must not leave half a library in the
command's process): ~2.5 s here for DeepSpeed, more than the rest of `verify-parity --list` together. Its answer
only changes when the installation does, so it is kept in a small JSON file keyed by what it depends on: this
interpreter, the probed package's files (path, size and mtime of its `__init__.py` and of its folder) and any
other part the caller names (torch's version, DS_ACCELERATOR). A reinstall, a side-installed release first on
PYTHONPATH or another interpreter is another key: the probe runs again.

The file is `$MOEBENCH_CACHE/import-probes.json` (default `$XDG_CACHE_HOME/moebench`, else `~/.cache/moebench`).
A cache that cannot be read or written is no cache: the probe runs, nothing fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

CACHE_ENV = "MOEBENCH_CACHE"
FILE = "import-probes.json"
MAX_ENTRIES = 64
"""Older entries are dropped past this many (one per release and interpreter probed)."""


def folder() -> Path:
    """Where the cache file lives."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moebench"


def fingerprint(package_init: str, *parts: str) -> str:
    """The key of a probe of the package whose `__init__.py` is `package_init`, with the caller's `parts`."""
    init = Path(package_init)
    stats = []
    for path in (init, init.parent):
        try:
            st = path.stat()
            stats.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            stats.append(f"{path}:missing")
    raw = json.dumps([sys.executable, sys.version, *stats, *parts])
    return hashlib.sha256(raw.encode()).hexdigest()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def answer(key: str, probe: Callable[[], str | None]) -> str | None:
    """The remembered answer of `probe` under `key`, else `probe()` (then remembered)."""
    path = folder() / FILE
    known = _read(path)
    if key in known and (known[key] is None or isinstance(known[key], str)):
        return known[key]
    result = probe()
    known = {k: v for k, v in list(_read(path).items())[-(MAX_ENTRIES - 1):]}
    known[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return result
