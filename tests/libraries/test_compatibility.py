"""The compatibility table (library x release x torch) is made from the adapters' own declarations: the docs hold
exactly what the code generates, every declared release names the test that measured it, and the pinned one is
what moebench/constraints.txt installs. env-check's frameworks section reads the same table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moebench.envcheck import frameworks
from moebench.libraries import compatibility, pins, registry
from moebench.libraries.spec import VERIFIED, Release

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "docs" / "libraries" / "README.md"
VERSION = re.compile(r"\b\d+\.\d+(?:\.\d+)?\b")


def _block(text: str) -> str:
    start = text.index(compatibility.BEGIN)
    body = text[text.index("\n", start) + 1:text.index(compatibility.END)]
    return body.strip()


def test_the_docs_hold_the_generated_table():
    assert _block(INDEX.read_text()) == compatibility.markdown(), (
        "docs/libraries/README.md's compatibility table is not the generated one: paste the output of "
        "`python -m moebench.libraries.compatibility` between its markers")


def test_a_table_edited_by_hand_is_caught():
    text = INDEX.read_text().replace("| verified |", "| refused |", 1)
    assert _block(text) != compatibility.markdown()


def test_every_library_pins_one_release_and_it_is_the_installed_pin():
    for name in registry.BUILTIN:
        adapter = registry.load(name)
        pinned = [r for r in adapter.compatibility if r.pinned]
        assert len(pinned) == 1, (name, pinned)
        assert pinned[0].versions == pins.pinned(adapter.dist_name or adapter.import_name), name


@pytest.mark.parametrize("name,release", compatibility.entries(),
                         ids=lambda v: v if isinstance(v, str) else v.versions)
def test_each_release_names_a_test_that_measures_it(name, release):
    if not release.measured_by:
        assert release.status != VERIFIED or not release.pinned, f"{name}'s pinned release names no test"
        return
    path = REPO / release.measured_by
    assert path.is_file(), f"{name} {release.versions}: {release.measured_by} does not exist"
    if release.pinned:
        return  # the default tier runs on the pinned release itself
    text = path.read_text()
    if "+" in release.versions:  # "0.19.8 + transformers 5.22.2": both releases named where they are measured
        assert all(v in text for v in VERSION.findall(release.versions)), release.versions
    else:
        assert any(compatibility.covers(release.versions, v) for v in VERSION.findall(text)), (
            f"{release.measured_by} measures no release that {name} {release.versions} covers")


@pytest.mark.parametrize("versions,version,expected", [
    ("0.19.8", "0.19.8", True), ("0.19.8", "0.19.7", False), ("0.19.0-0.19.7", "0.19.5", True),
    ("0.19.0-0.19.7", "0.19.8", False), ("0.19.0-0.19.7", "0.19.10", False), ("0.9.0", "0.19.0", False),
    ("<= 0.14.0", "0.13.5", True), ("<= 0.14.0", "0.14.3", False), ("4.x", "4.57.1", True), ("4.x", "5.0.0", False),
    ("5.20-5.22", "5.22.2", True), ("5.20-5.22", "5.23.0", False), ("5.0-5.16", "5.3.0", True),
    ("0.19.8 + transformers 5.22.2", "0.19.8", False), ("2.13.0", "2.13.0+cpu", True), ("0.7.0", "", False),
])
def test_which_release_covers_a_version(versions, version, expected):
    assert compatibility.covers(versions, version) is expected


def test_the_list_marks_the_installed_releases_only():
    installed = {name: r.versions for name, r in compatibility.entries() if r.pinned}
    lines = compatibility.console_lines(installed, 80)
    marked = [line for line in lines if line.endswith("<- installed")]
    assert len(marked) == len(installed), marked
    assert all(len(line) <= 80 for line in lines)


def _fake(monkeypatch, name: str, version: str | None):
    adapter = registry.load(name)
    monkeypatch.setattr(type(adapter), "version", lambda self: version)
    return adapter


def _by_id(checks) -> dict:
    return {c.id: c for c in checks}


def test_env_check_says_what_moebench_measured_on_the_installed_release(monkeypatch):
    _fake(monkeypatch, "megatron", "0.16.1")
    check = _by_id(frameworks.checks("2.13.0+cpu", requirement=lambda dist: ">=2.6.0"))["frameworks.megatron"]
    assert check.status == "ok" and "verified (pinned)" in check.found and check.data["release"] == "0.16.1"


def test_env_check_warns_on_a_release_moebench_has_not_measured(monkeypatch):
    _fake(monkeypatch, "fairscale", "0.3.9")
    check = _by_id(frameworks.checks("2.13.0", requirement=lambda dist: ""))["frameworks.fairscale"]
    assert check.status == "warn" and "has not measured" in check.found and "0.4.13" in check.hint


def test_env_check_warns_on_a_release_moebench_cannot_run(monkeypatch):
    _fake(monkeypatch, "deepspeed", "0.14.0")
    check = _by_id(frameworks.checks("2.13.0", requirement=lambda dist: ""))["frameworks.deepspeed"]
    assert check.status == "warn" and check.found.startswith("0.14.0: skipped: ") and "0.19.8" in check.hint


def test_env_check_warns_when_the_framework_needs_another_torch(monkeypatch):
    _fake(monkeypatch, "megatron", "0.16.1")
    check = _by_id(frameworks.checks("2.13.0+cpu", requirement=lambda dist: ">=2.14"))["frameworks.megatron"]
    assert check.status == "warn" and "declares torch >=2.14" in check.found and "TORCH_SPEC" in check.hint
    ok = _by_id(frameworks.checks("2.15.0", requirement=lambda dist: ">=2.14"))["frameworks.megatron"]
    assert ok.status == "ok"


def test_env_check_warns_below_a_releases_torch_floor(monkeypatch):
    """torchtitan 0.3.0's default backend needs torch >= 2.14 (its trainer's fully_shard): a warn with the fix below
    it, ok from it on; the --list note says the same where the installed torch's FSDP lacks it."""
    _fake(monkeypatch, "torchtitan", "0.3.0")
    check = _by_id(frameworks.checks("2.13.0+cpu", requirement=lambda dist: ""))["frameworks.torchtitan"]
    assert check.status == "warn" and "spmd_types backend" in check.found and "needs torch >= 2.14" in check.found
    assert "TORCH_SPEC" in check.hint
    ok = _by_id(frameworks.checks("2.15.0", requirement=lambda dist: ""))["frameworks.torchtitan"]
    assert ok.status == "ok", ok.found


