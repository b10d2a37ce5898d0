"""The console script (`moebench`, `python -m moebench`): signal handlers first, then the rest.

Installing them before Typer, torch or DeepSpeed is imported means a Ctrl-C or SIGTERM at any
moment - even during start-up imports - ends the command with exit code 130 (see signals.py)."""

from __future__ import annotations

import atexit
import os
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
    interrupted = signals.pending() or code == 130
    code = 130 if interrupted else code
    if interrupted or _is_torch_rank():
        finish_rank(code)
    sys.exit(code)


def _is_torch_rank() -> bool:
    from moebench.rankenv import is_launched_rank

    return is_launched_rank() and "torch.distributed" in sys.modules


def finish_rank(code: int | str | None) -> None:
    """End without interpreter finalisation: a rank of an external launch (torchrun), or a command
    that a signal interrupted (its files already say so).

    The exit handlers run first, while the interpreter is whole (they tear the process groups
    down), then the process leaves with os._exit, with the exit code chosen here. Finalisation is
    what is skipped: there, a gloo or DeepSpeed object freed late can abort a rank ("terminate
    called without an active exception", SIGABRT), which torchrun reports as the job's failure
    after a clean run; and CI saw an interrupted run that had printed its message end as killed
    by SIGINT (-2) instead of exiting 130."""
    if isinstance(code, str):  # sys.exit("message") semantics: print it, exit 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code or 0)
