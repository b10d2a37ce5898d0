"""Signal soak: SIGTERM / SIGINT at random moments of `run`, `verify-parity`, `bench --quick` and
`report`. Every trial must end with its exit code and summary.json in agreement (0 <-> "ok",
130 <-> "interrupted", or 130 with no folder when the signal came before one was created), no
"running" left, no process of the trial alive, and nothing swallowed on the console ("Exception
ignored", a traceback, matplotlib's "Unable to import Axes3D").

`make test-all` runs the soak (>= 100 trials, several minutes); the default suite one trial of
each command. MOEBENCH_SOAK_SEED replays a soak; the seed is printed."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from helpers.procsignals import wait_for_handlers

pytestmark = pytest.mark.faults

TRIAL_TIMEOUT_S = 180
"""A trial that has not ended this long after its signal is a hang (none should take 30 s)."""
SURVIVOR_GRACE_S = 2.0
"""Ranks die with their parent (PR_SET_PDEATHSIG, killpg): give the kernel this long to reap them."""


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    args: tuple[str, ...]
    window: tuple[float, float]
    """Seconds after moebench's handlers are in place between which the signal is sent (about the command's
    lifetime here)."""
    kind: str
    """The results folder the command writes: results/<kind>/<run-id>/."""


COMMANDS = (
    Command("run", ("run", "fastmoe", "--steps", "40"), (0.3, 4.0), "fastmoe"),
    Command("run -n 2", ("run", "fastmoe", "-n", "2", "--steps", "40"), (0.3, 4.5), "fastmoe"),
    Command("verify-parity", ("verify-parity", "-n", "2"), (0.5, 8.0), "parity"),
    Command("bench --quick", ("bench", "--quick"), (0.5, 8.0), "bench"),
    Command("report", ("report",), (0.3, 3.5), "report"),
)
WEIGHTS = (15, 15, 30, 20, 20)
"""Trials per 100 for each command."""


@pytest.fixture(scope="module")
def report_inputs(tmp_path_factory) -> Path:
    """A results folder with one run of each kind a report reads (copied for each report trial)."""
    root = tmp_path_factory.mktemp("soak-inputs") / "results"
    for args in (("run", "fastmoe", "--steps", "4"), ("verify-parity", "-n", "2", "--checks", "all-gather-variable"),
                 ("env-check", "--no-probe")):
        done = subprocess.run([sys.executable, "-m", "moebench", *args, "--results-dir", str(root)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return root


def _survivors(marker: str) -> list[psutil.Process]:
    """Processes (other than zombies) whose environment carries this trial's marker."""
    alive = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MOEBENCH_SOAK_TRIAL") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return alive


def trial(command: Command, sig: int, offset: float, root: Path, inputs: Path | None) -> dict:
    """Run one command, send `sig` after `offset` s; return what happened and every disagreement."""
    if inputs is not None:
        shutil.copytree(inputs, root)
    before = {p for p in root.glob("*/*")} if root.exists() else set()
    marker = uuid.uuid4().hex
    env = {**os.environ, "MOEBENCH_RESULTS": str(root), "MOEBENCH_SOAK_TRIAL": marker}
    proc = subprocess.Popen([sys.executable, "-m", "moebench", *command.args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_handlers(proc)  # offsets count from there: before it, Python's start-up (test_signals.py)
    time.sleep(offset)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=TRIAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return {"problems": [f"still running {TRIAL_TIMEOUT_S} s after the signal"], "code": None}
    problems = []
    code = proc.returncode
    written = sorted(set(root.glob(f"{command.kind}/*")) - before) if root.exists() else []
    statuses = [json.loads((run / "summary.json").read_text())["status"] if (run / "summary.json").exists()
                else "no summary.json" for run in written]
    if code == 130:
        if statuses not in ([], ["interrupted"]):
            problems.append(f"exit 130 with summary {statuses}")
        if written and str(written[0].absolute()) not in err:
            problems.append("the console message does not name the run folder")
    elif code == 0:
        if statuses != ["ok"]:
            problems.append(f"exit 0 with summary {statuses}")
    else:
        problems.append(f"exit code {code} (summary {statuses})")
    for inp in before:  # a report reads its inputs, never writes them
        if inp.parent.name != "report" and (inp / "summary.json").exists():
            if json.loads((inp / "summary.json").read_text())["status"] != "ok":
                problems.append(f"an input run changed: {inp}")
    for words in ("Exception ignored", "Traceback", "Axes3D"):
        if words in err:
            problems.append(f"{words!r} on the console: {err[-600:]}")
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    alive = _survivors(marker)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _survivors(marker)
    if alive:
        problems.append(f"{len(alive)} process(es) survived: {[p.pid for p in alive]}")
        for p in alive:
            p.kill()
    return {"problems": problems, "code": code, "statuses": statuses, "sent": sent}


def soak(tmp_path: Path, inputs: Path, plan: list[tuple[Command, int, float]]) -> list[str]:
    failures, outcomes = [], {}
    start = time.monotonic()
    for i, (command, sig, offset) in enumerate(plan):
        got = trial(command, sig, offset, tmp_path / f"t{i}", inputs if command.name == "report" else None)
        key = (command.name, str(got["code"]) + ("" if got.get("sent", True) else ", ended before the signal"))
        outcomes[key] = outcomes.get(key, 0) + 1
        for problem in got["problems"]:
            failures.append(f"{command.name} {signal.Signals(sig).name} at {offset:.2f} s: {problem}")
        shutil.rmtree(tmp_path / f"t{i}", ignore_errors=True)
    took = time.monotonic() - start
    print(f"\nsignal soak: {len(plan)} trials in {took:.0f} s; {len(failures)} disagreement(s) or survivor(s)")
    for (name, code), count in sorted(outcomes.items()):
        print(f"  {name:<15} exit {code}: {count}")
    return failures


def _plan(count: int, rng: random.Random) -> list[tuple[Command, int, float]]:
    commands = rng.choices(COMMANDS, weights=WEIGHTS, k=count)
    return [(c, rng.choice((signal.SIGTERM, signal.SIGINT)), rng.uniform(*c.window)) for c in commands]


@pytest.mark.slow
def test_signal_soak_100_trials(tmp_path, report_inputs):
    seed = int(os.environ.get("MOEBENCH_SOAK_SEED", random.randrange(2**32)))
    print(f"MOEBENCH_SOAK_SEED={seed}")
    failures = soak(tmp_path, report_inputs, _plan(100, random.Random(seed)))
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
def test_one_signal_in_each_command(tmp_path, report_inputs):
    """The default suite's share: one trial of each command, early enough to land mid-way."""
    rng = random.Random(os.environ.get("MOEBENCH_SOAK_SEED"))
    plan = [(c, sig, rng.uniform(c.window[0], c.window[0] + 1.5)) for c, sig in
            zip((COMMANDS[0], COMMANDS[2], COMMANDS[3], COMMANDS[4]), (signal.SIGTERM, signal.SIGINT) * 2)]
    failures = soak(tmp_path, report_inputs, plan)
    assert not failures, "\n".join(failures)
