"""Launcher variables that cannot make a rank (issue 32): RANK and WORLD_SIZE without MASTER_ADDR, one without
the other, numbers that are no rank. Every command that runs ranks refuses them in one line, exit 2, with nothing
created under results/ (before: verify-parity left a failed run folder, `run fastmoe` said "run failed: UserError"
and exited 1). A rendezvous nobody joins is one line too (before: a 71-line DistStoreError traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.userenv import LAUNCHER_VARIABLES
from typer.testing import CliRunner

import moebench
from moebench.cli.app import app
from moebench.errors import UserError

pytestmark = pytest.mark.faults
runner = CliRunner()

BAD_ENVS = {
    "no MASTER_ADDR": ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE are set but MASTER_ADDR is not"),
    "no MASTER_PORT": ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                       "RANK and WORLD_SIZE are set but MASTER_PORT is not"),
    "RANK alone": ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    "WORLD_SIZE alone": ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    "not a number": ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
                     "RANK='x' and WORLD_SIZE='2' must be whole numbers"),
    "no such rank": ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
                     "RANK=3 is not a rank of WORLD_SIZE=2"),
}
COMMANDS = {"run fastmoe": ["run", "fastmoe"], "run deepspeed": ["run", "deepspeed"],
            "verify-parity": ["verify-parity", "-n", "2", "--checks", "ddp-sgd"],
            "verify-parity --library": ["verify-parity", "--library", "fairscale"]}
LAUNCH_VARS = (*LAUNCHER_VARIABLES, "TORCHELASTIC_RUN_ID")


@pytest.fixture
def launch_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_env(values: dict[str, str]) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    return set_env


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD_ENVS)
def test_every_command_refuses_launcher_variables_that_make_no_rank(case, command, launch_env, tmp_path):
    values, says = BAD_ENVS[case]
    launch_env(values)
    results = tmp_path / "results"
    out = runner.invoke(app, [*COMMANDS[command], "--results-dir", str(results)])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {says}") and "torchrun" in lines[0], out.stderr
    assert not results.exists()  # nothing created


@pytest.mark.parametrize("call", ["run", "verify_parity", "verify_parity_library"])
def test_the_python_api_refuses_them_too(call, launch_env, tmp_path):
    launch_env(BAD_ENVS["no MASTER_ADDR"][0])
    results = str(tmp_path / "results")
    with pytest.raises(UserError, match="MASTER_ADDR is not"):
        if call == "run":
            moebench.run("fastmoe", results_dir=results)
        elif call == "verify_parity":
            moebench.verify_parity(world_size=2, checks="ddp-sgd", results_dir=results)
        else:
            moebench.verify_parity(library="fairscale", results_dir=results)
    assert not (tmp_path / "results").exists()


def test_a_rendezvous_nobody_joins_is_one_line_and_a_failed_run(tmp_path):
    """Rank 0 of 2 with a master address and no peer: after the deadline, one line naming the address and the
    fix (exit 1), and the run folder says failed with the same words."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--checks", "ddp-sgd", "--timeout", "2",
                           "--results-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 of 2 could not meet its peers at 127.0.0.1:")
    assert "torchrun --nproc-per-node 2" in lines[0] and "Traceback" not in proc.stderr
    import json

    (run,) = (tmp_path / "parity").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "could not meet its peers" in summary["reason"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
