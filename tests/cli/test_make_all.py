"""`make all`'s sequencing, with a stand-in `moebench` (the real steps take ~4 minutes; the report
they feed is tested in tests/report): every step runs in order, a failing step does not stop the
later ones, and `make all` exits non-zero naming what failed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.userenv import outside_make

REPO = Path(__file__).resolve().parents[2]

FAKE = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in
  "run --list") echo fastmoe; echo deepspeed ;;
  *"{fail}"*) echo "stand-in failure" >&2; exit 3 ;;
esac
exit 0
"""


def _make_all(tmp_path: Path, fail: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    fake = venv / "bin" / "moebench"
    fake.write_text(FAKE.format(log=log, fail=fail or "no step matches this"))
    fake.chmod(0o755)
    # -o install: the stand-in venv is never built (install is tested by CI's own `make test`).
    out = subprocess.run(["make", "-s", "-o", "install", "all", f"VENV={venv}"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=outside_make(os.environ))
    return out, log.read_text().splitlines()


def test_every_step_runs_in_order_and_the_report_reads_only_this_session(tmp_path):
    out, calls = _make_all(tmp_path, fail="")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [c.split(" --since")[0] for c in calls] == [
        "env-check", "run --list", "run fastmoe --preset chapter", "run deepspeed --preset chapter",
        "verify-parity --world-size 4", "report"]
    assert calls[-1].startswith("report --since 2")  # the session's start: older runs count as not run
    assert "== report: exit 0 after" in out.stdout


@pytest.mark.parametrize("fail", ["run fastmoe", "env-check", "verify-parity"])
def test_a_failing_step_does_not_stop_the_later_ones(tmp_path, fail):
    out, calls = _make_all(tmp_path, fail=fail)
    assert out.returncode != 0
    assert calls[-1].startswith("report --since")  # the report still ran, and shows what failed
    assert len(calls) == 6
    assert f"make all: failed steps: {fail} (exit 3)" in out.stdout
