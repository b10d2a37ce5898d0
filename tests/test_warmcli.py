"""tests/helpers/warmcli.py, the test helper that forks `python -m moebench` from a warm interpreter: a command run
that way prints, writes and exits as the same command in a fresh interpreter; what it cannot give (start-up
hooks) goes to a fresh interpreter; a timeout kills the command and all it started."""

from __future__ import annotations

import json
import os
import re
import subprocess

import psutil
import pytest
from helpers import warmcli


def _same(warm: subprocess.CompletedProcess, fresh: subprocess.CompletedProcess) -> None:
    scrub = re.compile(r"\d{8}-\d{6}[-\w]*|\d+\.\d+ ?s\b|pid \d+")  # run ids, timings, pids
    assert warm.returncode == fresh.returncode, (warm.stderr, fresh.stderr)
    for a, b in ((warm.stdout, fresh.stdout), (warm.stderr, fresh.stderr)):
        assert scrub.sub("#", a) == scrub.sub("#", b)


@pytest.mark.parametrize("args", [["verify-parity", "-n", "0"], ["verify-parity", "--list"]])  # a refusal, a table
def test_a_warm_command_prints_and_exits_as_a_fresh_one(args):
    _same(warmcli.run(args, timeout=60), warmcli.run(args, timeout=60, fresh=True))


@pytest.mark.multirank
def test_a_warm_run_writes_what_a_fresh_one_writes(tmp_path):
    args = ["verify-parity", "-n", "2", "--checks", "ddp-sgd", "--json"]
    warm = warmcli.run([*args, "--results-dir", str(tmp_path / "warm")], timeout=120)
    fresh = warmcli.run([*args, "--results-dir", str(tmp_path / "fresh")], timeout=120, fresh=True)
    assert warm.returncode == fresh.returncode == 0, warm.stderr + fresh.stderr
    ours, theirs = json.loads(warm.stdout), json.loads(fresh.stdout)
    keep = ("status", "counts", "world_size", "comm_backend", "torch", "python", "launcher")
    assert {k: ours[k] for k in keep} == {k: theirs[k] for k in keep}
    numbers = ("name", "status", "max_abs_diff", "max_rel_diff", "comparisons_total", "backend")
    assert [{k: c[k] for k in numbers} for c in ours["checks"]] == \
        [{k: c[k] for k in numbers} for c in theirs["checks"]]
    (warm_run,), (fresh_run,) = ((tmp_path / side / "parity").iterdir() for side in ("warm", "fresh"))
    assert sorted(f.name for f in warm_run.iterdir()) == sorted(f.name for f in fresh_run.iterdir())


def test_what_acts_at_start_up_gets_a_fresh_interpreter(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys; print('site hook ran', file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert "site hook ran" in warmcli.run(["--version"], env=env, timeout=60).stderr
    assert "site hook ran" not in warmcli.run(["--version"], timeout=60).stderr
    assert warmcli._needs_fresh({**os.environ, "OMP_NUM_THREADS": "7"})  # read when torch starts its threads
    assert not warmcli._needs_fresh(dict(os.environ))


def test_the_commands_environment_cwd_and_pythonpath_are_its_own(tmp_path):
    lib, work = tmp_path / "lib", tmp_path / "work"
    lib.mkdir()
    work.mkdir()
    (lib / "mine.py").write_text("ADAPTER = None\n")  # importable from the call's PYTHONPATH only
    done = warmcli.run(["verify-parity", "--adapter", "mine:ADAPTER", "-n", "2"],
                       env={**os.environ, "PYTHONPATH": str(lib)}, cwd=work, timeout=60)
    assert done.returncode == 2 and "does not meet the adapter protocol" in done.stderr, done.stderr
    # the results folder from the call's environment, relative to the call's folder
    done = warmcli.run(["env-check", "--no-probe"], env={**os.environ, "MOEBENCH_RESULTS": "here"}, cwd=work,
                       timeout=60)
    assert done.returncode in (0, 1) and list((work / "here" / "env").iterdir()), done.stderr


@pytest.mark.multirank
def test_a_timeout_kills_the_command_and_what_it_started(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):  # its ranks are being started then
        warmcli.run(["verify-parity", "-n", "2", "--checks", "ddp-sgd", "--results-dir", str(tmp_path)], timeout=0.8)
    left = psutil.Process(warmcli.server_pid()).children(recursive=True)
    _, alive = psutil.wait_procs(left, timeout=10)  # the ranks die with their parent (PR_SET_PDEATHSIG)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def test_stop_ends_and_reaps_the_warm_interpreter(tmp_path):
    """conftest.py stops it when the session ends: nothing the suite started is left running or unreaped."""
    assert warmcli.run(["runs"], cwd=tmp_path).returncode == 0
    pid = warmcli.server_pid()
    assert pid is not None
    warmcli.stop()
    assert warmcli.server_pid() is None
    assert not psutil.pid_exists(pid)  # exited and reaped (a zombie would still exist)
    assert warmcli.run(["runs"], cwd=tmp_path).returncode == 0  # the next call starts another
