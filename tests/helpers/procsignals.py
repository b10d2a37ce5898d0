"""When moebench owns SIGINT and SIGTERM in a process the test started: read off the kernel, no marker printed.

moebench installs its handlers for both signals at the first line of `moebench.entry.main`, SIGINT then SIGTERM
(moebench/signals.py). Python itself catches SIGINT from its own start-up on but never SIGTERM, so the moment
/proc/<pid>/status lists SIGTERM among the caught signals (SigCgt) both of moebench's handlers are in place."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

POLL_S = 0.001


def handlers_installed(pid: int) -> bool | None:
    """Whether moebench's handlers are in place in process `pid` (None: the process is gone or a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if re.search(r"^State:\s*Z", status, re.MULTILINE):
        return None
    caught = int(re.search(r"^SigCgt:\s*([0-9a-fA-F]+)", status, re.MULTILINE).group(1), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def wait_for_handlers(proc: subprocess.Popen, timeout_s: float = 60.0) -> float:
    """Seconds until `proc` (a moebench command) has its handlers in place; fails the test if it ends first
    or takes longer than `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        state = handlers_installed(proc.pid)
        if state:
            return time.monotonic() - start
        if state is None or proc.poll() is not None:
            raise AssertionError(f"the command ended (exit {proc.poll()}) before moebench installed its handlers")
        time.sleep(POLL_S)
    raise AssertionError(f"moebench's signal handlers were not installed within {timeout_s:.0f} s")


@contextlib.contextmanager
def dispositions_kept():
    """SIGINT and SIGTERM handled (and unblocked) on the way out as on the way in. A command run in the test
    process ends by ignoring both (signals.ignore), and signals.held() blocks them: a process the test process
    started afterwards would inherit SIG_IGN or the mask and never see a Ctrl-C (conftest.py wraps each test)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # blocked signals are inherited through exec too
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def as_from_a_terminal() -> None:
    """SIGINT raises KeyboardInterrupt, SIGTERM terminates, neither is blocked: what a process started from a terminal
    has, whatever this process inherited (a background job of a script starts with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
