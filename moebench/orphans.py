"""A child process never outlives moebench: the kernel kills it when its parent dies (no torch import, so the
GPU check's installer, which runs before torch is there, uses it too)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def set_subreaper(on: bool) -> bool | None:
    """Make this process the one its orphaned descendants are handed to (Linux; a process a rank's code started in
    a session of its own, whose parent died, comes back here instead of to init, where nothing would kill it).
    Returns the previous setting (None where it cannot be set)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        previous = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous)) != 0:
            return None
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0)
        return bool(previous.value)
    except (OSError, AttributeError):
        return None


def descendants(pid: int) -> list:
    """Every live process under `pid` (psutil.Process objects; children first found through /proc)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_processes(processes: list) -> None:
    """SIGKILL each (psutil.Process) and reap those that are this process's children."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for p in processes:
        with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
            p.wait(timeout=2)


def kill_tree(pid: int, *, include_root: bool = True) -> None:
    """SIGKILL `pid` and everything under it, whatever session or process group each moved to."""
    import psutil

    found = descendants(pid)
    if include_root:
        with contextlib.suppress(psutil.Error):
            found.insert(0, psutil.Process(pid))
    kill_processes(found)
