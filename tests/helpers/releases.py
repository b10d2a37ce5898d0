"""Real releases of a library, side-installed for the slow tier: `pip install --target` into a cache folder,
never into the venv, then put first on PYTHONPATH of a CLI run. A release that pip cannot get skips the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MOEBENCH_TEST_CACHE", Path.home() / ".cache" / "moebench-test"))
"""Where the releases are installed once and reused (delete a folder to reinstall it)."""
PIP_TIMEOUT_S = 300.0
"""pip downloads and builds a release in seconds; minutes mean the registry is unreachable."""
CLI_TIMEOUT_S = 900.0
"""The first import of a fresh --target copy compiles its .pyc files (~1 min on 2 busy cores); the rows
themselves take seconds to a minute."""


def side_install(name: str, requirements: list[str], marker: str) -> Path:
    """The folder holding `requirements` (pip's --no-deps: each one listed), installed on first use under
    CACHE/name; `marker` is a file inside it that says the install is whole (e.g. "deepspeed/__init__.py")."""
    target = CACHE / name
    if (target / marker).is_file():
        return target
    partial = CACHE / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial),
                               "--no-deps", *requirements], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not install {' '.join(requirements)} within {PIP_TIMEOUT_S:.0f} s")
    if done.returncode != 0:
        last = ([line for line in done.stderr.splitlines() if line.strip()] or ["?"])[-1]
        pytest.skip(f"pip could not install {' '.join(requirements)}: {last.strip()}")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def cli(folder: Path, *args: str, results: Path) -> subprocess.CompletedProcess:
    """`python -m moebench verify-parity ARGS` with `folder` first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{REPO}", "MOEBENCH_RESULTS": str(results)}
    return subprocess.run([sys.executable, "-m", "moebench", "verify-parity", *args], env=env, text=True,
                          capture_output=True, timeout=CLI_TIMEOUT_S)
