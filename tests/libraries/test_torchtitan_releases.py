"""Older torchtitan releases, side-installed with what their MoE path imports (pip's --target, never into the venv)
and first on PYTHONPATH of a CLI run (slow tier): each release's verdicts as measured here (docs/libraries.md,
"torchtitan releases"). 0.2.x has `torchtitan.models.moe` and its EP step (`ExpertParallel`); its TP plans live in
apply_moe_ep_tp, which imports torchdata and tensorboard: those rows skip with that reason."""

from __future__ import annotations

import json

import pytest
from helpers.releases import cli, side_install

pytestmark = pytest.mark.slow

IMPORTED = ["spmd-types==0.2.3", "tyro==1.0.17", "docstring-parser==0.18.0"]
"""What torchtitan's modules import that it does not declare (the extra `torchtitan`'s pins)."""


def _run(version: str, tmp_path) -> dict:
    folder = side_install(f"torchtitan-{version}", [f"torchtitan=={version}", *IMPORTED], "torchtitan/__init__.py")
    done = cli(folder, "--library", "torchtitan", "-n", "2", "--json", results=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert {r["version"] for r in summary["rows"]} == {version}
    return summary


def test_0_2_2_passes_its_ep_rows(tmp_path):
    summary = _run("0.2.2", tmp_path)
    assert summary["counts"] == {"pass": 2, "fail": 0, "skip": 2}
    passed = [r for r in summary["rows"] if r["verdict"] == "pass"]
    assert {r["ep_mode"] for r in passed} == {"ep"} and all("bincount" in r["patch"] for r in passed)
    assert all("apply_moe_ep_tp" in r["diagnosis"] for r in summary["rows"] if r["verdict"] == "skip")


def test_0_2_0_passes_its_ep_row_and_lacks_grouped_routing(tmp_path):
    summary = _run("0.2.0", tmp_path)
    assert summary["counts"] == {"pass": 1, "fail": 0, "skip": 3}
    grouped = [r for r in summary["rows"] if r["model"] == "sigmoid-grouped+shared"]
    assert all("node-limited routing" in r["diagnosis"] for r in grouped)
