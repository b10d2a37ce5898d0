"""Issue 37: adapters that hang, exit, spawn, return junk or print escape codes, through `--adapter`, the Python API
and moebench.testing. Each is one line naming the flag (exit 2, `UserError`, nothing written) or a row whose
verdict names what happened; no process a runner starts survives the run. The adapters are tests/libraries/hostile.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from helpers import warmcli

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # tests/libraries: holds the `hostile` package


def _env(tmp_path: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (HERE, REPO))),
            "MOEBENCH_RESULTS": str(tmp_path / "results"), **extra}


def _cli(tmp_path: Path, *args: str, timeout: float = 300, **extra: str):
    return warmcli.run(["verify-parity", *args], env=_env(tmp_path, **extra), timeout=timeout)


def _written(tmp_path: Path) -> list[str]:
    root = tmp_path / "results"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _one_line_refusal(done, flag: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert lines[0].startswith(f"error: {flag}: "), lines[0]
    assert "Traceback" not in done.stderr and "\x1b" not in done.stderr + done.stdout
    return lines[0]


def _line_of(module: str, marker: str) -> int:
    text = (HERE / "hostile" / f"{module}.py").read_text().splitlines()
    return next(i for i, line in enumerate(text, start=1) if marker in line)


@pytest.fixture
def hostile_path():
    sys.path.insert(0, str(HERE))
    try:
        yield
    finally:
        sys.path.remove(str(HERE))
        for name in [m for m in sys.modules if m == "hostile" or m.startswith("hostile.")]:
            del sys.modules[name]


# ---------------------------------------------------------------- the Python API's types

BAD_TYPES = [
    (dict(library=3), "--library", "library= takes a string or a list of strings, got int"),
    (dict(library=b"fairscale"), "--library", "got bytes"),
    (dict(library="fairscale", rows=5), "--row", "rows= takes a string or a list of strings, got int"),
    (dict(library="fairscale", rows=[None]), "--row", "got a list holding NoneType"),
    (dict(library="fairscale", repro=5), "--repro", "repro= takes a path, got int"),
    (dict(adapter=object()), "--adapter",
     "adapter= takes an Adapter object or 'package.module:ATTRIBUTE', got object"),
    (dict(adapter=b"pkg.mod:A"), "--adapter", "got bytes"),
    (dict(world_size="2"), "--world-size", "world_size= takes an int, got str"),
    (dict(world_size=True), "--world-size", "got bool"),
    (dict(timeout_s="10"), "--timeout", "timeout_s= takes a number of seconds, got str"),
    (dict(seed=1.5), "--seed", "seed= takes an int, got float"),
    (dict(impls={"experts": 3}), "--impl", "got a dict holding int"),
    (dict(checks=[1]), "--checks", "got a list holding int"),
    (dict(library="fairscale", resume="yes"), "--resume", "resume= takes True or False, got str"),
]


@pytest.mark.faults
@pytest.mark.parametrize("kwargs,flag,words", BAD_TYPES, ids=[str(i) for i in range(len(BAD_TYPES))])
def test_every_wrong_type_given_to_verify_parity_is_a_user_error(tmp_path, kwargs, flag, words):
    import moebench
    from moebench.errors import UserError

    with pytest.raises(UserError) as raised:
        moebench.verify_parity(results_dir=str(tmp_path / "results"), **kwargs)
    assert str(raised.value).startswith(f"{flag}: ") and words in str(raised.value), str(raised.value)
    assert _written(tmp_path) == []


@pytest.mark.multirank
def test_verify_parity_takes_the_adapter_object_docs_api_documents(tmp_path, hostile_path):
    from hostile.later_raise import ADAPTER

    import moebench

    summary = moebench.verify_parity(adapter=ADAPTER, world_size=2, results_dir=str(tmp_path / "results"))
    rows = {r["variant"] if "variant" in r else r["check"].rsplit("/", 1)[1]: r for r in summary["rows"]}
    assert [r["verdict"] for r in summary["rows"]] == ["pass", "fail", "pass"]
    failed = summary["rows"][1]
    assert failed["diagnosis_name"] == "library-raised", failed
    # the rerun names the object the way --adapter takes it
    assert "--adapter hostile.later_raise:ADAPTER -n 2" in failed["rerun"], failed["rerun"]
    assert rows


# ---------------------------------------------------------------- --timeout bounds the probe and the trial

@pytest.mark.faults
def test_timeout_bounds_the_adapters_import(tmp_path):
    start = time.monotonic()
    done = _cli(tmp_path, "--adapter", "hostile.hang_at_import:ADAPTER", "-n", "2", "--timeout", "3")
    elapsed = time.monotonic() - start
    line = _one_line_refusal(done, "--adapter")
    assert "did not finish importing within 3 s" in line and "--timeout" in line, line
    assert elapsed < 40, elapsed  # was a fixed 120 s whatever --timeout said (the slack: a loaded machine's start-up)
    assert _written(tmp_path) == []


@pytest.mark.faults
def test_an_adapter_that_exits_at_import_is_one_line(tmp_path):
    done = _cli(tmp_path, "--adapter", "hostile.exit_at_import:ADAPTER", "-n", "2")
    assert "exit code 3" in _one_line_refusal(done, "--adapter")
    assert _written(tmp_path) == []


@pytest.mark.faults
@pytest.mark.multirank
def test_timeout_bounds_the_trial_row_and_a_hang_names_where_it_was(tmp_path):
    start = time.monotonic()
    # 8 s: time for the ranks to reach the runner's sleep on a loaded machine, far below the fixed 120 s of before
    done = _cli(tmp_path, "--adapter", "hostile.hang_in_rank:ADAPTER", "-n", "2", "--timeout", "8", "--row", "*/v0",
                "--json")
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    assert elapsed < 70, elapsed  # the trial row (8 s + its slack) and the row itself (8 s + the stack dump)
    (row,) = json.loads(done.stdout)["rows"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "hung", row
    assert f"hang_in_rank.py:{_line_of('hang_in_rank', 'HANG_LINE')} (in run)" in row["diagnosis"], row["diagnosis"]


# ---------------------------------------------------------------- a later row's rank that raises or dies

@pytest.mark.faults
@pytest.mark.multirank
def test_a_later_row_that_raises_names_the_rank_the_exception_and_the_users_line(tmp_path):
    done = _cli(tmp_path, "--adapter", "hostile.later_raise:ADAPTER", "-n", "2")
    assert done.returncode == 1, done.stderr[-3000:]
    console = " ".join(done.stdout.split())  # the table wraps its lines at 80 columns
    line = _line_of("later_raise", "LATER_RAISE_LINE")
    assert re.search(rf"library-raised: rank 1 raised ValueError: boom in row v1 on rank 1 at \S*later_raise.py:"
                     rf"{line} \(in run\)", console), done.stdout
    assert "failed on 2 rank(s)" not in done.stdout
    assert "Traceback" not in done.stdout + done.stderr  # the whole traceback is --debug's


@pytest.mark.faults
@pytest.mark.multirank
def test_debug_prints_the_failing_ranks_traceback(tmp_path):
    done = warmcli.run(["--debug", "verify-parity", "--adapter", "hostile.later_raise:ADAPTER", "-n", "2",
                        "--row", "*/v1"], env=_env(tmp_path), timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback (most recent call last)" in done.stderr and "later_raise.py" in done.stderr, done.stderr[-3000:]


@pytest.mark.faults
@pytest.mark.multirank
def test_a_later_row_whose_rank_dies_names_the_rank_and_its_exit(tmp_path):
    done = _cli(tmp_path, "--adapter", "hostile.later_exit:ADAPTER", "-n", "2", "--json")
    assert done.returncode == 1, done.stderr[-3000:]
    row = json.loads(done.stdout)["rows"][1]
    assert row["diagnosis_name"] == "rank-died" and "rank 1 died without a result (exit code 7)" in row["diagnosis"]


# ---------------------------------------------------------------- no survivor

def _survivors(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or ()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _no_survivor(marker: str) -> None:
    end = time.monotonic() + 3  # a killed process may take a moment to leave the process table
    while _survivors(marker) and time.monotonic() < end:
        time.sleep(0.1)
    left = _survivors(marker)
    for p in left:
        p.kill()
    assert not left, [p.pid for p in left]


@pytest.mark.faults
@pytest.mark.multirank
@pytest.mark.parametrize("then", ["return", "raise"])
def test_a_child_a_runner_starts_in_its_own_session_does_not_survive_the_cli(tmp_path, then):
    marker = f"moebench-detached-{uuid.uuid4().hex}"
    done = _cli(tmp_path, "--adapter", "hostile.detached:ADAPTER", "-n", "2", "--row", "*/v0",
                MOEBENCH_TEST_MARKER=marker, MOEBENCH_TEST_DETACHED_THEN=then)
    # raising in the first row makes the --adapter trial refuse the adapter (exit 2): its ranks' children go too
    assert done.returncode == (0 if then == "return" else 2), done.stderr[-3000:]
    _no_survivor(marker)


@pytest.mark.faults
@pytest.mark.multirank
def test_a_child_a_runner_starts_in_its_own_session_does_not_survive_moebench_testing(hostile_path, monkeypatch):
    from hostile.detached import ADAPTER

    from moebench.testing import assert_rows_pass, run_rows

    marker = f"moebench-detached-{uuid.uuid4().hex}"
    monkeypatch.setenv("MOEBENCH_TEST_MARKER", marker)
    assert_rows_pass(run_rows(ADAPTER, world_size=2, rows=["*/v0", "*/v1"]))
    _no_survivor(marker)


@pytest.mark.faults
@pytest.mark.multirank
def test_a_child_of_a_hung_rank_does_not_survive_either(hostile_path, monkeypatch, tmp_path):
    """The rank is killed at the deadline: what it started in a session of its own is killed with it."""
    from hostile.detached import Detached

    from moebench.libraries.spec import PARITY
    from moebench.testing import run_rows

    def start_then_hang(ctx, row, opts):
        from hostile.detached import run

        run(ctx, row, opts)
        time.sleep(3600)

    class HangsAfter(Detached):
        name = "detached-hang"
        runners = {PARITY: start_then_hang}

    marker = f"moebench-detached-{uuid.uuid4().hex}"
    monkeypatch.setenv("MOEBENCH_TEST_MARKER", marker)
    (record,) = run_rows(HangsAfter(), world_size=2, rows=["*/v0"], timeout_s=3)
    assert record["diagnosis_name"] == "hung", record
    _no_survivor(marker)


# ---------------------------------------------------------------- labels and settings

@pytest.mark.faults
@pytest.mark.parametrize("attr,words", [
    ("DOTDOT", "model '/..' must be one word"),
    ("ESCAPE", r"backend '\x1b[31mred\x1b[0m' has control characters"),
    ("NEWLINE", r"ep_mode 'a\nb' has control characters"),
    ("HUGE_SETTING", "settings field blob has 8000000 characters; at most 200"),
    ("ESCAPE_FEATURE", r"feature '\x1b]0;title\x07' has control characters"),
])
def test_a_row_label_no_console_or_file_can_take_is_refused(tmp_path, attr, words):
    done = _cli(tmp_path, "--adapter", f"hostile.labels:{attr}", "-n", "2")
    line = _one_line_refusal(done, "--adapter")
    assert "does not meet the adapter protocol" in line and words in line, line
    assert _written(tmp_path) == []


# ---------------------------------------------------------------- protocol functions

@pytest.mark.faults
@pytest.mark.multirank
@pytest.mark.parametrize("attr,words", [
    ("REPRO_RAISES", "repro-raises.repro_script raised RuntimeError: my repro_script is broken (row "
                     "repro-raises/m/-/-/w2/v0 and 2 more)"),
    ("REPRO_NOT_TEXT", "repro-not-text.repro_script returned a int; it must return the script's source"),
])
def test_a_repro_script_that_raises_or_returns_no_text_is_named_and_the_run_ends_failed(tmp_path, attr, words):
    done = _cli(tmp_path, "--adapter", f"hostile.protocol:{attr}", "-n", "2", "--repro", str(tmp_path / "repro"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --repro: ") and words in errors[0], done.stderr
    (run,) = (tmp_path / "results" / "parity").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and words in summary["repro_error"]  # never left "running"


@pytest.mark.faults
@pytest.mark.parametrize("attr,flag,words", [
    ("SKIP_NOT_TEXT", "--adapter", "skip-not-text: skip_reason(skip-not-text/m/-/-/w2/v0) returned a int; it must "
                                   "return a string"),
    ("SKIP_RAISES", "--adapter", "skip-raises: skip_reason(skip-raises/m/-/-/w2/v0) raised KeyError"),
    ("UNAVAILABLE", "--adapter", "cannot run here: needs the in-house fabric library"),
    ("ALL_SKIP", "--adapter", "none of the 3 row(s) of all-skip at world size 2 can run here; "
                              "all-skip/m/-/-/w2/v0: needs a GPU"),
])
def test_protocol_answers_are_held_to_their_types_before_any_rank(tmp_path, attr, flag, words):
    done = _cli(tmp_path, "--adapter", f"hostile.protocol:{attr}", "-n", "2")
    assert words in _one_line_refusal(done, flag)
    assert _written(tmp_path) == []


@pytest.mark.faults
@pytest.mark.multirank
@pytest.mark.parametrize("attr,got", [("NONE", "returned None"), ("DICT", "returned a dict"),
                                      ("NUMBERS", "returned a list holding a float")])
def test_a_runner_that_returns_no_comparisons_is_told_so(tmp_path, attr, got):
    done = _cli(tmp_path, "--adapter", f"hostile.junk:{attr}", "-n", "2")
    line = _one_line_refusal(done, "--adapter")
    assert got in line and "must return a list of comparisons" in line, line
    assert _written(tmp_path) == []


@pytest.mark.faults
@pytest.mark.multirank
def test_a_runner_that_returns_no_comparisons_in_moebench_testing(hostile_path):
    from hostile.junk import NONE

    from moebench.testing import run_rows

    records = run_rows(NONE, world_size=2, rows=["*/v0"])
    assert [r["diagnosis_name"] for r in records] == ["adapter-protocol"], records
    assert "returned None; a runner must return a list of comparisons" in records[0]["diagnosis"]


# ---------------------------------------------------------------- flags

@pytest.mark.faults
def test_a_second_adapter_is_refused_not_silently_replacing_the_first(tmp_path):
    done = _cli(tmp_path, "--adapter", "hostile.later_raise:ADAPTER", "--adapter", "hostile.junk:NONE", "-n", "2")
    line = _one_line_refusal(done, "--adapter")
    assert "given 2 times (hostile.later_raise:ADAPTER, hostile.junk:NONE)" in line, line
    assert _written(tmp_path) == []


@pytest.mark.faults
def test_list_with_adapter_lists_its_row_keys_and_the_row_hint_points_there(tmp_path):
    listed = _cli(tmp_path, "--list", "--adapter", "hostile.later_raise:ADAPTER", "-n", "2")
    assert listed.returncode == 0, listed.stderr[-3000:]
    keys = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert keys == [f"later-raise/m/-/-/w2/v{i}" for i in range(3)], listed.stdout
    as_json = json.loads(_cli(tmp_path, "--list", "--adapter", "hostile.protocol:ALL_SKIP", "-n", "2",
                              "--json").stdout)
    assert {r["skip"] for r in as_json["rows"]} == {"needs a GPU"}
    done = _cli(tmp_path, "--adapter", "hostile.later_raise:ADAPTER", "-n", "2", "--row", "nothing/*")
    assert "--list --adapter" in _one_line_refusal(done, "--row")
    assert _written(tmp_path) == []


@pytest.mark.faults
def test_has_no_rows_names_the_adapter_flag_for_an_adapter(tmp_path):
    done = _cli(tmp_path, "--adapter", "hostile.protocol:NO_ROWS_AT_THREE", "-n", "3")
    assert "no-rows-at-three has no rows at world size 3" in _one_line_refusal(done, "--adapter")


@pytest.mark.faults
@pytest.mark.parametrize("size", ["1", "3"])
def test_a_world_size_where_every_row_of_a_library_skips_is_refused_in_the_parent(tmp_path, size):
    """torchtitan's rows: none at 1 rank, and at 3 every one skips (8 experts do not split over 3 ranks): both are
    one line before any folder (-n 3 made a run folder and exited 1)."""
    pytest.importorskip("torchtitan")
    done = _cli(tmp_path, "--library", "torchtitan", "-n", size)
    line = _one_line_refusal(done, "--library")
    assert re.search("has no rows at world size 1" if size == "1" else
                     r"none of the \d+ row\(s\) of torchtitan at world size 3 can run here; .*: 8 experts do not "
                     "split over 3 ranks", line), line
    assert _written(tmp_path) == []