def test_env_check_skips_a_framework_that_is_not_installed(monkeypatch):
    _fake(monkeypatch, "torchtitan", None)
    check = _by_id(frameworks.checks("2.13.0"))["frameworks.torchtitan"]
    assert check.status == "skip" and "pip install" in check.hint


def test_a_framework_declaring_torch_only_for_an_extra_needs_none():
    assert frameworks.torch_requirement("nonexistent-dist-xyz") is None
    assert frameworks.torch_meets(">=2.6", "2.13.0+cpu") and not frameworks.torch_meets(">=2.14", "2.13.0+cpu")


def test_a_release_with_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Release(versions="1.0", status="works", result="-")


def test_list_json_carries_the_table():
    from moebench.cli.parity_console import compatibility_records

    records = compatibility_records()
    assert len(records) == len(compatibility.entries())
    assert {"library", "versions", "status", "result", "pinned", "torch", "measured_by"} <= set(records[0])


def test_a_release_measured_on_another_torch_is_what_that_torch_gets():
    automodel = registry.load("automodel")
    on_215 = compatibility.of_installed(automodel, "0.7.0", "2.15.0+cu132")
    assert on_215.torch == "2.15.0" and on_215.status == "skipped" and not on_215.pinned
    assert compatibility.of_installed(automodel, "0.7.0", "2.13.0+cpu").pinned
    assert compatibility.of_installed(automodel, "0.7.0", "2.14.1").pinned  # no entry for 2.14: the pinned torch's


def test_env_check_says_a_release_does_not_run_on_this_torch(monkeypatch):
    _fake(monkeypatch, "automodel", "0.7.0")
    check = _by_id(frameworks.checks("2.15.0+cu132", requirement=lambda dist: ">=2.8.0"))["frameworks.automodel"]
    assert check.status == "warn" and "FSDPParam.to_accumulated_grad_if_needed" in check.found
    assert "TORCH_SPEC=torch==2.13.0" in check.hint
