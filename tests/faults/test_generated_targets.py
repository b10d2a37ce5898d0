"""Hostile folders for the options that write (issue 32): every --results-dir of every command that writes, and
--repro, get targets generated from the kinds of place a folder can be (a file, a path through a file, /proc,
/dev/null, a run folder or a folder inside one, the results folder or one kind's folder of it, a link to a run,
a link loop, a name too long, a non-empty folder) at several depths. Each is refused before any work (exit 2, one
line naming the flag and saying what the place is, no traceback, nothing created anywhere, the place unchanged),
or accepted by declaration (a new or empty folder outside other runs), which reaches the work."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench import results
from moebench.cli.app import app

pytestmark = pytest.mark.faults

WRITERS = {"run fastmoe": ["run", "fastmoe"], "run deepspeed": ["run", "deepspeed"],
           "verify-parity": ["verify-parity", "-n", "2", "--checks", "ddp-sgd"],
           "verify-parity --library": ["verify-parity", "--library", "fairscale"],
           "env-check": ["env-check", "--no-probe"], "report": ["report"], "bench": ["bench", "--quick"]}
"""Every command that writes under --results-dir (runs only lists; gpu-check refuses without a GPU first)."""
CASE_SECONDS = 5.0


class ReachedWork(Exception):
    pass


@pytest.fixture
def place(tmp_path, monkeypatch):
    """The places: a results folder with one run in it, files and links around it."""
    root = tmp_path / "results"
    run = results.RunDir.create("fastmoe", root=root)
    run.finish(results.STATUS_INTERRUPTED, {"error": "interrupted"})
    other = results.RunDir.create("parity", root=tmp_path / "other-results")  # another results folder's run
    other.finish(results.STATUS_INTERRUPTED, {"checks": []})
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old_script.py").write_text("print(1)")
    (tmp_path / "empty").mkdir()
    os.symlink(run.path, tmp_path / "link-to-run")
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    monkeypatch.chdir(tmp_path / "empty")
    monkeypatch.setenv("MOEBENCH_RESULTS", str(root))
    return {"tmp": tmp_path, "root": root, "run": run.path, "other_run": other.path}


def _refused_targets(p) -> dict[str, tuple[str, str]]:
    """What each hostile place is, and a word the refusal must say (its true reason)."""
    tmp, run = p["tmp"], p["run"]
    places = {
        "a file": (tmp / "a-file", "file"),
        "/proc": (Path("/proc/moebench-x"), "not writable"),
        "/dev/null": (Path("/dev/null"), "not a folder"),
        "a run folder": (run, "run folder"),
        "a link to a run folder": (tmp / "link-to-run", "run folder"),
        "a link loop": (tmp / "loop-a", "link loop"),
        "a name too long": (tmp / ("n" * 300), ""),
    }
    out = {}
    for what, (path, says) in places.items():
        out[what] = (str(path), says)
        out[f"inside {what}"] = (str(path / "sub" / "deeper"), says if what != "/dev/null" else "")
    return out


def _check_refusal(result, flag: str, says: str, case: str, elapsed: float) -> list[str]:
    lines = [line for line in result.output.splitlines() if line.strip()]
    if result.exit_code != 2:
        return [f"{case}: exit {result.exit_code}: {result.output[-300:]!r} {result.exception!r}"]
    if "Traceback" in result.output or not isinstance(result.exception, (SystemExit, type(None))):
        return [f"{case}: traceback / {result.exception!r}"]
    if len(lines) != 1 or not lines[0].startswith("error: ") or flag not in lines[0]:
        return [f"{case}: {result.output[:300]!r}"]
    alternatives = (says,) if isinstance(says, str) else says
    if says and not any(word in lines[0] for word in alternatives):
        return [f"{case}: does not say {says!r}: {lines[0][:200]!r}"]
    return [f"{case}: {elapsed:.1f} s"] if elapsed > CASE_SECONDS else []



@pytest.fixture
def tripwires(monkeypatch):
    from moebench import envcheck, train
    from moebench.bench import core
    from moebench.libraries import verify as library_verify
    from moebench.parity import runner as parity_runner
    from moebench.report import build

    def trip(*args, **kwargs):
        raise ReachedWork("reached work")

    for owner, name in ((train, "run_variant"), (core, "run_bench"), (parity_runner, "verify_parity"),
                        (envcheck, "run_all"), (build, "build_report"), (library_verify, "run")):
        monkeypatch.setattr(owner, name, trip)


def _snapshot(tmp: Path) -> list[str]:
    seen = []
    for dirpath, dirnames, filenames in os.walk(tmp):  # links are not followed: a loop is a name, not a walk
        seen += [os.path.join(dirpath, n) for n in dirnames + filenames]
    return sorted(seen)


def test_generated_hostile_results_dirs(place, tripwires):
    runner = CliRunner()
    before = _snapshot(place["tmp"])
    failures, tried = [], 0
    targets = _refused_targets(place)
    targets["the results folder's run kind folder"] = (str(place["root"] / "fastmoe"), "one kind")
    for command, args in WRITERS.items():
        for what, (target, says) in targets.items():
            tried += 1
            start = time.monotonic()
            result = runner.invoke(app, [*args, "--results-dir", target])
            failures += _check_refusal(result, "--results-dir", says, f"{command} --results-dir <{what}>",
                                       time.monotonic() - start)
            if _snapshot(place["tmp"]) != before:
                failures.append(f"{command} --results-dir <{what}>: created "
                                f"{sorted(set(_snapshot(place['tmp'])) - set(before))[:3]}")
                break
    assert not failures, "\n".join(failures[:40])
    assert tried >= 7 * 15


@pytest.mark.parametrize("target", ["new", "empty", "results"])
def test_a_folder_a_results_dir_may_be_reaches_the_work(place, tripwires, target):
    folder = {"new": place["tmp"] / "new" / "results", "empty": place["tmp"] / "empty", "results": place["root"]}
    for args in WRITERS.values():
        result = CliRunner().invoke(app, [*args, "--results-dir", str(folder[target])])
        assert isinstance(result.exception, ReachedWork) or "reached work" in result.output, (args, result.output)


def test_generated_hostile_repro_folders(place, tripwires):
    runner = CliRunner()
    before = _snapshot(place["tmp"])
    targets = _refused_targets(place)
    for what, (target, says) in list(targets.items()):  # this results folder's run is inside it, too
        if "run folder" in what:
            targets[what] = (target, ("run folder", "results folder"))
    targets["another results folder's run"] = (str(place["other_run"]), "run folder")
    targets["inside another results folder's run"] = (str(place["other_run"] / "repro"), "run folder")
    targets["a folder with a script in it"] = (str(place["tmp"] / "full"), "not empty")
    targets["the results folder"] = (str(place["root"]), "results folder")
    targets["inside the results folder"] = (str(place["root"] / "repro"), "results folder")
    targets["the results folder's kind folder"] = (str(place["root"] / "parity"), "results folder")
    failures = []
    for what, (target, says) in targets.items():
        start = time.monotonic()
        result = runner.invoke(app, ["verify-parity", "--library", "fairscale", "-n", "2", "--repro", target])
        failures += _check_refusal(result, "--repro", says, f"--repro <{what}>", time.monotonic() - start)
        if _snapshot(place["tmp"]) != before:
            failures.append(f"--repro <{what}>: created {sorted(set(_snapshot(place['tmp'])) - set(before))[:3]}")
            break
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("target", ["new", "empty"])
def test_a_folder_repro_may_be_reaches_the_work(place, tripwires, target):
    folder = {"new": place["tmp"] / "new" / "repro", "empty": place["tmp"] / "empty"}[target]
    result = CliRunner().invoke(app, ["verify-parity", "--library", "fairscale", "-n", "2", "--repro", str(folder)])
    assert isinstance(result.exception, ReachedWork), result.output
