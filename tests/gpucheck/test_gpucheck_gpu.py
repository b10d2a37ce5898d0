"""Each gpu-check step on a real CUDA GPU (marked gpu: on a CPU-only machine every test here skips with
its reason). They run the step exactly as `moebench gpu-check` does (moebench.gpucheck.runner.run_step)
and assert it passed; `make gpu-check` is the one command that runs them all in order."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from moebench.gpucheck import runner, steps

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU: run `make gpu-check` on a machine with one")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ CUDA GPUs for NCCL (this machine has {GPUS})")
FASTMOE_SRC = os.environ.get("FASTMOE_SRC")
needs_src = pytest.mark.skipif(not FASTMOE_SRC, reason="needs FASTMOE_SRC= a fastmoe source tree to build")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The fastmoe-build step once for the module (its site folder goes on PYTHONPATH for the others)."""
    if GPUS == 0 or not FASTMOE_SRC:
        pytest.skip("needs a CUDA GPU and FASTMOE_SRC")
    ctx = _ctx(tmp_path_factory.mktemp("build"))
    record = runner.run_step(steps.by_name("fastmoe-build"), ctx, runner.child_env(ctx.results_root), {}, {}, ())
    return record


def _ctx(tmp: Path) -> steps.Context:
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    return steps.Context(python=sys.executable, results_root=tmp / "results", run_path=tmp / "run", gpu_count=GPUS,
                         fastmoe_src=FASTMOE_SRC, fastmoe_build=tmp / "fastmoe")


def _step(name: str, tmp: Path, built: dict | None = None) -> dict:
    ctx = _ctx(tmp)
    site = ((built or {}).get("result") or {}).get("site")
    done = {"fastmoe-build": built} if built else {}
    return runner.run_step(steps.by_name(name), ctx, runner.child_env(ctx.results_root, site), done, {}, ())


@needs_src
@needs_gpu
def test_fastmoe_builds_from_its_source(built):
    assert built["status"] == "pass", built["reason"]


@needs_gpu
def test_env_check_strict_on_the_real_toolchain(tmp_path):
    record = _step("env-check", tmp_path)
    assert record["status"] == "pass", record["result"]["flagged"] if record.get("result") else record["reason"]


@needs_src
@needs_gpu
def test_real_fmoe_layer_matches_the_reference_per_gate(tmp_path, built):
    record = _step("layers", tmp_path, built)
    assert record["status"] == "pass", record["result"]


@needs_src
@needs_gpu
def test_both_chapter_runs_on_cuda_agree(tmp_path, built):
    done = {"fastmoe-build": built}
    for name in ("run-fmoe", "run-reference"):
        done[name] = _step(name, tmp_path / name, built)
        assert done[name]["status"] == "pass", done[name]["reason"]
    verdict = runner.run_step(steps.by_name("runs-compare"), _ctx(tmp_path / "c"), {}, done, {}, ())
    assert verdict["status"] == "pass", verdict["reason"]


@needs_gpu
def test_deepspeed_chapter_run_on_cuda(tmp_path):
    record = _step("run-deepspeed", tmp_path)
    assert record["status"] == "pass", record["reason"]


@needs_gpu
def test_the_layer_bench_on_cuda(tmp_path):
    record = _step("bench", tmp_path)
    assert record["status"] == "pass", record["reason"]
    ran = [r for r in record["result"]["rows"] if not r["skipped"]]
    assert {r["layer"] for r in ran} >= {"ideal", "dense", "reference"}


@needs_two
def test_the_nccl_probe_passes(tmp_path):
    ctx = _ctx(tmp_path)
    docs: dict = {}
    runner.run_step(steps.by_name("env-check"), ctx, runner.child_env(ctx.results_root), {}, docs, ())
    record = runner.run_step(steps.by_name("nccl-probe"), ctx, {}, {}, docs, ())
    assert record["status"] == "pass", record["reason"]


@needs_two
def test_verify_parity_over_nccl_at_every_world_size(tmp_path):
    record = _step("verify-parity-nccl", tmp_path)
    assert record["status"] == "pass", record["reason"]
    assert len(record["commands"]) == GPUS - 1
