"""Running external tools (nvcc, nvidia-smi, c++) briefly and safely."""

from __future__ import annotations

import dataclasses
import subprocess

TOOL_TIMEOUT_S = 10.0
"""A version query answers in milliseconds; a tool that takes longer is reported as not answering."""


@dataclasses.dataclass(frozen=True)
class ToolRun:
    ok: bool
    """The tool ran and exited 0."""
    output: str
    """stdout + stderr."""
    error: str = ""
    """Why it did not run or failed ("" when ok)."""


def run_tool(args: list[str], timeout_s: float = TOOL_TIMEOUT_S) -> ToolRun:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, errors="replace")
    except FileNotFoundError:
        return ToolRun(False, "", f"{args[0]} not found")
    except PermissionError:
        return ToolRun(False, "", f"{args[0]} is not executable")
    except OSError as exc:  # e.g. exec format error: a broken binary
        return ToolRun(False, "", f"{args[0]} cannot run: {exc.strerror or exc}")
    except subprocess.TimeoutExpired:
        return ToolRun(False, "", f"{args[0]} did not answer within {timeout_s:.0f} s")
    output = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        last = output.strip().splitlines()[-1] if output.strip() else ""
        return ToolRun(False, output, f"{args[0]} exited with {proc.returncode}" + (f": {last}" if last else ""))
    return ToolRun(True, output)
