"""A broken checkpoint as a real release writes it: NeMo Automodel 0.5.0 (side-installed, first on PYTHONPATH of the
maker; slow tier) saves no optimizer state for the gate, whose gradient its EP all-gather never carries (its resume
then refuses: NVIDIA-NeMo/Automodel#2088). The audit names the gate's missing state from the files alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MAKE_TIMEOUT_S, audit
from helpers.automodel_torch import runs_its_parallelizer
from helpers.releases import side_install

pytestmark = [pytest.mark.slow, pytest.mark.multirank]
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@runs_its_parallelizer
def test_automodel_0_5_0_saves_no_state_for_the_gate_and_the_audit_names_it(tmp_path):
    folder = side_install("nemo-automodel-0.5.0", ["nemo-automodel==0.5.0"], "nemo_automodel/__init__.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (folder, HERE, REPO)))}
    made = subprocess.run([sys.executable, str(HERE / "make_automodel.py"), str(tmp_path), "2"], capture_output=True,
                          text=True, timeout=MAKE_TIMEOUT_S, env=env)
    assert made.returncode == 0, made.stderr[-4000:]
    code, out, err, _ = audit(str(tmp_path / "sound" / "step_2"))
    assert code == 1, (out, err)
    gate = [line for line in out.splitlines() if "missing-state" in line and "mlp.gate.weight" in line]
    assert gate, out
