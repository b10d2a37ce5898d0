"""The report's GPU section (moebench/report/sections/gpu.py), from a recorded gpu-check run only: "not run"
said honestly without one, the steps, gates, runs and bench rows with one, "not judged" when the
recorded file is damaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.gpucheck import write_recorded_run

from moebench.report import build

SECTION = "## On a GPU (moebench gpu-check)"


def _section(result) -> str:
    text = (result.path / "REPORT.md").read_text()
    assert SECTION in text
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "results"
    path.mkdir()
    return path


def test_without_a_gpu_check_run_the_section_says_not_run(root):
    result = build.build_report([], root=str(root))
    section = _section(result)
    assert f"Not run: no gpu-check run under {root}" in section and "make gpu-check" in section
    assert "Nothing in this report was measured on a GPU." in section
    assert "On a GPU (moebench gpu-check)" in (result.path / "report.html").read_text()


def test_a_recorded_run_fills_the_section_from_its_file(root):
    run = write_recorded_run(root)
    section = _section(build.build_report([], root=str(root)))
    assert f"gpu-check {run.name} on recorded-fixture: 1 GPU(s) (Fixture GPU (hand-written, not measured))" in section
    assert "8 pass, 0 fail, 0 timeout, 2 skip in 223 s (budget 480 s)" in section
    for step in ("fastmoe-build", "layers", "run-fmoe", "runs-compare", "bench", "verify-parity-nccl"):
        assert f"| {step} |" in section
    assert "| needs 2+ GPUs, this machine has 1 |" in section
    assert "| naive | 2 | pass | 0/39 |" in section and "| noisy | 1 | pass | 0/39 |" in section
    assert "| fmoe | 273,000,000 | 2.0000 | 1.2080 | 1,000 |" in section
    assert "fmoe vs reference: pass: equal parameters" in section
    assert "| reference | bf16 | 8.0 | 50 % | 1.00 | 1.00 |  |" in section
    assert "| grouped-mm | fp32 | skipped |" in section


def test_a_failed_step_shows_its_reason_and_diagnosis(root):
    def broken(doc):
        layers = next(s for s in doc["steps"] if s["name"] == "layers")
        layers["status"] = "fail"
        layers["reason"] = "exit 1"
        gate = layers["result"]["gates"][0]
        gate.update(status="fail", comparisons_failed=1,
                    first_failure={"name": "input grad", "note": "", "diagnosis": "uniform-scale", "sentence": "x2"})
        doc["counts"] = {"pass": 7, "fail": 1, "skip": 2, "timeout": 0}
        doc["status"] = "fail"
        return doc

    write_recorded_run(root, broken)
    section = _section(build.build_report([], root=str(root)))
    assert "status failed: 7 pass, 1 fail" in section
    assert "| naive | 2 | fail | 1/39 | 0.01 | input grad: uniform-scale |" in section


@pytest.mark.no_schema_check
def test_a_damaged_recorded_file_is_not_judged(root):
    run = write_recorded_run(root)
    doc = json.loads((run / "gpucheck.json").read_text())
    doc["gpu_count"] = -1
    (run / "gpucheck.json").write_text(json.dumps(doc))
    result = build.build_report([], root=str(root))
    assert f"Not judged: run {run.name} is damaged (gpucheck.json: ['gpu_count']" in _section(result)
    assert "gpu-check" in result.damaged
