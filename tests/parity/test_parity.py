"""verify-parity: the comparison record, the registry, and the CLI's handling of input (fast)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import warmcli
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.errors import UserError
from moebench.parity import registry
from moebench.parity.compare import SEED_EXPERTS_GRAD, STRICT, Tolerance, compare
from moebench.parity.printed import failed_only

runner = CliRunner()

EXPECTED_CHECKS = ["ddp-adam", "ddp-sgd", "replicate-state-dict", "replicate-train", "replicate-ignored",
                   "replicate-bad-device-id", "all-gather-variable", "experts", "moe-expert-parallel"]


# ------------------------------------------------------------------ compare


def test_compare_passes_within_and_fails_outside_tolerance():
    expected = torch.tensor([1.0, -2.0, 3.0])
    assert compare("x", expected * (1 + 1e-7), expected, STRICT).passed
    c = compare("x", expected * 1.01, expected, STRICT)
    assert not c.passed
    assert c.max_abs_diff == pytest.approx(0.03, rel=1e-6)
    assert c.max_rel_diff == pytest.approx(0.01, rel=1e-6)
    assert c.magnitude == 3.0 and c.atol == pytest.approx(3e-5) and not c.vacuous


def test_seed_gradient_tolerance_is_vacuous_on_small_gradients_and_passes_zeros():
    grad = torch.full((4, 4), 3e-3)  # assert.py's gradients are this small
    zero = compare("grad", torch.zeros_like(grad), grad, SEED_EXPERTS_GRAD)
    assert zero.passed and zero.vacuous, "an all-zero gradient passes atol 1e-2: the record must say vacuous"
    strict_zero = compare("grad", torch.zeros_like(grad), grad, STRICT)
    assert not strict_zero.passed and not strict_zero.vacuous


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_never_pass(bad):
    expected = torch.tensor([1.0, bad])
    for tol in (STRICT, Tolerance(rtol=1e9, atol_abs=1e9)):
        c = compare("x", expected.clone(), expected, tol)
        assert not c.passed and not c.finite


def test_shape_mismatch_fails_and_differ_kind_inverts():
    assert not compare("x", torch.zeros(2), torch.zeros(3), STRICT).passed
    assert compare("x", torch.ones(2), torch.zeros(2), STRICT, expect_equal=False).passed
    assert not compare("x", torch.ones(2), torch.ones(2), STRICT, expect_equal=False).passed


def test_all_zero_comparison_is_vacuous_even_when_exact():
    assert compare("x", torch.zeros(3), torch.zeros(3), STRICT).vacuous


# ------------------------------------------------------------------ registry


def test_registry_holds_the_issue_checks_in_order():
    names = [c.name for c in registry.all_checks()]
    assert [n for n in names if n in EXPECTED_CHECKS] == EXPECTED_CHECKS
    for check in registry.all_checks():
        assert check.seed_source and check.description and callable(check.rank_fn)


def test_a_broken_check_module_never_breaks_list(monkeypatch, tmp_path):
    (tmp_path / "parity_check_that_raises.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = registry.CHECK_MODULES + ("parity_check_that_raises", "parity_check_that_does_not_exist")
    monkeypatch.setattr(registry, "CHECK_MODULES", modules)
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "IMPORT_ERRORS", {})
    result = runner.invoke(app, ["verify-parity", "--list", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [c["name"] for c in doc["checks"] if c["name"] in EXPECTED_CHECKS] == EXPECTED_CHECKS
    assert "broken on import" in doc["import_errors"]["parity_check_that_raises"]
    assert "parity_check_that_does_not_exist" not in doc["import_errors"]  # absent: silently skipped


def test_select_and_parse_impls_reject_bad_input():
    with pytest.raises(UserError, match="--checks"):
        registry.select(["nope"])
    for spec in ("experts", "bogus=os:path", "experts=no.such.module:X", "experts=os:NoSuchThing"):
        with pytest.raises(UserError, match="--impl"):
            registry.parse_impls([spec])
    assert registry.parse_impls(["all-gather=moebench.distributed.collectives:all_gather_variable"])
    with pytest.raises(UserError, match="--impl: all-gather is given twice"):
        registry.parse_impls(["all-gather=moebench.distributed.collectives:all_gather_variable"] * 2)


def test_an_impl_no_selected_check_uses_is_rejected():
    from moebench.parity.runner import ParityConfig

    impls = {"experts": "os:path"}
    with pytest.raises(UserError, match=r"--impl: no selected check uses experts \(used by: experts\)"):
        ParityConfig(world_size=2, checks=("ddp-sgd", "ddp-adam"), impls=impls)
    assert ParityConfig(world_size=2, checks=("ddp-sgd", "experts"), impls=impls).impls == impls
    assert ParityConfig(world_size=2, impls=impls).impls == impls  # all checks: experts is among them


# ------------------------------------------------------------------ CLI input errors


@pytest.mark.parametrize("args,flag", [
    (["--checks", "ddp-adam,nope"], "--checks"),
    (["--world-size", "0"], "--world-size"),
    (["--impl", "experts=no_such_pkg.mod:Experts"], "--impl"),
    (["--impl", "experts"], "--impl"),
    # an --impl no selected check uses, and a key given twice, would each be silently ignored
    (["--impl", "experts=moebench.distributed.expert_parallel:dispatch", "--checks", "ddp-sgd"], "--impl"),
    (["--impl", "all-gather=moebench.distributed.collectives:all_gather_variable",
      "--impl", "all-gather=moebench.distributed.collectives:all_gather_variable"], "--impl"),
    (["--tolerance", "loose"], "--tolerance"),
    (["--timeout", "0"], "--timeout"),
    (["--comm-backend", "mpi"], "--comm-backend"),
    (["--checks", ""], "--checks"),
    (["--checks", ",,"], "--checks"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**63)], "--seed"),
    (["--seed", str(2**70)], "--seed"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, args, flag):
    monkeypatch.setenv("MOEBENCH_RESULTS", str(tmp_path / "results"))
    result = runner.invoke(app, ["verify-parity", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_list_prints_every_check(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_RESULTS", str(tmp_path / "results"))
    result = runner.invoke(app, ["verify-parity", "--list"])
    assert result.exit_code == 0
    for name in EXPECTED_CHECKS:
        assert name in result.output
    assert not (tmp_path / "results").exists()


@pytest.mark.multirank
def test_json_output_is_the_saved_summary(tmp_path):
    result = runner.invoke(app, ["verify-parity", "--world-size", "2", "--checks", "all-gather-variable,ddp-sgd",
                                 "--json", "--results-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "ok" and doc["counts"] == {"pass": 2, "fail": 0, "skip": 0}
    saved = json.loads((tmp_path / "parity" / doc["run_id"] / "summary.json").read_text())
    assert failed_only(saved) == doc  # --json prints each check's failed comparisons; the file keeps them all
    assert all(c["comparisons"] for c in saved["checks"]) and not any(c["comparisons"] for c in doc["checks"])
    for check in doc["checks"]:
        assert check["comparisons_total"] > 0 and check["max_abs_diff"] is not None
        assert check["rtol"] is not None and check["magnitude"] > 0 and not math.isnan(check["elapsed_s"])


def test_cpu_only_checks_run_on_gloo_where_auto_would_pick_nccl(monkeypatch):
    from moebench.distributed.launch import LaunchResult
    from moebench.parity import runner

    seen = {}

    def fake_launch(fn, world_size, *, args, backend, timeout_s, label, env):
        seen[args[0]] = backend
        ok = compare("x", torch.ones(2), torch.ones(2), STRICT).to_dict()
        return LaunchResult(status="ok", world_size=world_size, backend=backend,
                            returns=[{"comparisons": [ok]}] * world_size, errors={}, stacks={},
                            stuck_ranks=[], elapsed_s=0.0)

    monkeypatch.setattr(runner, "resolve_backend", lambda backend, world_size: "nccl")
    monkeypatch.setattr(runner, "launch", fake_launch)
    summary = runner.run_checks(runner.ParityConfig(world_size=2, checks=("ddp-sgd", "experts")))
    assert seen == {"ddp-sgd": "gloo", "experts": "gloo"}
    assert [c["backend"] for c in summary["checks"]] == ["gloo", "gloo"]


@pytest.mark.parametrize("where", ["file", "under-a-file", "parity-is-a-file"])
def test_a_results_dir_that_is_not_a_folder_is_exit_2(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "parity").write_text("x")
    target = {"file": tmp_path / "afile", "under-a-file": tmp_path / "afile" / "results",
              "parity-is-a-file": tmp_path / "root"}[where]
    result = runner.invoke(app, ["verify-parity", "-n", "1", "--checks", "ddp-sgd", "--results-dir", str(target)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --results-dir:"), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "root"]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["parity"]


def test_a_run_where_every_check_skipped_fails_with_no_check_ran(tmp_path):
    result = runner.invoke(app, ["verify-parity", "-n", "1", "--checks", "replicate-ignored",
                                 "--results-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "no check ran: all 1 selected check(s) were skipped: replicate-ignored (needs world size >= 2)" \
        in result.output
    (run,) = (tmp_path / "parity").iterdir()
    saved = json.loads((run / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["reason"].startswith("no check ran")


def _fake_launch(seen):
    from moebench.distributed.launch import LaunchResult

    def fake_launch(fn, world_size, *, args, backend, timeout_s, label, env):
        seen[args[0]] = (backend, args[1], timeout_s)
        ok = compare("x", torch.ones(2), torch.ones(2), STRICT).to_dict()
        return LaunchResult(status="ok", world_size=world_size, backend=backend,
                            returns=[{"comparisons": [ok]}] * world_size, errors={}, stacks={},
                            stuck_ranks=[], elapsed_s=0.0)

    return fake_launch


def test_sigterm_outside_a_launch_records_interrupted(tmp_path, monkeypatch):
    """SIGTERM while the parent preloads a check's modules (no launch running): exit 130, the
    saved status is "interrupted" (not "running"), and the previous SIGTERM handler is back."""
    from moebench import preload

    def sigterm_during_import(name):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises KeyboardInterrupt in here
        raise AssertionError("SIGTERM did not interrupt the preload")

    monkeypatch.setattr(preload, "importlib", types.SimpleNamespace(import_module=sigterm_during_import))
    before = signal.getsignal(signal.SIGTERM)
    result = runner.invoke(app, ["verify-parity", "-n", "2", "--checks", "ddp-sgd", "--results-dir", str(tmp_path)])
    assert result.exit_code == 130, result.output
    assert signal.getsignal(signal.SIGTERM) is before
    (run,) = (tmp_path / "parity").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


def test_an_unexpected_error_records_failed_and_propagates(tmp_path, monkeypatch):
    from moebench.parity import runner as parity_runner

    def broken_launch(*args, **kwargs):
        raise RuntimeError("launcher bug")

    monkeypatch.setattr(parity_runner, "launch", broken_launch)
    result = runner.invoke(app, ["verify-parity", "-n", "2", "--checks", "all-gather-variable",
                                 "--results-dir", str(tmp_path)])
    assert isinstance(result.exception, RuntimeError)
    (run,) = (tmp_path / "parity").iterdir()
    saved = json.loads((run / "summary.json").read_text())
    assert saved["status"] == "failed" and "launcher bug" in saved["reason"]


def test_under_torchrun_auto_resolves_once_on_the_local_world_and_cpu_checks_still_run(monkeypatch):
    """A torchrun job on a GPU node: "auto" is resolved with LOCAL_WORLD_SIZE (as launch does),
    every check gets that one concrete backend - a group carrying gloo for CPU tensors - and none
    is skipped for being CPU-only."""
    from moebench.parity import runner as parity_runner

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    asked = []
    monkeypatch.setattr(parity_runner, "resolve_backend", lambda b, n: asked.append((b, n)) or "nccl")
    seen = {}
    monkeypatch.setattr(parity_runner, "launch", _fake_launch(seen))
    summary = parity_runner.run_checks(parity_runner.ParityConfig(checks=("ddp-sgd", "experts"), timeout_s=33))
    assert asked == [("auto", 2)]
    assert {name: backend for name, (backend, _, _) in seen.items()} == \
        {"ddp-sgd": "cpu:gloo,cuda:nccl", "experts": "cpu:gloo,cuda:nccl"}
    assert summary["counts"]["pass"] == 2 and summary["world_size"] == 4


def test_the_check_deadline_reaches_the_ranks(monkeypatch):
    from moebench.parity import runner as parity_runner

    seen = {}
    monkeypatch.setattr(parity_runner, "launch", _fake_launch(seen))
    parity_runner.run_checks(parity_runner.ParityConfig(world_size=2, checks=("all-gather-variable",), timeout_s=25))
    backend, opts, timeout_s = seen["all-gather-variable"]
    assert backend == "gloo" and timeout_s == 25 and opts.timeout_s == 25


def test_deepspeed_check_groups_time_out_before_the_deadline():
    from torch.distributed import distributed_c10d as c10d

    from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after

    default = c10d._get_default_timeout(c10d.Backend("gloo"))
    with new_groups_time_out_after(group_timeout_s(20)):
        # what DeepSpeed's dist.new_group(ranks) gets: 0.75 x the deadline, not 30 minutes
        assert c10d._get_default_timeout(c10d.Backend("gloo")).total_seconds() == 15
    assert c10d._get_default_timeout(c10d.Backend("gloo")) == default


def test_env_check_never_reports_more_ranks_than_verify_parity_accepts():
    from moebench.envcheck import capabilities
    from moebench.parity.registry import MAX_WORLD_SIZE

    rows = {"platform.memory": {"available_bytes": 10**15}, "platform.cpu": {"cores_usable": 2}}

    def lookup(key):
        if key == "comm.gloo":
            return types.SimpleNamespace(status="ok", data={})
        return types.SimpleNamespace(status="ok", data=rows[key]) if key in rows else None

    check = capabilities._verify_parity(lookup)
    assert check.data["gloo_max_local_world_size"] == MAX_WORLD_SIZE
    assert f"gloo up to {MAX_WORLD_SIZE} local ranks" in check.found


@pytest.mark.multirank
def test_json_stdout_is_one_document_with_every_default_check(tmp_path):
    """All checks, DeepSpeed's included (it prints warnings on stdout when imported): stdout is
    exactly one JSON document; the chatter goes to stderr."""
    env = dict(os.environ, MOEBENCH_RESULTS=str(tmp_path))
    proc = warmcli.run(["verify-parity", "-n", "2", "--json"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    names = [c["name"] for c in doc["checks"]]
    assert "deepspeed-moe-ep" in names and doc["counts"]["fail"] == 0
    saved = json.loads((Path(doc["run_path"]) / "summary.json").read_text())
    assert failed_only(saved) == doc and doc["schema"] == "moebench.summary/1" and doc["wall_time_s"] > 0
