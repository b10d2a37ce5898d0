"""A run on user code says so: the console, the JSON and the report name the implementation that
replaced moebench's (issue 18, item 6)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import warmcli

pytestmark = pytest.mark.multirank

USER_IMPL = "moebench.parity.experts:Experts"  # a correct implementation, passed the way users pass theirs
NAMED = f"user implementation {USER_IMPL} replaced moebench's for key experts"


def _verify(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return warmcli.run(["verify-parity", "-n", "2", "--checks", "experts", "--results-dir", str(tmp_path), *extra],
                       timeout=120, env={**os.environ, "COLUMNS": "80"})


def test_the_console_json_and_report_name_the_user_implementation(tmp_path):
    out = _verify(tmp_path, "--impl", f"experts={USER_IMPL}")
    assert out.returncode == 0, out.stderr
    assert f"{NAMED} (checks: experts)" in out.stdout

    doc = json.loads(_verify(tmp_path, "--impl", f"experts={USER_IMPL}", "--json").stdout)
    (record,) = doc["checks"]
    assert doc["impls"] == {"experts": USER_IMPL} and record["user_impls"] == {"experts": USER_IMPL}

    from moebench.report import build

    result = build.build_report([doc["run_path"]], root=str(tmp_path))
    assert f"Tested: {NAMED}." in (result.path / "REPORT.md").read_text()


def test_a_run_on_moebench_code_says_so(tmp_path):
    out = _verify(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tested: moebench's own implementations (no --impl)" in out.stdout
    assert "user implementation" not in out.stdout


def test_the_parity_verdict_names_user_code():
    """The "parity vs one process" row of a whole-suite run on user code says whose code passed."""
    from moebench.parity import registry
    from moebench.report import collect, verdict_rows

    checks = [{"name": c.name, "status": "pass", "user_impls": {}} for c in registry.all_checks()]
    checks[0]["user_impls"] = {"experts": USER_IMPL}
    summary = {"status": "ok", "counts": {"pass": len(checks), "fail": 0, "skip": 0}, "checks": checks,
               "world_size": 4, "impls": {"experts": USER_IMPL}, "vacuous_total": 0}
    run = collect.Run(path=Path("results/parity/r1"), kind="parity", status="ok", summary=summary, config=None)
    row = verdict_rows.parity_row(run, "")
    assert row["verdict"] == "reproduced" and row["reason"].endswith(f"on user code: {NAMED}")
