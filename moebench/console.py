"""Where output goes. stdout belongs to moebench's own results (`--json` prints one document
there); everything else - DeepSpeed's chatter, progress bars, rank output - goes to stderr."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def stdout_to_stderr():
    """Inside: Python prints, C/C++ writes and forked children's output to fd 1 all land on stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def stderr_to_devnull():
    """Inside: everything written to fd 2 (C/C++ included) is dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
