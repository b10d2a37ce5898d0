"""The small real runs that several test files read (the report, the results schemas, the chapter story): made
once per test session through the real CLI, shared by every xdist worker, and copied by each test that writes.
Each run is the smallest that still exercises what its readers assert (see QUICK_RUNS)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from helpers import warmcli
from helpers.userenv import outside_launcher

QUICK_RUNS = {
    # gshard drops tokens at capacity: the report's routing figures show drops (tests/report)
    "fastmoe": ["run", "fastmoe", "--steps", "4", "--gate", "gshard"],
    "deepspeed": ["run", "deepspeed", "--preset", "quick", "--epochs", "2"],
    # ddp-sgd and experts hold every field a check writes; all-gather-variable is a collective check (the report's)
    "parity": ["verify-parity", "-n", "2", "--checks", "ddp-sgd,experts,all-gather-variable"],
    "env": ["env-check", "--no-probe"],
}
"""kind -> the command's arguments; the runs land in one results folder, a run per kind."""


def shared_folder(basetemp: Path) -> Path:
    """A folder every worker of this session sees: under xdist each worker's basetemp sits in one parent."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def quick_runs(basetemp: Path) -> Path:
    """The folder holding `results/` (the runs) and `consoles.json` (kind -> what the command printed on stdout);
    the first worker to ask makes them, the others wait for it. Never write in it: copy it."""
    shared = shared_folder(basetemp)
    folder = shared / "quick-runs"
    with open(shared / "quick-runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, the worker's death included
        if not (folder / "consoles.json").exists():
            results = folder / "results"
            consoles = {}
            # moebench's own launches, as the conftest makes every test's (DS_ACCELERATOR: set by a run for DeepSpeed)
            env = {k: v for k, v in outside_launcher(os.environ).items() if k != "DS_ACCELERATOR"}
            for kind, args in QUICK_RUNS.items():
                done = warmcli.run([*args, "--results-dir", str(results)], timeout=300, env=env)
                assert done.returncode == 0, f"moebench {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
                consoles[kind] = done.stdout
            (folder / "consoles.json").write_text(json.dumps(consoles))  # last: the runs are whole
    return folder
