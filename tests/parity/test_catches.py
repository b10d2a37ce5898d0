"""Every parity check says in one line what bug it would catch, and summary.json records it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.parity import registry
from moebench.parity.compare import STRICT, compare

cli = CliRunner()

MAX_CATCHES_CHARS = 119


def test_every_registered_check_says_what_it_catches():
    checks = registry.all_checks()
    assert checks and not registry.IMPORT_ERRORS
    for check in checks:
        catches = check.catches
        assert isinstance(catches, str) and catches.strip(), f"{check.name}: empty catches"
        assert len(catches) <= MAX_CATCHES_CHARS, f"{check.name}: {len(catches)} chars"
        assert "\n" not in catches and catches == catches.strip(), f"{check.name}: not one clean line"
        assert catches != check.description, f"{check.name}: catches repeats the description"
    lines = [c.catches for c in checks]
    assert len(set(lines)) == len(lines), "two checks claim the very same catch"


@pytest.mark.multirank
def test_a_passing_check_records_its_catches_in_summary_json(tmp_path):
    result = cli.invoke(app, ["verify-parity", "-n", "2", "--checks", "ddp-sgd", "--json",
                              "--results-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    saved = json.loads((tmp_path / "parity" / doc["run_id"] / "summary.json").read_text())
    (record,) = saved["checks"]
    assert record["name"] == "ddp-sgd" and record["status"] == "pass"
    assert record["catches"] == registry.load_all()["ddp-sgd"].catches


def test_a_skipped_check_records_its_catches_in_summary_json(tmp_path):
    result = cli.invoke(app, ["verify-parity", "-n", "1", "--checks", "replicate-ignored",
                              "--results-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output  # every check skipped: "no check ran"
    (run,) = (tmp_path / "parity").iterdir()
    (record,) = json.loads((run / "summary.json").read_text())["checks"]
    assert record["status"] == "skip"
    assert record["catches"] == registry.load_all()["replicate-ignored"].catches


def test_a_failed_check_records_its_catches(monkeypatch):
    """No ranks: a fake launch returns one failed comparison (and a crashed launch, the other fail path)."""
    from moebench.distributed.launch import LaunchResult
    from moebench.parity import runner

    def fake_launch(fn, world_size, *, args, backend, timeout_s, label, env):
        if args[0] == "ddp-adam":
            return LaunchResult(status="failed", world_size=world_size, backend=backend, returns=[None] * world_size,
                                errors={0: "RuntimeError: boom"}, stacks={}, stuck_ranks=[], elapsed_s=0.0)
        bad = compare("x", torch.ones(2), torch.zeros(2) + 2, STRICT).to_dict()
        return LaunchResult(status="ok", world_size=world_size, backend=backend,
                            returns=[{"comparisons": [bad]}] * world_size, errors={}, stacks={},
                            stuck_ranks=[], elapsed_s=0.0)

    monkeypatch.setattr(runner, "launch", fake_launch)
    summary = runner.run_checks(runner.ParityConfig(world_size=2, checks=("ddp-adam", "ddp-sgd")))
    checks = registry.load_all()
    assert [c["status"] for c in summary["checks"]] == ["fail", "fail"]
    for record in summary["checks"]:
        assert record["catches"] == checks[record["name"]].catches
