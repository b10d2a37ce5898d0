"""A user's own MoE as a library: the worked example of docs/adding-a-library.md (tests/examples/inhouse_moe: an
in-house layer with a hand-rolled all-to-all, and its adapter on the public protocol) run through `--adapter`, an
installed package's entry point and `moebench.testing`; passing, and failing with the right diagnosis when a test
breaks its gradient sync (tests/faults/inhouse_faults.py). A broken adapter is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import warmcli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "tests" / "examples"
INJECT = REPO / "tests" / "faults" / "inject"
TARGET = "inhouse_moe.adapter:ADAPTER"


def _cli(tmp_path: Path, *args: str, path: tuple[Path, ...] = (EXAMPLES,), fault: str | None = None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (*((INJECT,) if fault else ()), *path, REPO))),
           "MOEBENCH_RESULTS": str(tmp_path / "results")}
    if fault:
        env["MOEBENCH_INJECT_FAULT"] = f"inhouse_faults:{fault}"
    return warmcli.run(["verify-parity", *args], env=env, timeout=300)  # a fault's sitecustomize: a fresh one


def _written(tmp_path: Path) -> list[str]:
    root = tmp_path / "results"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.multirank
def test_the_worked_example_passes_through_adapter(tmp_path):
    done = _cli(tmp_path, "--adapter", TARGET, "-n", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    assert [(r["library"], r["version"], r["ep_mode"], r["experts_per_rank"], r["verdict"]) for r in rows] == [
        ("inhouse-moe", "example", "a2a-E=W", 1, "pass"), ("inhouse-moe", "example", "a2a-E=2W", 2, "pass")]


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault,name,words", [
    ("expert-grads-summed", "uniform-scale", "actual = 2 x expected everywhere: summed instead of averaged over 2 "
                                             "ranks (the world size)"),
    ("router-not-reduced", "rank-local", "grad router.weight: rank-local; it matches what this rank's own tokens "
                                         "alone would give"),
])
def test_a_broken_gradient_sync_fails_with_its_diagnosis(tmp_path, fault, name, words):
    done = _cli(tmp_path, "--adapter", TARGET, "-n", "2", "--json", fault=fault)
    assert done.returncode == 1, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    assert {(r["verdict"], r["diagnosis_name"]) for r in rows} == {("fail", name)}
    assert all(words in r["diagnosis"] for r in rows), rows[0]["diagnosis"]


BROKEN = {
    "missing.py": None,  # no such module
    "raises.py": "raise RuntimeError('my adapter is broken')\n",
    "notadapter.py": "ADAPTER = object()\n",
    "norunner.py": "from moebench.libraries.spec import Adapter, Row\n"
                   "class A(Adapter):\n    name, import_name = 'norunner', 'torch'\n    runners = {'bf16': print}\n"
                   "    def rows(self, w, *, resume=False, user_config=None):\n"
                   "        return [Row(library='norunner', model='m', backend='-', ep_mode='-', world_size=w)]\n"
                   "ADAPTER = A()\n",
    "rankraises.py": "from moebench.libraries.spec import Adapter, Row\n"
                     "def run(ctx, row, opts):\n    raise ValueError('boom in my rank code')\n"
                     "class A(Adapter):\n    name, import_name = 'rankraises', 'torch'\n"
                     "    runners = {'parity': run}\n"
                     "    def rows(self, w, *, resume=False, user_config=None):\n"
                     "        return [Row(library='rankraises', model='m', backend='-', ep_mode='-', world_size=w)]\n"
                     "ADAPTER = A()\n",
    # rank 0 raises; rank 1 talks on stderr, then meets the dead rank 0 in a collective and raises too (a peer's
    # lost connection, which must not be named as the cause; CI saw it when rank 0 died during rank 1's rendezvous)
    "peerraises.py": "import sys, time, torch, torch.distributed as dist\n"
                     "from moebench.libraries.spec import Adapter, Row\n"
                     "def run(ctx, row, opts):\n"
                     "    if ctx.rank == 0:\n        raise ValueError('boom on rank 0')\n"
                     "    print('rank 1 talks on stderr', file=sys.stderr, flush=True)\n"
                     "    time.sleep(0.5)\n    dist.all_reduce(torch.ones(1))\n"
                     "class A(Adapter):\n    name, import_name = 'peerraises', 'torch'\n"
                     "    runners = {'parity': run}\n"
                     "    def rows(self, w, *, resume=False, user_config=None):\n"
                     "        return [Row(library='peerraises', model='m', backend='-', ep_mode='-', world_size=w)]\n"
                     "ADAPTER = A()\n",
    "clash.py": "from inhouse_moe.adapter import InHouse\nclass A(InHouse):\n    name = 'deepspeed'\nADAPTER = A()\n",
}
WHY = {
    "missing.py": "does not import: ModuleNotFoundError: No module named 'missing'",
    "raises.py": "does not import: RuntimeError: my adapter is broken",
    "notadapter.py": "does not meet the adapter protocol: is a object, not a moebench.libraries.spec.Adapter",
    "norunner.py": "does not meet the adapter protocol: row norunner/m/-/-/w2 is of kind 'parity', which no runner "
                   "runs",
    "rankraises.py": "its rank code raised on row rankraises/m/-/-/w2: ValueError: boom in my rank code at "
                     "rankraises.py:3",
    "peerraises.py": "its rank code raised on row peerraises/m/-/-/w2: ValueError: boom on rank 0 at "
                     "peerraises.py:5",
    "clash.py": "is named 'deepspeed', which `--library deepspeed` already runs",
}


@pytest.mark.faults
@pytest.mark.parametrize("module", list(BROKEN))
def test_a_broken_adapter_is_one_line_exit_2_and_nothing_written(tmp_path, module):
    if BROKEN[module] is not None:
        (tmp_path / module).write_text(BROKEN[module])
    done = _cli(tmp_path, "--adapter", f"{module[:-3]}:ADAPTER", "-n", "2", path=(tmp_path, EXAMPLES))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: --adapter: {module[:-3]}:ADAPTER") and WHY[module] in lines[0], lines[0]
    assert _written(tmp_path) == []


@pytest.mark.multirank
def test_an_installed_package_registers_its_adapter_by_entry_point(tmp_path):
    """A distribution whose metadata declares [moebench.adapters] inhouse-moe = inhouse_moe.adapter:ADAPTER: it
    shows in --list and runs with --library, exactly like a built-in library."""
    site = tmp_path / "site"
    meta = site / "inhouse_moe-1.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: inhouse-moe\nVersion: 1.0\n")
    (meta / "entry_points.txt").write_text(f"[moebench.adapters]\ninhouse-moe = {TARGET}\n")
    listed = _cli(tmp_path, "--list", path=(site, EXAMPLES))
    block = listed.stdout.split("libraries (verify-parity --library NAME):")[1]
    assert any(line.split()[:3] == ["inhouse-moe", "example", "yes"] for line in block.splitlines()), block
    done = _cli(tmp_path, "--library", "inhouse-moe", "-n", "2", "--json", path=(site, EXAMPLES))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["verdict"] for r in json.loads(done.stdout)["rows"]] == ["pass", "pass"]


@pytest.mark.multirank
def test_moebench_testing_runs_an_adapter_in_a_libraries_own_suite(monkeypatch):
    sys.path.insert(0, str(EXAMPLES))
    sys.path.insert(0, str(REPO / "tests" / "faults"))
    try:
        import inhouse_faults
        from inhouse_moe.adapter import ADAPTER

        from moebench.testing import assert_rows_pass, run_rows

        assert_rows_pass(run_rows(ADAPTER, world_size=2))
        inhouse_faults.FAULTS["expert-grads-summed"](monkeypatch.setattr)
        records = run_rows(ADAPTER, world_size=2, rows=["*/a2a-E=W/*"])
        assert [r["diagnosis_name"] for r in records] == ["uniform-scale"]
        with pytest.raises(AssertionError, match="1 of 1 row"):
            assert_rows_pass(records)
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.path.remove(str(REPO / "tests" / "faults"))
