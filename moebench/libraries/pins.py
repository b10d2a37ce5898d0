"""The versions moebench pins (moebench/constraints.txt, shipped inside the package), read without importing anything:
what an adapter's install line names, and what frameworks.txt installs with pip's --no-deps."""

from __future__ import annotations

import importlib.resources
import re

CONSTRAINTS_FILE = "constraints.txt"
FRAMEWORKS_FILE = "frameworks.txt"
"""The frameworks installed with pip's --no-deps (their declared dependencies clash with the pins or are never
imported on the path moebench drives): `make install` runs `pip install --no-deps -r moebench/frameworks.txt`."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(name: str) -> str | None:
    """The version moebench/constraints.txt pins `name` at (None: not pinned, or the file is unreadable)."""
    try:
        text = importlib.resources.files("moebench").joinpath(CONSTRAINTS_FILE).read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        pin = line.split("#", 1)[0].strip()
        found, _, version = pin.partition("==")
        if version and _canonical(found) == _canonical(name):
            return version.strip()
    return None


def no_deps_command(dist: str, extra: str = "") -> str:
    """The one line that installs a framework moebench installs with --no-deps (and its moebench extra, if any)."""
    version = pinned(dist)
    spec = f"{dist}=={version}" if version else dist
    first = f"pip install 'moebench[{extra}]' && " if extra else ""
    return f"{first}pip install --no-deps {spec}"
