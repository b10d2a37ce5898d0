"""What gpu-check keeps of each step and the verdicts it derives (moebench.gpucheck.judge), from
recorded documents; and the GPU bench step's rows, run here on CPU at a tiny size."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.gpucheck import recorded

from moebench.bench.layers import Point
from moebench.gpucheck import gpubench, judge, peaks


def _runs() -> tuple[dict, dict]:
    steps = {s["name"]: s for s in recorded()["steps"]}
    return copy.deepcopy(steps["run-fmoe"]["result"]), copy.deepcopy(steps["run-reference"]["result"])


def test_equal_runs_pass_and_report_each_rate():
    fmoe, ref = _runs()
    verdict = judge.compare_runs(fmoe, ref)
    assert verdict["status"] == "pass", verdict["reason"]
    assert verdict["loss_max_rel_step"] == 99 and verdict["loss_max_rel_diff"] < judge.CURVE_RTOL
    assert verdict["tokens_per_s_steady"] == {"fmoe": 1000.0, "reference": 1000.0} and verdict["fmoe_speedup"] == 1.0


def test_other_parameter_counts_fail():
    fmoe, ref = _runs()
    fmoe["params_total"] += 1
    assert "parameters differ" in judge.compare_runs(fmoe, ref)["reason"]


def test_a_first_loss_off_by_more_than_its_tolerance_fails():
    fmoe, ref = _runs()
    fmoe["losses"][0] *= 1 + 10 * judge.FIRST_LOSS_RTOL
    verdict = judge.compare_runs(fmoe, ref)
    assert verdict["status"] == "fail" and "first loss differs" in verdict["reason"]


def test_a_curve_that_drifts_apart_fails_naming_the_step():
    fmoe, ref = _runs()
    fmoe["losses"][60:] = [v * 1.05 for v in fmoe["losses"][60:]]
    verdict = judge.compare_runs(fmoe, ref)
    assert verdict["status"] == "fail" and "at step 60" in verdict["reason"]


def test_a_missing_or_non_finite_curve_fails():
    fmoe, ref = _runs()
    assert "cannot be compared" in judge.compare_runs({**fmoe, "losses": None}, ref)["reason"]
    fmoe["losses"][5] = "nan"
    assert judge.compare_runs(fmoe, ref)["status"] == "fail"


def test_the_nccl_probe_is_env_checks_row():
    row = {"id": "probe.nccl", "status": "fail", "found": "hung in all_to_all_single", "hint": "NCCL_P2P_DISABLE=1"}
    assert judge.nccl_probe({"checks": [row]}) == {"status": "fail", "reason": "hung in all_to_all_single",
                                                   "hint": "NCCL_P2P_DISABLE=1"}
    assert judge.nccl_probe({"checks": [{**row, "status": "ok"}]})["status"] == "pass"
    assert judge.nccl_probe(None)["status"] == "fail"


def test_env_checks_digest_keeps_what_warned_or_failed():
    doc = {"status": "warn", "counts": {"ok": 1, "warn": 1, "fail": 0, "skip": 0}, "results_path": "r",
           "checks": [{"id": "cuda.nvcc", "status": "ok", "found": "release 13.0"},
                      {"id": "platform.constraints", "status": "warn", "found": "drift: numpy", "hint": "pip ..."}]}
    digest = judge.digest_envcheck(doc)
    assert digest["flagged"] == [{"id": "platform.constraints", "status": "warn", "found": "drift: numpy",
                                  "hint": "pip ..."}]
    assert digest["facts"] == {"cuda.nvcc": "release 13.0"}


@pytest.mark.parametrize("name, fp32, bf16", [
    ("NVIDIA H100 80GB HBM3", 67.0, 989.4), ("NVIDIA H100 PCIe", 51.2, 756.5), ("NVIDIA H200", 67.0, 989.4),
    ("NVIDIA GeForce RTX 3090", 35.6, 71.0)])
def test_the_peak_is_the_datasheets(name, fp32, bf16):
    peak = peaks.peak_for(name)
    assert (peak.fp32_tflops, peak.bf16_tflops) == (fp32, bf16)
    assert peaks.fraction(fp32 / 2, name, "fp32") == 0.5
    assert peaks.peak_for("Some Future GPU") is None and peaks.fraction(1.0, "Some Future GPU", "bf16") is None


def test_the_bench_rows_on_cpu():
    point = Point(experts=2, tokens=32, top_k=2, d_model=16, d_hidden=32)
    doc = gpubench.measure(point, device="cpu", layers=("ideal", "dense", "reference", "fmoe"),
                           dtypes={"fp32": torch.float32}, warmup=1, repeats=1)
    rows = {r["layer"]: r for r in doc["rows"]}
    assert rows["ideal"]["vs_ideal"] == 1.0 and rows["reference"]["tflops"] > 0
    assert rows["reference"]["peak_fraction"] is None  # no datasheet for a CPU
    assert rows["fmoe"]["skipped"]  # CUDA-only, with its reason
    assert judge.digest_bench(doc)["rows"] == doc["rows"]
