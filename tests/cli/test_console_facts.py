"""Facts the console states are true (issue 18, item 4): the plan line under --steps, the
Makefile's word on run-all's presets, a --world-size that contradicts the launcher's, who speaks
when one rank of a launched job refuses, and the folder a Ctrl-C marked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import warmcli

from moebench import variants

ROOT = Path(__file__).resolve().parents[2]
MOEBENCH = [sys.executable, "-m", "moebench"]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return warmcli.run(args, timeout=120, env={**os.environ, **(env or {})})  # tests/helpers/warmcli.py


@pytest.mark.parametrize("flags,plan", [
    ({("train", "steps"): 4}, "4 steps, epochs of 8 steps"),
    ({("train", "steps"): 12}, "12 steps, epochs of 8 steps"),
    ({}, "2 epochs x 8 steps"),
    ({("train", "epochs"): 1}, "1 epoch x 8 steps"),
])
def test_the_deepspeed_plan_line_says_what_will_run(flags, plan):
    variant = variants.by_name("deepspeed")
    headline = variant.headline(variants.resolve_config(variant, "quick", flags))
    assert f"; {plan} (preset quick)" in headline, headline


def test_makefile_run_all_comment_names_the_presets_it_runs():
    """The comment above run-all says which preset each variant runs; the recipe must run that one
    (an explicit --preset, or else each variant's own default)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run-all:"))
    comment = " ".join(line.lstrip("# ") for line in lines[max(0, start - 3):start] if line.startswith("#"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    said = re.search(r"with its (\w+) preset", comment)
    assert said, comment
    explicit = re.search(r"--preset (\w+)", " ".join(recipe))
    for variant in variants.VARIANTS:
        runs = explicit.group(1) if explicit else variant.default_preset
        assert runs == said.group(1), f"run-all runs {variant.name} with {runs}, its comment says {said.group(1)}"


LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@pytest.mark.parametrize("command", [["run", "fastmoe"], ["run", "deepspeed"],
                                     ["verify-parity", "--checks", "ddp-sgd"]])
def test_a_world_size_that_contradicts_the_launcher_is_refused(tmp_path, command):
    out = _cli(*command, "-n", "4", "--results-dir", str(tmp_path), env=LAUNCHED)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: -n/--world-size: asks for 4 ranks") and "job of 2" in line, line
    assert "--nproc-per-node 4" in line
    assert not any(tmp_path.iterdir())
    if command == ["run", "fastmoe"]:  # the other rank refuses too, silently (after a grace): rank 0 speaks
        quiet = _cli(*command, "-n", "4", "--results-dir", str(tmp_path), env={**LAUNCHED, "RANK": "1"})
        assert quiet.returncode == 2 and quiet.stderr == "", quiet.stderr


def test_a_world_size_that_matches_the_launcher_is_accepted():
    out = _cli("run", "fastmoe", "-n", "2", "--show-config", env=LAUNCHED)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["launch"]["world_size"] == 2


def test_bench_under_a_launcher_blames_the_launcher_not_a_flag_never_passed(tmp_path):
    out = _cli("bench", "--quick", "--results-dir", str(tmp_path), env=LAUNCHED)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--world-size" not in line and "one rank of a torchrun / deepspeed launch" in line, line
    other = _cli("bench", "--quick", "--results-dir", str(tmp_path), env={**LAUNCHED, "RANK": "1"})
    assert other.returncode == 2 and other.stderr == "", other.stderr  # no "interrupted", no second copy


def test_ctrl_c_names_the_run_folder_it_marked(tmp_path):
    root = tmp_path / "results"
    proc = subprocess.Popen([*MOEBENCH, "run", "fastmoe", "--steps", "100000", "--results-dir", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        metrics = None
        while time.monotonic() < deadline:  # training has started: the folder exists and says "running"
            found = list(root.glob("fastmoe/*/metrics.jsonl"))
            if found and found[0].stat().st_size:
                metrics = found[0]
                break
            time.sleep(0.1)
        assert metrics is not None, "the run never started training"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    run = metrics.parent
    assert proc.returncode == 130, err
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert err.rstrip().endswith(f"results: {run}"), err


@pytest.mark.multirank
@pytest.mark.parametrize("args,reason", [
    (["run", "fastmoe", "-n", "4"], "error: -n/--world-size: asks for 4 ranks, but this process is one rank of a "
                                     "launched job of 2"),
    (["bench", "--quick"], "error: bench times one process"),
])
def test_under_real_torchrun_a_refusal_is_said_once_by_rank_0(tmp_path, args, reason):
    env = {**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "moebench", *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count(reason) == 1, both
    assert "interrupted" not in both, both  # the other rank did not speak
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("spelling", ["--comm-backend", "--backend"])
def test_verify_parity_nccl_without_cuda_names_the_flag_as_it_is_spelled_today(tmp_path, spelling):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: nccl is accepted here")
    out = _cli("verify-parity", "-n", "2", spelling, "nccl", "--results-dir", str(tmp_path))
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: --comm-backend: nccl needs CUDA") and "use --comm-backend gloo" in line, line
    assert "--backend " not in line
