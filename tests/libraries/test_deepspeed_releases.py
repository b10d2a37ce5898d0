"""Which DeepSpeed runs: the version of the copy `import deepspeed` loads (a `pip install --target` copy
or a checkout first on PYTHONPATH), and `--list`'s one line when that copy does not import here.

Fake DeepSpeed trees stand in for real releases (fast); tests/libraries/test_deepspeed_old_releases.py
(slow tier) runs real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.libraries import deepspeed as ds_adapter
from moebench.libraries.deepspeed import DeepSpeed, source_version

REPO = Path(__file__).resolve().parents[2]


def _fake_tree(root: Path, *, version: str, dist_info: bool, init: str = "") -> Path:
    """A `deepspeed` package under root, as `pip install --target root` lays it out (dist_info) or as a
    source checkout does (only git_version_info_installed.py records its version)."""
    package = root / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    (package / "git_version_info_installed.py").write_text(f"version='{version}'\ngit_hash='unknown'\n")
    if dist_info:
        meta = root / f"deepspeed-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
        (meta / "RECORD").write_text("deepspeed/__init__.py,,\n")
    return package


@pytest.fixture
def first_on_path(monkeypatch):
    """Put a folder first on sys.path, with no `deepspeed` imported, for the test's duration."""
    def put(folder: Path) -> None:
        monkeypatch.syspath_prepend(str(folder))
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            monkeypatch.delitem(sys.modules, name)
    return put


@pytest.mark.parametrize("dist_info", [True, False], ids=["pip-target", "checkout"])
def test_version_is_the_one_of_the_copy_that_imports(tmp_path, first_on_path, dist_info):
    _fake_tree(tmp_path, version="0.15.4", dist_info=dist_info)
    first_on_path(tmp_path)
    assert DeepSpeed().version() == "0.15.4"


def test_source_version_reads_the_build_record_or_version_txt(tmp_path):
    package = _fake_tree(tmp_path / "a", version="0.16.9", dist_info=False)
    assert source_version(package) == "0.16.9"
    (package / "git_version_info_installed.py").unlink()
    (tmp_path / "a" / "version.txt").write_text("0.17.1\n")
    assert source_version(package) == "0.17.1"
    (tmp_path / "a" / "version.txt").unlink()
    assert source_version(package) is None


def test_list_says_why_a_deepspeed_that_does_not_import_cannot_run(tmp_path):
    _fake_tree(tmp_path, version="0.14.0", dist_info=True, init=(
        "raise ValueError('CPU_Accelerator requires intel_extension_for_pytorch, which is not installed "
        "on this system.')\n"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--list"], env=env, text=True,
                         capture_output=True, timeout=120).stdout
    block = out.split("libraries (verify-parity --library NAME):")[1]
    line = next(line for line in block.splitlines() if line.startswith("deepspeed "))
    assert line.split()[:3] == ["deepspeed", "0.14.0", "no"], line
    assert "does not import here: ValueError: CPU_Accelerator requires" in " ".join(block.split())
    run = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "deepspeed"], env=env,
                         text=True, capture_output=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().startswith(
        "error: --library: deepspeed cannot run here: does not import here: ValueError"), run.stderr


def test_the_import_probe_is_bounded(monkeypatch):
    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(ds_adapter.subprocess, "run", hangs)
    ds_adapter._import_problem.cache_clear()
    try:
        assert ds_adapter._import_problem("/nowhere/deepspeed/__init__.py") == (
            f"importing it took more than {ds_adapter.IMPORT_PROBE_TIMEOUT_S:.0f} s")
    finally:
        ds_adapter._import_problem.cache_clear()
