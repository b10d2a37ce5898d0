"""The console script (`moebench`, `python -m moebench`): signal handlers first, then the rest.

Installing them before Typer, torch or DeepSpeed is imported means a Ctrl-C or SIGTERM at any
moment - even during start-up imports - ends the command with exit code 130 (see signals.py)."""

from __future__ import annotations

import sys


def main() -> None:
    from moebench import signals

    signals.install()
    try:
        from moebench import tempdirs

        tempdirs.sweep()  # what killed moebench processes left in <tmp>/moebench/
        from moebench.cli.app import app

        app()
    except KeyboardInterrupt:  # before the CLI's own handling existed (start-up imports)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
