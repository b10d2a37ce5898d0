"""verify-parity never hangs and leaves nothing behind: a rank that raises, a rank that hangs,
Ctrl-C / SIGTERM on the real command, and two runs at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank

TESTS_DIR = Path(__file__).parents[1]  # tests/: parity_broken and helpers
MOEBENCH = [sys.executable, "-m", "moebench"]


def _children() -> list[psutil.Process]:
    from helpers.warmcli import children_left

    return children_left()


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MOEBENCH_RESULTS"] = str(tmp_path / "results")
    env.update(extra)
    return env


def test_a_rank_that_raises_fails_its_check_with_rank_and_traceback():
    summary = run_checks(ParityConfig(world_size=3, checks=("all-gather-variable", "ddp-sgd"),
                                      impls={"all-gather": "parity_broken:raising_all_gather"}, timeout_s=20))
    records = {c["name"]: c for c in summary["checks"]}
    gather, ddp = records["all-gather-variable"], records["ddp-sgd"]
    assert gather["status"] == "fail"
    assert "rank 1 raised" in gather["reason"] and "deliberate failure on rank 1" in gather["reason"]
    assert "raising_all_gather" in gather["reason"]  # the traceback, not just the message
    assert ddp["status"] == "pass"  # the next check still runs
    assert not _children()


def test_a_rank_that_hangs_fails_in_bounded_time_with_its_stack():
    start = time.monotonic()
    summary = run_checks(ParityConfig(world_size=3, checks=("all-gather-variable",),
                                      impls={"all-gather": "parity_broken:hanging_all_gather"}, timeout_s=4))
    elapsed = time.monotonic() - start
    record = summary["checks"][0]
    assert record["status"] == "fail"
    # Deadline 4 s, then 1 s for the stack dump; the other ranks' collectives time out 0.75 x 4 s after they
    # start: before the deadline when they reach it within 1 s, before the kill within 2 s (a loaded machine).
    assert elapsed < 15, elapsed
    assert "check all-gather-variable" in record["reason"]
    assert "stuck ranks: [1]" in record["reason"]
    assert "rank 1 stacks when killed" in record["reason"] and "hanging_all_gather" in record["reason"]
    assert not _children()


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_real_command_kills_every_rank(tmp_path, sig):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        MOEBENCH + ["verify-parity", "--world-size", "3", "--checks", "all-gather-variable",
                    "--impl", "all-gather=parity_broken:hang_everywhere_all_gather", "--timeout", "60"],
        env=_env(tmp_path, PARITY_BROKEN_READY=str(ready)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert _wait_for(lambda: ready.exists() and len(ready.read_text().split()) == 3, 30), "ranks never started"
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 3
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "Traceback" not in err
    assert _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), 5)
    (run,) = (tmp_path / "results" / "parity").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


def test_two_concurrent_runs_do_not_clash(tmp_path):
    cmd = MOEBENCH + [
        "verify-parity",
        "--world-size",
        "3",
        "--checks",
        "all-gather-variable,experts,ddp-sgd",
        "--json",
    ]
    procs = [subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    assert docs[0]["run_id"] != docs[1]["run_id"]
    assert all(d["status"] == "ok" and d["counts"]["pass"] == 3 for d in docs)
    assert len(list((tmp_path / "results" / "parity").iterdir())) == 2


def test_under_torchrun_a_rank_that_raises_fails_the_check_and_says_why(tmp_path):
    """A real torchrun job of 3 ranks; rank 1 raises inside the check. Its traceback reaches the
    output at once, the check fails, the saved status is final, and the job exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "moebench", "verify-parity", "--checks", "all-gather-variable",
           "--impl", "all-gather=parity_broken:raising_all_gather", "--timeout", "20", "--json"]
    from helpers.userenv import outside_launcher

    env = outside_launcher(_env(tmp_path))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    assert "deliberate failure on rank 1" in proc.stderr and "raising_all_gather" in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)  # only rank 0 prints, and only the document
    record = doc["checks"][0]
    assert doc["under_torchrun"] and doc["world_size"] == 3
    assert record["status"] == "fail" and "rank 1 raised" in record["reason"], record["reason"]
    (run,) = (tmp_path / "results" / "parity").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
