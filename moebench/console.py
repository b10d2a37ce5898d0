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


@contextlib.contextmanager
def output_captured():
    """Inside: everything written to fd 1 and 2 (Python, C/C++, forked children: a library's banners and
    progress bars) goes to a temporary file instead of the console. Yields a list that holds, on the way
    out, the text written (for a caller that wants to quote it in an error)."""
    import tempfile

    captured: list[str] = []
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink, open(sink.fileno(), "w", closefd=False) as text:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            # sys.stdout / sys.stderr may not be fds 1 and 2 (a caller's redirect, pytest's capture)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield captured
        finally:
            text.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            captured.append(sink.read().decode("utf-8", errors="replace"))


ELLIPSIS = "…"
"""What rich puts where it cuts a cell that does not fit: a table showing it cut a number."""


def terminal_console(stderr: bool = False):
    """A rich Console as wide as the terminal it prints to; piped, as wide as $COLUMNS, else 80 (rich's
    rules). Never a hard-coded width: every table is laid out for the width the user has."""
    from rich.console import Console

    return Console(highlight=False, stderr=stderr)


def fits(console, renderable) -> bool:
    """True when `renderable` prints at the console's width with nothing cut (no `…` that a wide
    rendering does not have) and no line wider than the console."""
    from rich.cells import cell_len
    from rich.console import Console

    with console.capture() as narrow:
        console.print(renderable, crop=False)  # a line rich would crop at the edge stays long: seen here
    text = narrow.get()
    if any(cell_len(line) > console.width for line in _plain(text).splitlines()):
        return False
    if ELLIPSIS not in text:
        return True
    wide = Console(width=10_000, highlight=False, color_system=None)
    with wide.capture() as full:
        wide.print(renderable)
    return text.count(ELLIPSIS) <= full.get().count(ELLIPSIS)


def print_fitting(console, *layouts) -> None:
    """Print the first of `layouts` (widest first) that fits the console whole; the last one anyway."""
    for layout in layouts[:-1]:
        if fits(console, layout):
            console.print(layout)
            return
    console.print(layouts[-1])


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
