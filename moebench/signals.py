"""Ctrl-C and SIGTERM, the same way at every moment of a command (no torch import here).

The console script installs `on_signal` before anything else is imported. The first SIGINT or
SIGTERM is remembered and raised as KeyboardInterrupt; later ones are only remembered, so the
clean-up the first one started (killing ranks, writing "interrupted") is not cut short. A signal
that some library swallowed (an import catching everything) is not lost: `check()` re-raises it
before a run folder is created, and the command exits 130 whatever happened after it.
"""

from __future__ import annotations

import contextlib
import signal

_received: int | None = None
_ignoring = False


def on_signal(signum, frame) -> None:
    global _received
    first = _received is None
    _received = signum
    if first and not _ignoring:
        raise KeyboardInterrupt(f"signal {signum}")


def install() -> None:
    """SIGINT and SIGTERM -> `on_signal` (main thread only; elsewhere a no-op)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)


def ignore() -> None:
    """The command is exiting, its work done and its files written: from now on SIGINT and SIGTERM
    are ignored. (The interpreter's shutdown resets Python-level handlers to the default, which
    would let a signal in its last milliseconds kill the process; SIG_IGN is left in place.)"""
    global _ignoring
    _ignoring = True
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def received() -> int | None:
    """The first signal received since `install`, or None."""
    return _received


def check() -> None:
    """Raise KeyboardInterrupt now if a signal arrived (and was swallowed on its way)."""
    if _received is not None:
        raise KeyboardInterrupt(f"signal {_received}")


def reset() -> None:
    """Forget a received signal (tests that run several commands in one process)."""
    global _received, _ignoring
    _received, _ignoring = None, False


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside, SIGTERM behaves like Ctrl-C (KeyboardInterrupt) for code that runs without the
    console script (the run driver called as a library). Outside the main thread it does nothing."""
    try:
        previous = signal.signal(signal.SIGTERM, on_signal)
    except ValueError:  # signals can only be set from the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
