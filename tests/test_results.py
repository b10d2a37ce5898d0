"""The results writer: atomic JSON, strict JSON only, line-flushed metrics, status lifecycle."""

from __future__ import annotations

import json
import os

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


def _disk_fills_after(monkeypatch, limit: int) -> None:
    """Every results file write fails with ENOSPC once `limit` bytes of it are written (a full disk)."""
    import errno

    real_dump = json.dump

    def dump(obj, f, **kw):
        text = json.dumps(obj, **kw)
        if len(text) > limit:
            f.write(text[:limit])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_dump(obj, f, **kw)
    monkeypatch.setattr(results.json, "dump", dump)


def test_a_full_disk_leaves_no_temporary_file_and_a_summary_that_says_failed(tmp_path, monkeypatch):
    """Issue 32: on a full disk verify-parity left a 299 KB .summary.json.<pid>.tmp and summary.json at
    "running". The temporary file is removed, and the short summary that still fits says failed and why."""
    run = results.RunDir.create("parity", root=tmp_path)
    run.start()
    _disk_fills_after(monkeypatch, 2000)
    with pytest.raises(OSError, match="No space left"):
        run.finish(results.STATUS_OK, {"checks": [{"name": "x" * 5000}]})
    assert [p.name for p in run.path.iterdir()] == ["summary.json"]  # no .tmp
    monkeypatch.undo()
    saved = results.read_back(run.path / "summary.json")
    assert saved["status"] == "failed" and "could not write summary.json: No space left on device" in saved["error"]


def test_a_file_that_does_not_fit_is_removed_whole(tmp_path, monkeypatch):
    _disk_fills_after(monkeypatch, 10)
    with pytest.raises(OSError):
        results.write_json_atomic(tmp_path / "env.json", {"a": "b" * 100})
    import errno

    def no_room(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(results.os, "fsync", no_room)  # the data reaches the disk only at fsync
    with pytest.raises(OSError):
        results.write_text_atomic(tmp_path / "REPORT.md", "x" * 100)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def full_disk(tmp_path):
    """A real 64 KiB tmpfs (root on Linux only; skipped elsewhere)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root on Linux")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_run_on_a_really_full_disk_fails_cleanly(full_disk):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "moebench", "run", "fastmoe", "--steps", "3", "--results-dir",
                           str(full_disk / "r")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr
    (run,) = (full_disk / "r" / "fastmoe").iterdir()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert results.read_json(run / "summary.json")["status"] == "failed"
