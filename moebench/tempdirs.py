"""moebench's temporary folders, all under one known prefix, so a later command can remove what a
killed process (SIGKILL, power loss) left behind: <tmp>/moebench-tmp/<pid>-<label>-<random>/."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def root() -> Path:
    return Path(tempfile.gettempdir()) / "moebench-tmp"  # not an importable name: never shadows the package


def make(label: str) -> Path:
    """A new private folder owned by this process (removed by its owner, or by `sweep` once the
    owner is dead)."""
    base = root()
    base.mkdir(mode=0o700, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{label}-", dir=base))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_owned_by(pids) -> list[Path]:
    """Remove the folders these processes made (the launcher, once its ranks have ended or been killed:
    an interrupted rank cannot clean up after itself); returns what was removed."""
    owners = {str(pid) for pid in pids}
    return _remove_where(lambda owner: owner in owners)


def sweep() -> list[Path]:
    """Remove the folders whose owning process is gone; returns what was removed."""
    return _remove_where(lambda owner: owner.isdigit() and not _alive(int(owner)))


def _remove_where(owned) -> list[Path]:
    """Remove the folders under root() whose owner (the pid their name starts with) `owned` accepts."""
    removed = []
    try:
        entries = list(root().iterdir())
    except OSError:
        return removed
    for entry in entries:
        if owned(entry.name.split("-", 1)[0]):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
