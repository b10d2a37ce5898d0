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


def test_0_2_2_resumes_every_slot_where_its_checkpointer_imports(tmp_path):
    """0.2.2's resume rows (its EP step, its build_optimizers_with_moe_load_balancing, its CheckpointManager): its
    checkpointer imports its dataloader module, which imports torchdata. Without torchdata the rows skip saying so
    (measured where they run: the whole --resume --row request is then refused in one line); with torchdata beside it
    (pure Python, side-installed), both rows pass: ExpertParallel's DTensor experts restored slot by slot at the same
    layout and gathered whole into the module with no parallelism."""
    import os
    import subprocess
    import sys

    from helpers.releases import REPO

    folder = side_install("torchtitan-0.2.2", ["torchtitan==0.2.2", *IMPORTED], "torchtitan/__init__.py")
    refused = cli(folder, "--library", "torchtitan", "-n", "2", "--resume", "--row", "*/resume*", results=tmp_path)
    assert refused.returncode == 2 and "imports torchdata (not installed here" in refused.stderr, refused.stderr
    torchdata = side_install("torchdata-0.11.0", ["torchdata==0.11.0"], "torchdata/__init__.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (folder, torchdata, REPO))),
           "MOEBENCH_RESULTS": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "torchtitan", "-n", "2",
                           "--resume", "--row", "*/resume*", "--json"], env=env, text=True, capture_output=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    assert [(r["check"].rsplit("/", 1)[1], r["verdict"]) for r in rows] == [("resume", "pass"),
                                                                            ("resume-to-none", "pass")], rows
