"""moebench/constraints.txt: its parser, env-check's drift row (with faked installed versions), the real CLI's JSON,
and that every dependency pyproject names (torch aside) is pinned in it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.envcheck import constraints
from moebench.envcheck.check import OK, PLATFORM, SKIP, WARN
from moebench.envcheck.constraints import RUNTIME, TRANSITIVE, canonical_name, judge, parse_constraints

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "moebench" / "constraints.txt"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_name(req: str) -> str:
    return canonical_name(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


# -- the parser


def test_parser_reads_pins_and_skips_comments_and_blank_lines():
    text = """# header
# torch is pinned by TORCH_SPEC

typer==0.29.2
dm_tree==0.1.10   # inline comment
  DeepSpeed == 0.19.8
"""
    assert parse_constraints(text) == {"typer": "0.29.2", "dm-tree": "0.1.10", "deepspeed": "0.19.8"}


@pytest.mark.parametrize("name, canonical", [
    ("dm_tree", "dm-tree"), ("dm-tree", "dm-tree"), ("DM.Tree", "dm-tree"), ("typing_extensions", "typing-extensions"),
    ("pydantic__core", "pydantic-core"),
])
def test_names_are_canonicalised(name, canonical):
    assert canonical_name(name) == canonical


@pytest.mark.parametrize("line", ["typer>=0.29", "typer", "typer==", "-r other.txt", "rich[jupyter]==15.0.0",
                                  "numpy==2.4.6 ; python_version < '3.12'", "==1.0"])
def test_parser_rejects_anything_but_name_equals_version(line):
    with pytest.raises(ValueError, match="line 2"):
        parse_constraints(f"# header\n{line}\n")


def test_parser_rejects_a_package_pinned_twice_under_two_spellings():
    with pytest.raises(ValueError, match="dm-tree is pinned twice"):
        parse_constraints("dm-tree==0.1.10\ndm_tree==0.1.9\n")


def test_requirement_roles_from_moebench_metadata():
    roles = constraints.requirement_roles(
        ["torch>=2.2", "dm_tree>=0.1.8", 'pytest>=7.4; extra == "test"', "ruff>=0.17 ; extra == 'test'"])
    assert roles == {"torch": RUNTIME, "dm-tree": RUNTIME, "pytest": "extra 'test'", "ruff": "extra 'test'"}


# -- the verdicts, with the installed-version lookup faked


PINS = {"deepspeed": "0.19.8", "dm-tree": "0.1.10", "pytest": "9.2.0", "pydantic": "2.14.3"}
ROLES = {"deepspeed": RUNTIME, "dm-tree": RUNTIME, "pytest": "extra 'test'"}


def test_ok_when_every_installed_version_equals_its_pin():
    verdicts = judge(PINS, PINS.get, ROLES)
    assert [v.status for v in verdicts] == [OK] * 4
    check = constraints.verdict_check(verdicts, "moebench/constraints.txt")
    assert check.id == "platform.constraints" and check.section == PLATFORM
    assert check.status == OK and check.hint == ""
    assert check.found == "4 of 4 pinned packages at the pinned version"


def test_equal_versions_are_compared_as_versions():
    assert constraints.same_version("1.0", "1.0.0")
    assert not constraints.same_version("0.19.8", "0.19.9")


def test_warn_with_the_fix_when_a_version_differs():
    installed = dict(PINS, deepspeed="0.20.1")
    verdicts = judge(PINS, installed.get, ROLES)
    by_name = {v.name: v for v in verdicts}
    assert by_name["deepspeed"].status == WARN
    assert by_name["deepspeed"].reason == "drift: found 0.20.1, constraints pin 0.19.8"
    assert by_name["dm-tree"].status == OK
    check = constraints.verdict_check(verdicts, "moebench/constraints.txt", python=".venv/bin/python")
    assert check.status == WARN
    assert check.found.startswith("drift: deepspeed found 0.20.1, constraints pin 0.19.8; 3 of 4 pinned packages at")
    assert check.hint.startswith("`.venv/bin/python -m pip install -c moebench/constraints.txt deepspeed`")
    assert "make install" in check.hint
    assert check.data["drift"] == ["deepspeed"] and check.data["missing"] == []


def test_missing_optional_package_is_skipped_with_the_reason_and_a_missing_runtime_one_warns():
    installed = {"dm-tree": "0.1.10"}
    by_name = {v.name: v for v in judge(PINS, installed.get, ROLES)}
    assert by_name["pytest"].status == SKIP
    assert by_name["pytest"].reason == "not installed (optional: extra 'test' of moebench)"
    assert by_name["pydantic"].status == SKIP and by_name["pydantic"].role == TRANSITIVE
    assert by_name["deepspeed"].status == WARN and "runtime dependency" in by_name["deepspeed"].reason
    check = constraints.verdict_check(list(by_name.values()), "c.txt")
    assert check.status == WARN and "missing: deepspeed" in check.found
    assert "not installed (optional): pytest, pydantic" in check.found


def test_check_reads_the_shipped_file_and_fakes_drift_through_the_lookup(monkeypatch):
    pins = parse_constraints(SHIPPED.read_text())
    fake = dict(pins, numpy="1.26.4")
    monkeypatch.setattr(constraints, "installed_version", fake.get)
    [check] = constraints.checks()
    assert check.status == WARN, check.found
    assert check.data["drift"] == ["numpy"]
    assert "numpy found 1.26.4, constraints pin " + pins["numpy"] in check.found
    assert check.data["file"].endswith("constraints.txt")
    assert "pip install -c " in check.hint and check.hint.rstrip().endswith("make install` on a fresh venv)")


def test_only_optional_packages_missing_is_ok(monkeypatch):
    pins = parse_constraints(SHIPPED.read_text())
    monkeypatch.setattr(constraints, "installed_version", lambda name: None if name == "ruff" else pins[name])
    monkeypatch.setattr(constraints.importlib.metadata, "requires", lambda dist: ['ruff>=0.17; extra == "test"'])
    [check] = constraints.checks()
    assert check.status == OK and "not installed (optional): ruff" in check.found


# -- the real CLI


def _moebench_cmd() -> list[str]:
    script = Path(sys.executable).parent / "moebench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "moebench"]


def test_check_is_in_the_real_clis_json(tmp_path):
    proc = subprocess.run([*_moebench_cmd(), "env-check", "--json", "--no-probe", "--results-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode in (0, 1) and proc.stdout.startswith("{"), proc.stderr
    doc = json.loads(proc.stdout)
    row = next(c for c in doc["checks"] if c["id"] == "platform.constraints")
    assert row["section"] == PLATFORM and row["status"] in (OK, WARN)
    names = [p["name"] for p in row["data"]["packages"]]
    assert names == list(parse_constraints(SHIPPED.read_text()))
    assert row["data"]["file"] == "moebench/constraints.txt"


# -- the file itself: one source, every dependency pinned, torch never


def test_every_pyproject_dependency_except_torch_is_pinned():
    project = _pyproject()["project"]
    pins = parse_constraints(SHIPPED.read_text())
    wanted = [_requirement_name(r) for r in project["dependencies"]]
    wanted += [_requirement_name(r) for r in project["optional-dependencies"]["test"]]
    assert "torch" in wanted
    missing = [n for n in wanted if n != "torch" and n not in pins]
    assert not missing, f"add {missing} to moebench/constraints.txt (versions from `.venv/bin/pip freeze`)"
    assert "torch" not in pins, "torch is pinned by the Makefile's TORCH_SPEC, not by the constraints file"


def test_the_makefile_and_the_wheel_use_the_one_shipped_file():
    assert "constraints.txt" in _pyproject()["tool"]["setuptools"]["package-data"]["moebench"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS\s*\?=\s*moebench/constraints\.txt$", makefile, re.MULTILINE)
    assert "$(if $(CONSTRAINTS),-c $(CONSTRAINTS))" in makefile
    assert not (ROOT / "constraints.txt").exists(), "keep one constraints file: moebench/constraints.txt"
    shipped = constraints.importlib.resources.files("moebench").joinpath(constraints.CONSTRAINTS_FILE)
    assert shipped.read_text() == SHIPPED.read_text()
