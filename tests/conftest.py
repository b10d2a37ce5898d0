"""Shared fixtures: every test writes results into its own tmp folder, never the repo's results/."""

from __future__ import annotations

import os

import psutil
import pytest


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_as_from_a_terminal():
    """The tests send Ctrl-C to the processes they start and expect what a terminal's user gets. A pytest started
    from a background job of a script (`make test &`, CI runners, nohup) begins with SIGINT ignored, and every
    process it starts would inherit that and never see the Ctrl-C: the session starts them as a terminal would."""
    from helpers.procsignals import as_from_a_terminal

    as_from_a_terminal()
    yield


@pytest.fixture(scope="session", autouse=True)
def _session_probe_cache(tmp_path_factory):
    """Import-probe answers (moebench.probecache) shared by this session's tests and the commands they start (every
    worker's), never the user's own cache: each session probes its libraries once."""
    from helpers.quickruns import shared_folder

    folder = shared_folder(tmp_path_factory.getbasetemp()) / "probe-cache"
    folder.mkdir(exist_ok=True)
    os.environ["MOEBENCH_CACHE"] = str(folder)
    yield


@pytest.fixture(scope="session")
def quick_runs_source(tmp_path_factory):
    """(results folder, {kind: console}) of one small real run of each kind (tests/helpers/quickruns.py), made
    once for the whole session and every worker. Read-only: a test that writes copies it first."""
    import json

    from helpers.quickruns import quick_runs

    folder = quick_runs(tmp_path_factory.getbasetemp())
    return folder / "results", json.loads((folder / "consoles.json").read_text())


@pytest.fixture(autouse=True)
def _private_results(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_RESULTS", str(tmp_path / "results"))
    # A test process must never look like one rank of a torchrun job.
    from helpers.userenv import LAUNCHER_VARIABLES

    for var in LAUNCHER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    # A run sets DS_ACCELERATOR for DeepSpeed (from its device); a test faking CUDA must not leak it.
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    from moebench import signals

    signals.reset()  # a signal one test sent must not interrupt the next
    from helpers.procsignals import dispositions_kept

    with dispositions_kept():  # what one test does to SIGINT/SIGTERM, the next test's processes do not inherit
        yield



@pytest.fixture
def no_leftover_children():
    """Fails the test if it leaves any child process of this pytest process behind."""
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    yield
    from helpers.warmcli import children_left

    alive = [p for p in children_left() if p.pid not in before]
    assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"


@pytest.fixture(autouse=True)
def _results_match_their_schemas(request, tmp_path):
    """After each test, every results file it wrote under tmp_path (summary.json, config.json, params.json,
    env.json, envcheck.json, metrics.jsonl) must validate against moebench/schemas. A test that writes
    broken files on purpose opts out with @pytest.mark.no_schema_check; without jsonschema this is a no-op."""
    yield
    if request.node.get_closest_marker("no_schema_check") is not None:
        return
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return
    from moebench.schemas import results_files, validate_tree

    if tmp_path.is_dir() and results_files(tmp_path):
        validate_tree(tmp_path)


def pytest_collection_modifyitems(config, items):
    """The tests tests/tiers.py moved to the slow tier get the `slow` mark (with its reason)."""
    from tiers import COLLECTED, MOVED_TO_SLOW

    matched = set()
    for item in items:
        for prefix, reason in MOVED_TO_SLOW.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.slow(reason=reason))
                matched.add(prefix)
    # what tests/test_tiers.py reads instead of collecting the suite again
    config.stash[COLLECTED] = ({item.nodeid.split("::")[0] for item in items}, matched)


def pytest_collection_finish(session):
    """What collection imported (torch, the libraries, every test module) stays for the session: frozen, a full
    garbage collection in a test's process no longer walks it (about half a million objects, 0.2 s a time)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    import sys

    if "helpers.warmcli" in sys.modules:  # its warm interpreter, reaped here rather than left to die with us
        sys.modules["helpers.warmcli"].stop()
