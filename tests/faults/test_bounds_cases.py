"""The cases issues 20 (item 1, 3) and 18 (item 9) quoted, each refused before anything starts:
numbers with no upper bound, work that cannot end, names and paths the OS would choke on, an --impl
that is not an implementation, an explicit flag dropped by a preset (bench --quick)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app

pytestmark = pytest.mark.faults
runner = CliRunner()


class ReachedWork(Exception):
    """The command got past its checks to where work starts."""


@pytest.fixture
def work(tmp_path, monkeypatch):
    """cwd and results root in an empty folder; every step that works or writes is a tripwire."""
    from moebench import results, train
    from moebench.bench import core
    from moebench.parity import runner as parity_runner

    def trip(*args, **kwargs):
        raise ReachedWork("reached work")

    for owner, name in ((results.RunDir, "create"), (train, "run_variant"), (core, "run_bench"),
                        (parity_runner, "verify_parity")):
        monkeypatch.setattr(owner, name, trip)
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("MOEBENCH_RESULTS", str(folder / "results"))
    return folder


REFUSED = [
    ("verify-parity -n 2 --checks all-gather-variable --timeout 1e10", "--timeout", "at most 604800"),
    ("run fastmoe -n 2 --steps 2 --timeout 1e10", "--timeout", "at most 604800"),
    ("verify-parity --timeout 1e308", "--timeout", "at most 604800"),
    ("run deepspeed --timeout 1e308", "--timeout", "at most 604800"),
    ("bench --timeout 1e10", "--timeout", "at most 604800"),
    ("env-check --probe-timeout 1e308", "--probe-timeout", "at most 3600"),
    ("bench --experts 1000000 --tokens 1024 --layers reference --ep-layers none --repeats 1", "--experts", "GiB"),
    ("bench --d-model 100000000 --layers reference --ep-layers none", "--d-model", "at most"),
    ("bench --quick --experts 1000000", "--experts", "GiB"),
    ("bench --quick --d-model 100000000", "--d-model", "at most"),
    ("bench --quick --world-size 0", "--world-size", "from 1 to 64"),
    ("bench --quick -n 99", "-n/--world-size", "at most 64"),
    ("run fastmoe --steps 99999999999999999999999", "--steps", "at most 1000000000"),
    ("run fastmoe --steps 1000000000000", "--steps", "at most 1000000000"),
    ("run fastmoe --steps 999999999", "--steps", "takes >= "),
    ("run fastmoe --steps 999999999 --show-config", "--steps", "takes >= "),
    ("run fastmoe --steps 99999999999999999999999 --show-config", "--steps", "at most"),
    ("run deepspeed --preset quick --steps 99999999999999999999999", "--steps", "at most"),
    ("run deepspeed --preset quick --epochs 99999999999999999999999", "--epochs", "at most"),
    ("run deepspeed --preset quick --epochs 1000000 --samples 2000000000", "--epochs", "steps is over"),
    ("run fastmoe --samples 2000000000 --batch-size 1", "--samples", "steps is over"),
    ("run fastmoe --seq-len 100000000", "--seq-len", "at most"),
    ("run fastmoe --seq-len 1000000", "--seq-len", "GiB"),
    ("run fastmoe --preset " + "p" * 5000, "--preset", "at most 64 characters"),
    ("runs --results-dir /tmp/" + "r" * 5000, "--results-dir", "PATH_MAX"),
    ("runs --results-dir /tmp/" + "r" * 300, "--results-dir", "NAME_MAX"),
    ("verify-parity -n 2 --checks experts --impl experts=os:sep", "--impl", "'os:sep' is a str, not callable"),
    ("verify-parity -n 2 --checks experts --impl experts=os:getcwd", "--impl", "not a class"),
    ("verify-parity -n 2 --checks all-gather-variable --impl all-gather=os:getpid", "--impl", "cannot be called"),
    ("--version extra", "--version", "no other argument"),
]


@pytest.mark.parametrize("line,flag,words", REFUSED, ids=[r[0][:60] for r in REFUSED])
def test_quoted_case_is_refused_before_anything_starts(work, line, flag, words):
    result = runner.invoke(app, line.split())
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}: ") and words in lines[0], result.output
    assert "--samples" not in lines[0] or flag == "--samples", lines[0]  # the flag that caused it, not another
    assert os.listdir(work) == []


def test_bench_quick_keeps_an_explicit_flag(work, monkeypatch):
    """--quick fills what was not given: `--world-size 3` runs 3 ranks, `--experts 8` 8 experts."""
    from moebench.bench import core

    seen = {}

    def capture(spec, results_dir, *, name, log=None):
        seen["spec"] = spec
        return {"run_path": "x"}

    monkeypatch.setattr(core, "run_bench", capture)
    monkeypatch.setattr(core, "format_summary", lambda summary: "")
    result = runner.invoke(app, ["bench", "--quick", "--world-size", "3", "--experts", "8"])
    assert result.exit_code == 0, result.output
    spec = seen["spec"]
    assert spec.world_sizes == [3] and {p.experts for p in spec.points} == {8}
    assert {p.tokens for p in spec.points} == {1024} and spec.repeats == 1  # the rest stays quick


def test_force_passes_the_work_estimate(work):
    from moebench import resources

    with pytest.raises(Exception, match="--steps"):
        resources.require_work(resources.MAX_WORK_S * 2)
    assert resources.require_work(resources.MAX_WORK_S * 2, force=True) == resources.MAX_WORK_S * 2


def test_the_chapter_presets_are_far_inside_the_work_bound():
    """The bound refuses only what cannot end: the chapter runs are minutes by the estimate."""
    from moebench import resources, variants

    for variant in variants.VARIANTS:
        config = variants.resolve_config(variant, "chapter", {})
        assert resources.work_seconds(config) < 3600, variant.name


def test_the_python_api_goes_through_the_same_bounds():
    from moebench import variants
    from moebench.errors import UserError

    fastmoe = variants.VARIANTS[0]
    with pytest.raises(UserError, match="--timeout: must be at most 604800"):
        variants.resolve_config(fastmoe, "quick", {("launch", "timeout_s"): 1e10})
    with pytest.raises(UserError, match="--steps: must be at most"):
        variants.resolve_config(fastmoe, "quick", {("train", "steps"): 10**23})


def test_verify_parity_refuses_more_ranks_than_memory_holds(work, monkeypatch):
    from moebench import resources

    monkeypatch.setattr(resources, "available_bytes", lambda: 3 * resources.PROCESS_BYTES)
    result = runner.invoke(app, ["verify-parity", "-n", "4", "--checks", "experts"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: -n/--world-size: 4 local ranks need ~"), result.output
    assert os.listdir(work) == []
