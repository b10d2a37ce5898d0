"""A run on a shared CPU: the thread policy chosen from what other processes use, the warning a
timed run carries when the machine was busy, and the progress bar's figure (issue 18, item 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moebench import contention, train
from moebench.cli.app import app


@pytest.mark.parametrize("cores, others, threads", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 3.0, 1), (8, 2.0, 6), (1, 0.0, 1),
])
def test_threads_are_the_cores_nobody_else_uses(cores, others, threads):
    assert contention.threads_for(cores, others) == threads


def _fake_sampler(others_cores: float, steal_pct: float = 0.0):
    """contention.sample as if other processes kept `others_cores` cores busy all along."""
    clock = {"t": 0.0}

    def sample():
        clock["t"] += 1.0
        t = clock["t"]
        return contention.CpuSample(wall_s=t, busy_s=others_cores * t, steal_s=steal_pct / 100 * 2 * t,
                                    total_s=2 * t, own_s=0.0, load1=1.0 + others_cores)
    return sample


def _run(monkeypatch, tmp_path, others_cores: float):
    monkeypatch.setattr(contention, "sample", _fake_sampler(others_cores))
    monkeypatch.setattr(contention, "BUSY_SAMPLE_S", 0.0)
    monkeypatch.setattr("moebench.distributed.env.usable_cores", lambda: 2)
    result = CliRunner().invoke(app, ["run", "fastmoe", "--steps", "3", "--moe-impl", "reference",
                                      "--results-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (run,) = (tmp_path / "fastmoe").iterdir()
    return result.output, json.loads((run / "summary.json").read_text())


def test_a_busy_machine_is_warned_in_the_console_and_summary(monkeypatch, tmp_path):
    out, summary = _run(monkeypatch, tmp_path, others_cores=1.0)
    machine = summary["machine"]
    assert machine["others_cores"] == 1.0 and machine["threads"] == 1  # one core taken: one thread
    assert machine["warning"].startswith("machine busy during the timed run: other processes kept 1.0 of 2")
    assert "warning: machine busy during the timed run" in " ".join(out.split())


def test_a_quiet_machine_has_no_warning_and_every_core(monkeypatch, tmp_path):
    out, summary = _run(monkeypatch, tmp_path, others_cores=0.0)
    assert summary["machine"]["warning"] is None and summary["machine"]["threads"] == 2
    assert "machine busy" not in out


def test_high_steal_time_is_warned():
    sample = _fake_sampler(0.0, steal_pct=25.0)
    machine = contention.others_between(sample(), sample())
    assert "25 % of CPU time was stolen" in contention.busy_warning(machine, 2)


def test_the_progress_bar_shows_the_summarys_steady_figure(monkeypatch, tmp_path):
    from moebench import results

    shown = []

    class FakeProgress:
        def add_task(self, *a, **kw):
            return 0

        def update(self, task, **fields):
            shown.append(fields["tps"])

        start = stop = lambda self: None

    monkeypatch.setattr(train, "_progress", FakeProgress)
    writer = results.RunDir.create("fastmoe", "t", tmp_path)
    times = iter([0.01, 0.02, 0.03, 0.01, 0.02, 0.05])

    def step(s):
        import time

        time.sleep(next(times))
        return {"loss": 1.0}

    history = train.train_loop(step, train.LoopSpec(total_steps=6, steps_per_epoch=6, tokens_per_step=100),
                               writer=writer)
    assert shown[-1] == history["tokens_per_s_steady"]
