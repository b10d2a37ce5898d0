"""Sizes that cannot fit, and inputs that cannot be read, are refused before anything is created:
the memory estimate names the flag that dominates, `--force` overrides it, local ranks are capped,
and a FIFO given as --ds-config is refused instead of read (it would block forever)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from moebench import resources
from moebench.cli.app import app

pytestmark = pytest.mark.faults
runner = CliRunner()

TOO_BIG = [
    (["run", "fastmoe", "--experts", "100000"], "--experts", "parameters"),
    (["run", "fastmoe", "--d-model", "1000000"], "--d-model", "parameters"),
    (["run", "fastmoe", "--batch-size", "100000000", "--samples", "100000000"], "--batch-size", "activations"),
    (["run", "deepspeed", "--experts", "100000"], "--experts", "parameters"),
    (["run", "deepspeed", "--d-model", "1000000"], "--d-model", "parameters"),
    (["run", "deepspeed", "--batch-size", "100000000", "--samples", "100000000"], "--batch-size", "activations"),
]


@pytest.mark.parametrize("args,flag,part", TOO_BIG, ids=[" ".join(a[1:]) for a, _, _ in TOO_BIG])
def test_a_run_that_cannot_fit_is_refused_before_anything_exists(tmp_path, args, flag, part):
    root = tmp_path / "results"
    result = runner.invoke(app, [*args, "--results-dir", str(root)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}: this run needs ~"), result.output
    assert f"({part} " in lines[0] and "add --force" in lines[0]
    assert lines[0].count(flag) == 2, lines[0]  # "error: FLAG:" and "lower FLAG", never listed again
    assert not root.exists()


def test_force_runs_what_the_estimate_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "available_bytes", lambda: 1024**2)  # 1 MiB: every run is "too big"
    root = tmp_path / "results"
    refused = runner.invoke(app, ["run", "fastmoe", "--preset", "quick", "--steps", "2", "--results-dir", str(root)])
    assert refused.exit_code == 2 and "add --force" in refused.output, refused.output
    assert not root.exists()
    forced = runner.invoke(app, ["run", "fastmoe", "--preset", "quick", "--steps", "2", "--force",
                                 "--results-dir", str(root)])
    assert forced.exit_code == 0, forced.output
    assert len(list((root / "fastmoe").iterdir())) == 1


def test_the_estimate_counts_every_local_rank():
    from helpers import make_config

    one = resources.estimate(make_config("fastmoe", world_size=1))
    four = resources.estimate(make_config("fastmoe", world_size=4))
    assert four["local_ranks"] == 4 and four["processes"] == 4 * one["processes"]
    assert four["total"] > 3 * one["total"]  # every local rank is a whole process holding the data


@pytest.mark.parametrize("ranks", ["10000", "65"])
def test_local_ranks_are_capped_before_any_rank_starts(tmp_path, ranks):
    root = tmp_path / "results"
    result = runner.invoke(app, ["run", "fastmoe", "--world-size", ranks, "--experts", "10000",
                                 "--batch-size", "10000", "--samples", "10000", "--results-dir", str(root)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --world-size: must be at most 64 (local ranks"), result.output
    assert not root.exists()


def test_a_fifo_as_ds_config_is_refused_not_read(tmp_path):
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)  # reading it would block until a writer came: forever
    root = tmp_path / "results"
    result = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--ds-config", str(fifo),
                                 "--results-dir", str(root)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --ds-config: {fifo} is not a regular file; give a DeepSpeed JSON file"
    assert not root.exists()
