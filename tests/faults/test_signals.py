"""SIGINT and SIGTERM at offsets spread over a whole run's lifetime (start-up imports, folder
creation, training, the final plot and summary): exit 130, never "running", valid metrics lines,
no process left behind. The default suite sends a few offsets; `make test-all` sweeps 20+."""

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

pytestmark = pytest.mark.faults
RUN = [sys.executable, "-m", "moebench", "run", "fastmoe", "--preset", "quick", "--steps", "60"]


def _start(tmp_path: Path, ranks: int) -> tuple[subprocess.Popen, Path]:
    root = tmp_path / "results"
    env = {**os.environ, "MOEBENCH_RESULTS": str(root)}
    proc = subprocess.Popen([*RUN, "--world-size", str(ranks)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, root


def _lifetime(tmp_path: Path, ranks: int) -> float:
    start = time.monotonic()
    proc, _ = _start(tmp_path / "calibrate", ranks)
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    return time.monotonic() - start


def _signal_at(tmp_path: Path, ranks: int, offset: float, sig: int) -> None:
    proc, root = _start(tmp_path, ranks)
    time.sleep(offset)
    family: list[psutil.Process] = []
    if proc.poll() is None:
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        proc.send_signal(sig)
        sent = True
    else:
        sent = False
    _out, err = proc.communicate(timeout=120)
    runs = list((root / "fastmoe").iterdir()) if (root / "fastmoe").is_dir() else []
    assert "Traceback" not in err, err
    if sent and proc.returncode == -sig:
        # The signal came before the interpreter ran moebench's first line (Python's own start-up,
        # ~50 ms): its default action applies. Nothing can have been created yet.
        assert not root.exists(), (offset, sig)
        return
    if sent and proc.returncode != 0:
        assert proc.returncode == 130, (offset, sig, proc.returncode, err)
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] != "running", (offset, sig, summary)
        metrics = run / "metrics.jsonl"
        lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if proc.returncode == 130:  # the exit code and summary.json agree (signals.py)
            assert summary["status"] == "interrupted", (offset, summary["status"], len(lines))
        else:
            assert (proc.returncode, summary["status"], len(lines)) == (0, "ok", 60), (offset, proc.returncode)
        if summary["status"] == "interrupted":  # the console names the folder it marked
            assert f"\nresults: {run}\n" in err, (offset, sig, err)
    if proc.returncode == 130 and not runs:
        assert not root.exists() or not any(root.rglob("*.json"))  # before the folder: nothing
    time.sleep(0.2)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def _offsets(lifetime: float, count: int) -> list[float]:
    return [0.05 + i * (lifetime * 1.02 - 0.05) / (count - 1) for i in range(count)]


@pytest.mark.parametrize("ranks,count", [(1, 5), pytest.param(2, 3, marks=pytest.mark.multirank)])
def test_signals_across_a_runs_lifetime(tmp_path, ranks, count):
    lifetime = _lifetime(tmp_path, ranks)
    for i, offset in enumerate(_offsets(lifetime, count)):
        for sig in (signal.SIGINT, signal.SIGTERM):
            _signal_at(tmp_path / f"{i}-{sig}", ranks, offset, sig)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_signal_sweep_20_offsets(tmp_path, ranks):
    lifetime = _lifetime(tmp_path, ranks)
    for i, offset in enumerate(_offsets(lifetime, 20)):
        for sig in (signal.SIGINT, signal.SIGTERM):
            _signal_at(tmp_path / f"{i}-{sig}", ranks, offset, sig)
