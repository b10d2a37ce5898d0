"""DeepSpeed resume rows (issue 23): save -> load into a fresh engine -> continue, compared per global
expert; injected checkpoint bugs (tests/faults/ds_resume_faults.py) are caught and named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from moebench.libraries import deepspeed as ds_adapter  # noqa: E402
from moebench.libraries.deepspeed import resume as ds_resume  # noqa: E402
from moebench.libraries.deepspeed import state as ds_state  # noqa: E402
from moebench.libraries.matrix import verify_libraries  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
import ds_resume_faults  # noqa: E402

FIELDS = dict(timeout_s=120.0, comm_backend="gloo", tolerance="strict", impls={}, debug_collectives=False)


def _rows(world: int, *keys: str):
    rows = {r.key(): r for r in ds_resume.resume_rows(world)}
    return [rows[k] for k in keys]


def _run(monkeypatch, tmp_path, rows, *, fault: str | None = None, seed: int = 0) -> dict:
    """The rows through the real runner (forked gloo ranks), with `fault` patched into DeepSpeed."""
    if fault:
        ds_resume_faults.FAULTS[fault](monkeypatch.setattr)
    return verify_libraries([ds_adapter.ADAPTER], (rows[0].world_size,), config_fields={**FIELDS, "seed": seed},
                            results_dir=str(tmp_path / "results"), resume=True, patterns=tuple(r.key() for r in rows))


def _restore_diagnosis(check: dict) -> dict:
    """The restore diagnosis of the row (carried by its failed after-the-load comparisons)."""
    failed = [c for c in check["comparisons"] if not c["passed"] and c["name"].startswith("after the load")]
    assert failed, check["reason"]
    return failed[0]["diagnosis"]


def test_rows_cover_the_matrix_with_unique_keys_and_json_params():
    rows = ds_resume.resume_rows(4)
    assert len({r.key() for r in rows}) == len(rows)
    params = [r.settings.fields() for r in rows]
    assert {p["zero_stage"] for p in params} == {0, 1, 2} and {p["ep_size"] for p in params} == {1, 2, 4}
    assert all(isinstance(v, (int, float, str, bool)) for p in params for v in p.values())
    features = {f for r in rows for f in r.features}
    assert features == {"resume", "elastic", "universal", "data-before-expert", "no-optimizer-state"}
    cross = [p for p in params if "load_ep_size" in p]
    assert all(p["load_ep_size"] != p["ep_size"] for p in cross) and cross
    assert ds_resume.resume_rows(1) == []
    assert ds_adapter.ADAPTER.rows(4) == ds_adapter.ADAPTER.rows(4, resume=False)
    assert len(ds_adapter.ADAPTER.rows(4, resume=True)) == len(ds_adapter.ADAPTER.rows(4)) + len(rows)


def test_refusal_says_whether_the_message_names_the_real_cause():
    spec = ds_resume.Spec(zero_stage=1, ep_size=4, load_ep_size=2, load_zero_stage=1)
    blames = "RuntimeError: The ZeRO checkpoint parameter-alignment layout does not match\nmore"
    assert ds_resume.refusal_sentence(spec, blames) == (
        "DeepSpeed refused the load: RuntimeError: The ZeRO checkpoint parameter-alignment layout does not match "
        "(the message does not name the real cause: a different number of local experts per rank (ep_size 4 at "
        "the save, 2 at the load))")
    assert "(the message names the real cause" in ds_resume.refusal_sentence(spec, "ValueError: 4 experts per rank")
    stage = ds_resume.Spec(zero_stage=0, ep_size=4, load_ep_size=4, load_zero_stage=1)
    assert "the ZeRO stage differs (saved at 0, loaded at 1)" in ds_resume.refusal_sentence(stage, "FileNotFoundError")
    # the control load at the save layout: it loaded (the evidence), or it was refused too (not the layout)
    assert ds_resume.refusal_sentence(spec, blames, "").endswith("2 at the load); it loads at its save layout)")
    old_release = "UnpicklingError: Weights only load failed. This file can still be loaded\nmore"
    assert ds_resume.refusal_sentence(spec, old_release, old_release) == (
        "DeepSpeed refused the load: UnpicklingError: Weights only load failed. This file can still be loaded (the "
        "same checkpoint is refused at its save layout too: UnpicklingError: Weights only load failed. This file "
        "can still be loaded; so the refusal is not about the change of layout)")


@pytest.mark.multirank
def test_a_clean_resume_passes_and_a_refused_load_is_its_own_verdict(monkeypatch, tmp_path):
    rows = _rows(2, "deepspeed/resume/zero1/ep=2/w2/resume", "deepspeed/resume/zero0/ep=2to1/w2/resume")
    summary = _run(monkeypatch, tmp_path, rows)
    ok, refused = summary["rows"]
    assert ok["verdict"] == "pass" and ok["features"] == ["resume"] and ok["zero_stage"] == 1
    assert refused["verdict"] == "refused" and refused["load_ep_size"] == 1 and refused["ep_size"] == 2
    assert refused["diagnosis"].startswith("refused: DeepSpeed refused the load: ValueError: loaded state dict "
                                           "contains a parameter group")
    assert "does not name the real cause" in refused["diagnosis"]
    assert refused["diagnosis"].endswith("; it loads at its save layout)")  # the control load says so
    assert summary["status"] == "ok" and summary["counts"] == {"pass": 1, "fail": 0, "skip": 0, "refused": 1}
    names = {c["name"] for c in summary["checks"][0]["comparisons"]}
    for quantity in ("weights", "fp32 master", "exp_avg", "exp_avg_sq", "step"):
        assert f"after the load: rank 1, local slot 1 (expert 3) {quantity}" in names
    assert "continued step 2: loss" in names and "uninterrupted vs one process, step 4: loss" in names


FAULT_CASES = [
    # fault, row, diagnosis, experts named, a clause of the sentence
    ("swap-masters", "deepspeed/resume/zero1/ep=2/w2/resume", "permutation", [0, 1],
     "rank 0, local slot 0 holds global expert 1's fp32 master; it should hold expert 0"),
    ("wrong-group-state", "deepspeed/resume/zero2/ep=2/w2/resume", "permutation", [0, 1, 2, 3],
     "rank 0, local slot 0 holds global expert 2's fp32 master, exp_avg and exp_avg_sq; it should hold expert 0"),
    ("one-rank-experts", "deepspeed/resume/zero0/ep=2/w2/resume", "permutation", [2, 3],
     "rank 1, local slot 1 holds global expert 1's weights"),
    ("skip-experts", "deepspeed/resume/zero1/ep=2/w2/resume", "not-restored", [0, 1, 2, 3],
     "experts 0, 1, 2, 3: weights still the fresh initialisation"),
]


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault,key,name,experts,clause", FAULT_CASES, ids=[c[0] for c in FAULT_CASES])
def test_an_injected_checkpoint_bug_is_caught_and_named(monkeypatch, tmp_path, fault, key, name, experts, clause):
    summary = _run(monkeypatch, tmp_path, _rows(2, key), fault=fault)
    (row,) = summary["rows"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == name, row["diagnosis"]
    d = _restore_diagnosis(summary["checks"][0])
    assert d["name"] == name and d["details"]["experts"] == experts
    assert clause in d["sentence"], d["sentence"]


def test_resume_without_library_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBENCH_RESULTS": str(tmp_path / "results")}
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--resume"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: --resume: adds resume rows to a library's matrix; give --library NAME too, e.g. --library deepspeed"]
    assert not (tmp_path / "results").exists()


W4_VERDICTS = {
    **{f"deepspeed/resume/zero{s}/ep={ep}/w4/resume": "pass" for s in (0, 1, 2) for ep in (4, 2)},
    **{f"deepspeed/resume/zero{s}/ep=4to2/w4/resume": "refused" for s in (0, 1, 2)},  # misleading messages
    **{f"deepspeed/resume+noopt/zero{s}/ep=4to2/w4/resume": "pass" for s in (0, 1, 2)},
    "deepspeed/resume/zero1to2/ep=4/w4/resume": "pass",
    "deepspeed/resume/zero0to1/ep=4/w4/resume": "refused",  # a bare FileNotFoundError
    "deepspeed/resume+dbe/zero0/ep=2/w4/resume": "pass",
    "deepspeed/resume+dbe/zero2/ep=2/w4/resume": "pass",
    "deepspeed/resume+elastic/zero1/ep=2/w4/resume": "pass",
    "deepspeed/resume+elastic/zero2/ep=2/w4/resume": "pass",
    "deepspeed/resume+elastic+dbe/zero2/ep=2/w4/resume": "fail",  # finding: get_ep_ranks assumes E + D
    "deepspeed/resume+universal/zero1/ep=1/w4/resume": "pass",
    "deepspeed/resume+universal/zero1/ep=1to2/w4/resume": "fail",  # finding: DeepSpeed#6589
    "deepspeed/resume+universal/zero1/ep=1to4/w4/resume": "fail",
    **{f"deepspeed/resume+universal/zero1/ep={ep}/w4/resume": "refused" for ep in ("4to1", "4to2", "4")},  # #5716
}
"""Every resume row's verdict at world size 4 on the pinned DeepSpeed (0.19.8), as measured and documented in
docs/libraries/deepspeed.md; a failing row is a finding there, with its upstream issue."""
EXACT_ROWS = [key for key, verdict in W4_VERDICTS.items() if verdict == "pass"]
"""The rows that restore exactly: none may fail at any seed."""


@pytest.mark.slow
@pytest.mark.multirank
def test_the_whole_matrix_at_world_4_within_3_minutes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBENCH_RESULTS": str(tmp_path / "results")}
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "deepspeed", "--resume",
                           "--world-size", "4", "--json"], capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    doc = json.loads(done.stdout)
    assert sum(r["elapsed_s"] for r in doc["rows"]) <= 180  # the engine matrix and the resume rows
    resume = [r for r in doc["rows"] if "resume" in r["features"]]
    assert {r["check"] for r in resume} == set(W4_VERDICTS) == {r.key() for r in ds_resume.resume_rows(4)}
    assert {r["check"]: r["verdict"] for r in resume} == W4_VERDICTS
    for r in resume:
        assert r["verdict"] == "pass" or r["diagnosis"], r
        if r["verdict"] == "fail":
            assert r["diagnosis_name"] == "permutation", r
    assert done.returncode == 1  # the findings fail the run; the refusals alone would not


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarm_over_five_seeds(monkeypatch, tmp_path, seed):
    summary = _run(monkeypatch, tmp_path, _rows(4, *EXACT_ROWS), seed=seed)
    assert [r["verdict"] for r in summary["rows"]] == ["pass"] * len(EXACT_ROWS), summary["rows"]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault", sorted(ds_resume_faults.FAULTS))
def test_every_fault_is_caught_at_world_4_on_every_stage_it_applies_to(monkeypatch, tmp_path, fault):
    stages = (1, 2) if fault in ("swap-masters", "wrong-group-state") else (0, 1, 2)
    rows = _rows(4, *(f"deepspeed/resume/zero{s}/ep=4/w4/resume" for s in stages))
    summary = _run(monkeypatch, tmp_path, rows, fault=fault)
    expected = {case[0]: case[2] for case in FAULT_CASES}[fault]
    for row, check in zip(summary["rows"], summary["checks"]):
        assert row["verdict"] == "fail" and row["diagnosis_name"] == expected, row
        assert _restore_diagnosis(check)["name"] == expected


def _repro(tmp_path, key: str, fault: str | None) -> subprocess.CompletedProcess:
    (row,) = _rows(2, key)
    script = tmp_path / "repro.py"
    script.write_text(ds_adapter.ADAPTER.repro_script(row, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOEBENCH_INJECT_FAULT")}
    env["DS_ACCELERATOR"] = "cpu"  # the fault module imports DeepSpeed before the script could say so
    if fault:
        env.update(PYTHONPATH=f"{ROOT / 'tests' / 'faults' / 'inject'}:{ROOT}",
                   MOEBENCH_INJECT_FAULT=f"ds_resume_faults:{fault}")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=400, check=False)


def test_repro_script_is_standalone_and_only_for_resume_rows():
    (row,) = _rows(2, "deepspeed/resume/zero1/ep=2/w2/resume")
    source = ds_adapter.ADAPTER.repro_script(row, 3)
    head, body = source.split("\n", 1)
    assert head.startswith(f"# Reproduces moebench verify-parity row {row.key()} ")  # as every script's first line
    assert "moebench" not in body
    compile(source, "repro.py", "exec")
    assert ds_adapter.ADAPTER.repro_script(ds_adapter.ADAPTER.rows(2)[0], 0) is None


@pytest.mark.multirank
@pytest.mark.faults
def test_repro_script_exits_1_with_the_fault_and_0_without(tmp_path):
    broken = _repro(tmp_path, "deepspeed/resume/zero1/ep=2/w2/resume", "swap-masters")
    assert broken.returncode == 1, broken.stderr[-3000:]
    assert "first: rank 0, global expert 0, fp32 master after the load" in broken.stdout
    assert "it holds global expert 1's fp32 master" in broken.stdout
    assert all(len(line) <= 80 for line in broken.stdout.splitlines())
    clean = _repro(tmp_path, "deepspeed/resume/zero1/ep=2/w2/resume", None)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "0 restored slot(s) differ" in clean.stdout


def test_a_run_whose_rows_were_all_refused_is_not_a_pass():
    from moebench.parity.runner import no_check_ran

    summary = {"counts": {"pass": 0, "fail": 0, "skip": 1, "refused": 2}, "checks": []}
    assert no_check_ran(summary) == "no check passed: 2 refused by the library, the rest skipped"
    assert no_check_ran({"counts": {"pass": 1, "fail": 0, "skip": 0, "refused": 2}, "checks": []}) == ""


def test_adams_step_is_read_whatever_shape_a_release_restores_it_in():
    """torch's Adam keeps `step` as a 0-dim tensor, DeepSpeed's FusedAdam as a float in the param group; an
    elastic load of DeepSpeed 0.19.0 restored it as a tensor of several elements. The reader gives every rank a
    same-shaped value (a collective follows it: a crash on one rank hung the others for the gloo timeout), and a
    step spread over two elements differs from the uninterrupted run's scalar one."""
    import torch

    from moebench.parity import restore

    assert ds_state.step_of(torch.tensor(2.0)).tolist() == [2.0, 1.0]
    assert ds_state.step_of(2).tolist() == [2.0, 1.0] and ds_state.step_of(None).tolist() == [0.0, 1.0]
    merged = ds_state.step_of(torch.tensor([2.0, 2.0]))
    assert merged.tolist() == [2.0, 2.0]
    slot = restore.Slot(rank=0, local=0, unit=0)
    assert restore.identify(slot, restore.STEP, merged, {0: ds_state.step_of(torch.tensor(2.0))}).state != \
        restore.RIGHT
