"""The console script (`moebench`, `python -m moebench`): signal handlers first, then the rest.

Installing them before Typer, torch or DeepSpeed is imported means a Ctrl-C or SIGTERM at any
moment - even during start-up imports - ends the command with exit code 130 (see signals.py)."""

from __future__ import annotations

import sys


def main() -> None:
    from moebench import signals

    signals.install()
    code: int | str | None = 0
    try:
        from moebench import tempdirs

        tempdirs.sweep()  # what killed moebench processes left in <tmp>/moebench-tmp/
        from moebench.cli.app import app

        app()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # before the CLI's own handling existed (start-up imports)
        print("interrupted", file=sys.stderr)
        code = 130
    finally:
        signals.ignore()  # on the way out: a late signal must not kill the interpreter's shutdown
    sys.exit(130 if signals.received() is not None else code)
