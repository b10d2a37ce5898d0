"""The results writer: atomic JSON, strict JSON only, line-flushed metrics, status lifecycle."""

from __future__ import annotations

import json

import pytest

from moebench import results


def test_run_dir_lifecycle(tmp_path):
    run = results.RunDir.create("demo", "quick", root=tmp_path)
    assert run.path.parent == tmp_path / "demo" and "quick" in run.run_id
    run.start({"kind": "demo"})
    assert results.read_json(run.path / "summary.json")["status"] == "running"
    run.log_metrics({"step": 1, "loss": 1.5})
    # flushed at once: a reader (or a crash) sees the line before the run ends
    assert results.read_jsonl(run.path / "metrics.jsonl") == [{"step": 1, "loss": 1.5}]
    returned = run.finish(results.STATUS_OK, {"loss": 1.0})
    saved = results.read_json(run.path / "summary.json")
    assert saved == returned and saved["status"] == "ok" and saved["loss"] == 1.0
    assert saved["schema"] == "moebench.summary/1" and saved["kind"] == "demo" and saved["run_id"] == run.run_id
    assert saved["run_path"] == str(run.path.absolute()) and saved["wall_time_s"] >= 0 and saved["pid"] > 0
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_two_runs_in_the_same_second_get_distinct_folders(tmp_path):
    a = results.RunDir.create("demo", "x", root=tmp_path)
    b = results.RunDir.create("demo", "x", root=tmp_path)
    assert a.path != b.path


def test_non_finite_numbers_stay_strict_json(tmp_path):
    path = results.write_json_atomic(tmp_path / "a.json", {"nan": float("nan"), "inf": [float("inf")]})
    assert json.loads(path.read_text()) == {"nan": "nan", "inf": ["inf"]}


def test_a_failed_write_leaves_the_old_file_intact(tmp_path):
    path = results.write_json_atomic(tmp_path / "a.json", {"v": 1})
    with pytest.raises(TypeError):
        results.write_json_atomic(path, {"v": object()})
    assert results.read_json(path) == {"v": 1}


def test_check_root_rejects_a_file_anywhere_on_the_path(tmp_path):
    from moebench.errors import UserError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--results-dir"):
        results.check_root(blocker, "fastmoe")
    with pytest.raises(UserError, match="--results-dir"):
        results.check_root(blocker / "below", "fastmoe")
    assert results.check_root(tmp_path / "new", "fastmoe") == tmp_path / "new" / "fastmoe"
    assert not (tmp_path / "new").exists()  # validation creates nothing


def test_runs_made_in_the_same_second_come_back_newest_first(tmp_path, monkeypatch):
    """Run ids carry microseconds: a report or `runs` listing runs made within one second (a script, a test)
    gets them newest first, whatever their names or random suffixes."""
    made = [results.RunDir.create("demo", name, root=tmp_path).path for name in ("zzz", "aaa", "", "mmm") * 3]
    assert len({p.name[:15] for p in made}) <= 2  # most in one second: the case this is about
    assert list(results.latest_runs("demo", tmp_path)) == made[::-1]


def test_a_run_id_taken_in_the_same_microsecond_is_drawn_again(tmp_path, monkeypatch):
    ids = iter(["20261126-101010-000011", "20261126-101010-000011", "20261126-101010-000012"])
    monkeypatch.setattr(results, "new_run_id", lambda name="": next(ids))
    first = results.RunDir.create("demo", root=tmp_path)
    second = results.RunDir.create("demo", root=tmp_path)
    assert (first.run_id, second.run_id) == ("20261126-101010-000011", "20261126-101010-000012")
