"""Ctrl-C and SIGTERM, the same way at every moment of a command (no torch import here).

The handler only records the signal; it never raises. An exception raised from a handler lands
wherever the interpreter happens to be - inside logging's lock release, a finaliser, a callback -
where Python can only print "Exception ignored in ..." and drop it: the run then went on and wrote
"ok" while the command exited 130. Instead the program acts on a recorded signal at safe points
(`check()`, which raises KeyboardInterrupt in ordinary code): a training step's boundary, a parity
check's boundary and the launch's wait loop, a bench point, a report's steps, the creation of a
run folder, and the writing of the final summary.json.

Exit code and summary.json agree by construction:
- `RunDir.finish` writes the final status through `committing()`: a signal recorded and not yet
  acted on turns an "ok" (or "failed") into "interrupted", and raises KeyboardInterrupt (exit 130);
- once the final status is written the command is *committed*: a later signal is ignored, and the
  exit code follows the file (ok 0, failed 1, interrupted 130);
- `pending()` (recorded, not committed) is what makes a command exit 130.

A command stuck where no safe point comes (a blocking call: a sleep, a hung single-process step)
would never act on the signal; so a signal still not acted on after SAFE_POINT_GRACE_S is
delivered once more to the main thread, and that delivery raises KeyboardInterrupt from the
handler (the old way, for code with no safe point; should it be dropped, the final summary.json
still cannot say "ok": see `RunDir.finish`).
"""

from __future__ import annotations

import contextlib
import signal
import threading

_received: int | None = None
_committed = False
_ignoring = False
_acted = False
_forcing = False
_fallback: threading.Timer | None = None
_interrupted_run: str | None = None

HANDLED = (signal.SIGINT, signal.SIGTERM)
SAFE_POINT_GRACE_S = 3.0
"""How long a recorded signal may wait for a safe point before it is raised the old way. Safe
points come every step (the chapter preset's ~1.3 s on 2 cores), every 0.5 s in the launch's wait
loop, every bench point and report step: 3 s is only exceeded inside a blocking call."""


def on_signal(signum, frame) -> None:
    """Record the first SIGINT / SIGTERM (later ones are the same request: the clean-up the first
    one started is not cut short). Raises only on the fallback's re-delivery (see module doc)."""
    global _received, _forcing, _acted
    if _committed or _ignoring:
        return
    if _received is None:
        _received = signum
        _arm_fallback()
    elif _forcing and not _acted:
        if _drops_exceptions(frame):  # raised there it would be printed and dropped: try again a moment later
            _arm_fallback(RETRY_S)
            return
        _forcing, _acted = False, True  # once: the clean-up it starts is not cut short by another
        raise KeyboardInterrupt(describe())


RETRY_S = 0.05
"""How soon the fallback tries again when the signal found the main thread where an exception would be dropped."""
_DROPPING_NAMES = ("__del__",)


def _drops_exceptions(frame) -> bool:
    """Whether an exception raised in `frame` would be printed as "Exception ignored in ..." and dropped: inside
    logging (its lock release runs as a fork hook, seen when a signal met the fork of a rank), a finaliser or a
    weakref callback."""
    import logging
    import weakref

    fragile = {logging.__file__, weakref.__file__}
    while frame is not None:
        if frame.f_code.co_filename in fragile or frame.f_code.co_name in _DROPPING_NAMES:
            return True
        frame = frame.f_back
    return False


def _arm_fallback(after_s: float | None = None) -> None:
    global _fallback
    main = threading.main_thread()
    if threading.current_thread() is not main:
        return
    _fallback = threading.Timer(SAFE_POINT_GRACE_S if after_s is None else after_s, _force, args=(main.ident,))
    _fallback.daemon = True
    _fallback.start()


def _force(main_ident: int) -> None:
    """No safe point acted on the signal in time: deliver it again, to be raised by the handler."""
    global _forcing
    if pending() and not _acted:
        _forcing = True
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(main_ident, _received)


def install() -> None:
    """SIGINT and SIGTERM -> `on_signal` (main thread only; elsewhere a no-op)."""
    with contextlib.suppress(ValueError):
        for sig in HANDLED:
            signal.signal(sig, on_signal)


def ignore() -> None:
    """The command is exiting, its work done and its files written: from now on SIGINT and SIGTERM
    are ignored. (The interpreter's shutdown resets Python-level handlers to the default, which
    would let a signal in its last milliseconds kill the process; SIG_IGN is left in place.)"""
    global _ignoring
    _ignoring = True
    with contextlib.suppress(ValueError, OSError):
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_IGN)


def received() -> int | None:
    """The first signal recorded since `install` (or `reset`), or None."""
    return _received


def pending() -> bool:
    """A signal was recorded and the command has not yet written how it ended: it must exit 130."""
    return _received is not None and not _committed


def describe() -> str:
    """"SIGINT" / "SIGTERM" for the signal recorded ("a signal" when none)."""
    return signal.Signals(_received).name if _received is not None else "a signal"


def check() -> None:
    """A safe point: raise KeyboardInterrupt now if a signal is pending."""
    global _acted
    if pending():
        _acted = True
        raise KeyboardInterrupt(describe())


@contextlib.contextmanager
def held():
    """Hold SIGINT / SIGTERM (main thread) for the few lines inside: they are delivered on exit."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, set(HANDLED))
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask on this platform
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def commit() -> None:
    """The command's final status is on disk: the exit code follows it; later signals are ignored."""
    global _committed
    _committed = True


def note_interrupted(run_path) -> None:
    """Remember the run folder recorded "interrupted", for the console message."""
    global _interrupted_run
    _interrupted_run = str(run_path)


def interrupted_run() -> str | None:
    """The run folder this command recorded "interrupted" (None: no folder had been created)."""
    return _interrupted_run


def interrupted_message(run_path=None) -> str:
    """What the console says when a command was interrupted (two lines, each short): the signal, and
    the run folder it marked (`run_path`, else the one `finish` recorded), on a line of its own so that
    the path can be copied."""
    run = run_path or _interrupted_run
    where = (f"; its summary.json says \"interrupted\"\nresults: {run}" if run
             else "\nnothing was recorded (no run folder had been created)")
    return f"interrupted ({describe()}): every rank was stopped{where}"


def reset() -> None:
    """Forget a received signal and a commit (tests that run several commands in one process)."""
    global _received, _ignoring, _committed, _interrupted_run, _acted, _forcing, _fallback
    if _fallback is not None:
        _fallback.cancel()
    _received, _ignoring, _committed, _interrupted_run, _acted, _forcing, _fallback = (
        None, False, False, None, False, False, None)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside, SIGTERM is recorded like Ctrl-C (and acted on at the next safe point) for code that
    runs without the console script (the run driver called as a library: then each call starts
    afresh, with no signal recorded and nothing committed). Outside the main thread it does nothing."""
    try:
        previous = signal.signal(signal.SIGTERM, on_signal)
    except ValueError:  # signals can only be set from the main thread
        yield
        return
    if previous is not on_signal:  # not under the console script (nor nested): a new command starts
        reset()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
