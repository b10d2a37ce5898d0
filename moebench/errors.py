"""The one error class meant for users.

Core code raises `UserError` for bad input (a flag out of range, a preset that does not exist,
a backend that cannot run here). The CLI catches it once, prints its single line and exits 2.
Anything else is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: one line naming the flag and the fix; exit code 2."""

    exit_code = 2

    def __init__(self, message: str, *, flag: str | None = None) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}" if flag else message)


class RunFailed(RuntimeError):
    """A run started but did not finish; its folder says so (summary.json status "failed").

    The CLI prints the message and the run folder once, and exits 1.
    """

    exit_code = 1

    def __init__(self, message: str, run_path=None) -> None:
        self.run_path = run_path
        super().__init__(message)


class RendezvousFailed(RuntimeError):
    """A launched rank could not meet its peers (none started, a wrong MASTER_ADDR / MASTER_PORT): the CLI says
    so in one line, and exits 1; a run folder made before it says "failed" with the same words."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM after a run folder was marked "interrupted": the CLI names the folder."""

    def __init__(self, run_path) -> None:
        self.run_path = run_path
        super().__init__(f"interrupted; results: {run_path}")


class ConfigError(UserError):
    """A configuration value is invalid (raised from config `__post_init__`)."""
