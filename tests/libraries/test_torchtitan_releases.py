"""Older torchtitan releases, side-installed with what their MoE path imports (pip's --target, never into the venv)
and first on PYTHONPATH of a CLI run (slow tier): each release's verdicts as measured here
(docs/libraries/torchtitan.md, "Releases and torch"). 0.2.x has `torchtitan.models.moe` and its EP step
(`ExpertParallel`); its TP plans live in apply_moe_ep_tp, whose module's imports need torchdata, tensorboard and
datasets (torchtitan 0.2 declares all three): without them its TP rows skip naming what is missing (measured where
they run), with them side-installed they run through apply_moe_ep_tp."""

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


TP_DEPENDENCIES = ["torchdata==0.11.0", "tensorboard==2.21.0", "tensorboard-data-server==0.7.2", "grpcio==1.85.3",
                   "protobuf==7.36.2", "markdown==3.11.3", "werkzeug==3.1.9", "datasets==4.7.0", "pyarrow==26.0.1",
                   "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0", "pandas==3.1.1", "pytz==2026.6",
                   "httpx==0.28.1", "requests==2.34.2", "urllib3==2.8.0", "certifi==2026.10.19.post1",
                   "idna==3.20", "charset-normalizer==3.5.3"]
"""torchtitan 0.2.2's declared torchdata, tensorboard and datasets, with what they import that the venv lacks (pip's
--no-deps: each listed), as its users have them: what apply_moe_ep_tp's module imports."""


def test_0_2_2_passes_its_ep_rows_and_says_what_its_tp_rows_lack(tmp_path):
    summary = _run("0.2.2", tmp_path)
    assert summary["counts"] == {"pass": 2, "fail": 0, "skip": 2}
    passed = [r for r in summary["rows"] if r["verdict"] == "pass"]
    assert {r["ep_mode"] for r in passed} == {"ep"} and all("bincount" in r["patch"] for r in passed)
    for r in summary["rows"]:
        if r["verdict"] == "skip":
            assert "apply_moe_ep_tp" in r["diagnosis"] and "torchdata, tensorboard, datasets" in r["diagnosis"], r


def test_0_2_2_runs_its_tp_rows_through_apply_moe_ep_tp_where_its_dependencies_are(tmp_path):
    """The skip reason holds on a machine with torchtitan 0.2.2's declared dependencies: there its TP rows run through
    apply_moe_ep_tp (its TP plans: router NoParallel, experts TensorParallel, shared experts col/row-wise, the MoE's
    input sequence-sharded) and pass within the noise model, as its EP rows do."""
    import os
    import subprocess
    import sys

    from helpers.releases import REPO

    folder = side_install("torchtitan-0.2.2", ["torchtitan==0.2.2", *IMPORTED], "torchtitan/__init__.py")
    deps = side_install("torchtitan-0.2.2-dependencies", TP_DEPENDENCIES, "datasets/__init__.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (folder, deps, REPO))),
           "MOEBENCH_RESULTS": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "torchtitan", "-n", "2",
                           "--json"], env=env, text=True, capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["counts"] == {"pass": 4, "fail": 0, "skip": 0}, summary["rows"]
    assert {r["ep_mode"] for r in summary["rows"]} == {"ep", "tp"}


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
