"""A run on a shared CPU: the thread count fixed whatever the load (the numbers depend on it), the warning a
timed run carries when the machine was busy, and the progress bar's figure (issue 18, item 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moebench import contention, loop
from moebench.cli.app import app


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_a_one_process_run_takes_every_usable_core_whatever_the_load(cores):
    assert contention.threads_for(cores) == cores


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
    monkeypatch.setattr("moebench.rankenv.usable_cores", lambda: 2)
    result = CliRunner().invoke(app, ["run", "fastmoe", "--steps", "3", "--moe-impl", "reference",
                                      "--results-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (run,) = (tmp_path / "fastmoe").iterdir()
    return result.output, json.loads((run / "summary.json").read_text())


def test_a_busy_machine_is_warned_in_the_console_and_summary(monkeypatch, tmp_path):
    out, summary = _run(monkeypatch, tmp_path, others_cores=1.0)
    machine = summary["machine"]
    assert machine["others_cores"] == 1.0 and machine["threads"] == 2  # the load changes the time, not the numbers
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

    monkeypatch.setattr(loop, "_progress", FakeProgress)
    writer = results.RunDir.create("fastmoe", "t", tmp_path)
    times = iter([0.01, 0.02, 0.03, 0.01, 0.02, 0.05])

    def step(s):
        import time

        time.sleep(next(times))
        return {"loss": 1.0}

    history = loop.train_loop(step, loop.LoopSpec(total_steps=6, steps_per_epoch=6, tokens_per_step=100),
                              writer=writer)
    assert shown[-1] == history["tokens_per_s_steady"]


def _bench_row(layer, experts, tokens_per_s, vs_ideal=None, vs_ds=None, repeats=3, spread=0.1):
    time_s = 1024 / tokens_per_s
    return {"layer": layer, "experts": experts, "tokens": 1024, "top_k": 2, "skipped": None,
            "tokens_per_s": tokens_per_s, "gflops": 1.0, "vs_ideal": vs_ideal, "vs_dense": None,
            "vs_deepspeed_cf1": vs_ds, "peak_rss_mb": 100.0, "time_s": time_s, "repeats": repeats,
            "min_s": time_s, "max_s": time_s * (1 + spread if repeats > 1 else 1)}


def test_a_target_is_not_judged_against_an_implausible_baseline():
    """bench --quick beside a busy process: ideal at 703 tok/s against dense's 23,251 made
    "x ideal >= 0.95: 1.03 .. 21.49 met"."""
    from moebench.bench import core

    rows = [_bench_row("dense", 16, 23251.0), _bench_row("ideal", 16, 703.0), _bench_row("ideal", 64, 20000.0),
            _bench_row("dense", 64, 21000.0), _bench_row("reference", 16, 15000.0, vs_ideal=21.49),
            _bench_row("reference", 64, 19000.0, vs_ideal=1.03)]
    t = core.targets(rows)
    assert t["vs_ideal"]["met"] is None and t["flat"]["met"] is None
    text = core.format_targets(t)
    assert "x ideal >= 0.95: 1.03 .. 21.49 not judged: noisy baseline" in text
    assert "ideal E=16 T=1024 k=2: 703 tok/s vs dense 23,251" in text and " met" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    # the same sweep with a plausible ideal is judged
    rows[1] = _bench_row("ideal", 16, 22000.0)
    assert core.targets(rows)["vs_ideal"]["met"] is True


def test_one_repeat_shows_no_spread_and_the_report_says_one_timing(tmp_path):
    from moebench.bench.output import format_table
    from moebench.report.sections.bench import _timing_words

    one = {"rows": [_bench_row("ideal", 4, 1000.0, repeats=1)], "breakdown": [], "threads": 2, "torch": "x"}
    three = {**one, "rows": [_bench_row("ideal", 4, 1000.0, repeats=3, spread=0.25)]}
    assert format_table(one).splitlines()[1].split()[-2] == "—"
    assert format_table(three).splitlines()[1].split()[-2] == "25"
    assert _timing_words(one["rows"]).startswith("one timing per layer and point (a single repeat")
    assert _timing_words(three["rows"]) == "median of 3 interleaved repeats"
