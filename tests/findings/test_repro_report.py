"""A `--repro` script opens as the upstream reports of docs/findings/ do: the environment (library and version, torch,
Python, backend, ranks), what was expected, what moebench measured (the row's diagnosis) and how to run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.libraries import repro
from moebench.libraries.deepspeed import ADAPTER
from moebench.libraries.deepspeed.engine import EngineSettings, row_of
from moebench.libraries.matrix import RowCheck
from moebench.libraries.records import with_rows

REPO = Path(__file__).resolve().parents[2]
DIAGNOSIS = {"name": "global-norm", "sentence": "first divergence at ZeRO 0, step 1, all groups, on ranks 0, 1: "
             "every update on rank 0 is the reference's scaled by one common factor per rank (1.025)", "details": {}}


def _header(text: str) -> list[str]:
    """The comment lines between the script's first line and its first non-comment line."""
    lines = text.splitlines()[1:]
    return lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]


def _written(tmp_path: Path, status: str = "fail") -> tuple[Path, dict]:
    row = row_of(EngineSettings(zero_stage=0, ep_size=2, clip=1.0), 2)
    check = {"name": row.key(), "status": status, "labels": row.labels("0.19.8"), "diagnosis": DIAGNOSIS,
             "elapsed_s": 1.0}
    summary = with_rows({"torch": "2.13.0+cpu", "python": "3.11.9", "comm_backend": "gloo", "checks": [check]})
    out = repro.write_scripts(str(tmp_path), summary, {row.key(): RowCheck(check=None, adapter=ADAPTER, row=row)}, 0)
    return tmp_path / repro.script_name(row.key()), out


def test_a_failing_rows_script_opens_with_environment_expected_and_actual(tmp_path):
    path, out = _written(tmp_path)
    assert out["repro"] == [{"check": out["checks"][0]["name"], "path": str(path)}]
    text = path.read_text()
    assert text.startswith(f"{repro.HEAD} deepspeed/engine/")
    flat = " ".join(line.lstrip("# ").strip() for line in _header(text))
    assert "Environment: deepspeed 0.19.8, torch 2.13.0+cpu, Python 3.11.9; CPU, gloo, 2 ranks." in flat, flat
    assert "Expected: the library's run agrees with the row's reference" in flat
    assert ("Actual (measured by moebench): global-norm: first divergence at ZeRO 0, step 1, all groups, on ranks "
            "0, 1: every update on rank 0 is the reference's scaled by one common factor per rank (1.025)") in flat
    assert f"Run: python {path.name}: exit 1 when the bug shows, 0 when it does not" in flat
    assert all(len(line) <= repro.REPORT_WIDTH for line in _header(text))
    compile(text, str(path), "exec")  # still a script: the header is comments only


def test_a_source_not_made_by_fill_is_written_as_it_is():
    assert repro.with_report("print(1)\n", {"diagnosis": "x"}, {}, "a.py") == "print(1)\n"


@pytest.mark.slow
def test_the_cli_writes_the_report_header_into_a_failing_rows_script(tmp_path):
    """The real row of docs/findings/deepspeed-zero3-universal-shared-step.md (16 s of row, then its script)."""
    key = "autoep/mixtral/zero3/ep=2to1/w2/resume+universal"
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "autoep", "--resume",
                           "--row", key, "--json", "--repro", str(tmp_path / "repro")],
                          env={**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results"), "DS_ACCELERATOR": "cpu"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["rows"]
    path = tmp_path / "repro" / repro.script_name(key)
    flat = " ".join(line.lstrip("# ").strip() for line in _header(path.read_text()))
    assert re.search(rf"Environment: deepspeed {re.escape(row['version'])} \(moebench's autoep rows\), torch \S+, "
                     r"Python \S+; CPU, gloo, 2 ranks\.", flat), flat
    assert f"Actual (measured by moebench): {' '.join(row['diagnosis'].split())}" in flat, flat
