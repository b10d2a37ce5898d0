"""Under torchrun with 2 ranks, every command talks once (rank 0) and writes one results folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("args,header,kind", [
    (["run", "fastmoe", "--steps", "2"], "fastmoe: moe_impl", "fastmoe"),
    (["run", "deepspeed", "--preset", "quick", "--epochs", "1"], "deepspeed: experts", "deepspeed"),
    (["verify-parity", "--checks", "ddp-sgd"], "verify-parity:", "parity"),
    (["env-check", "--no-probe"], "env-check:", "env"),
])
def test_each_command_prints_its_header_once(tmp_path, args, header, kind):
    env = {**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "moebench",
                          *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    both = out.stdout + out.stderr
    assert both.count(header) == 1, both
    for noise in ("Setting accelerator to CPU", "No existing process group"):
        assert noise not in both
    assert len(list((tmp_path / "results" / kind).iterdir())) == 1
