"""gpucheck.json and a gpu-check summary.json have schemas, and the reader holds files to them."""

from __future__ import annotations

import copy

import pytest
from helpers.gpucheck import recorded, write_recorded_run

from moebench import results
from moebench.gpucheck import runner
from moebench.schemas import first_error, schema_for


def test_the_schema_key_is_what_the_runner_stamps():
    assert schema_for("gpucheck.json")["properties"]["schema"] == {"const": runner.SCHEMA}
    assert "gpucheck.json" in results.RUN_FILES


def test_the_recorded_document_is_valid_and_read_back_through_its_schema(tmp_path):
    assert first_error("gpucheck.json", recorded()) is None
    run = write_recorded_run(tmp_path / "results")
    files = results.read_run(run)
    assert not files.damage and files.documents["gpucheck.json"]["steps"][0]["name"] == "fastmoe-build"
    assert files.summary["report"] == "gpucheck.json" and files.summary["exit_code"] == 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(status="maybe"), "['status']: 'maybe' is not one of"),
    (lambda d: d["steps"][0].update(status="done"), "['steps'][0]['status']"),
    (lambda d: d["steps"][2]["result"]["gates"][0].pop("comparisons_failed"), "'comparisons_failed' is a required"),
    (lambda d: d["steps"][7]["result"]["rows"][0].update(dtype="fp8"), "'fp8' is not one of"),
    (lambda d: d["steps"][3]["result"].update(params_total=-5), "-5 is less than the minimum"),
    (lambda d: d["counts"].pop("timeout"), "'timeout' is a required property"),
])
def test_a_wrong_document_is_named(change, message):
    doc = copy.deepcopy(recorded())
    change(doc)
    assert message in first_error("gpucheck.json", doc)


def test_a_finished_gpu_check_summary_names_its_counts():
    summary = {"schema": "moebench.summary/1", "kind": "gpu-check", "run_id": "x", "run_path": "/x", "status": "ok",
               "started_at": "2026-01-01T00:00:00", "wall_time_s": 1.0, "pid": 1, "host": "h"}
    assert "'counts' is a required property" in first_error("summary.json", summary)
    assert first_error("summary.json", {**summary, "status": "running"}) is None
    done = {**summary, "counts": {"pass": 1}, "exit_code": 0, "report": "gpucheck.json"}
    assert first_error("summary.json", done) is None
