"""The wheel carries everything a run needs: presets (experiments/), schemas, constraints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: build with this venv's setuptools (no network); --no-deps: moebench only
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("moebench-*.whl")
    return built


def test_wheel_holds_presets_schemas_and_constraints(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for preset in ("fastmoe/quick.json", "fastmoe/chapter.json", "deepspeed/quick.json", "deepspeed/chapter.json"):
        assert f"moebench/experiments/{preset}" in names
    assert "moebench/constraints.txt" in names and "moebench/py.typed" in names
    assert any(n.startswith("moebench/schemas/") and n.endswith(".schema.json") for n in names)


def test_installed_wheel_runs_a_preset_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # The wheel's copy comes first on the path (the editable install's finder runs after it).
    env = {**os.environ, "PYTHONPATH": str(target), "MOEBENCH_RESULTS": str(tmp_path / "results")}
    where = subprocess.run([sys.executable, "-c", "import moebench; print(moebench.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    run = subprocess.run([sys.executable, "-m", "moebench", "run", "fastmoe", "--preset", "quick", "--steps", "2",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["status"] == "ok" and summary["steps"] == 2 and summary["run_path"].startswith(str(tmp_path))
