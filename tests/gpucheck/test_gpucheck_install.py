"""`make gpu-check`'s install (moebench.gpucheck.install): torch is never installed (pinned to the one
the interpreter has), the other pins only apply to what is missing, and WHEELS= installs offline from
a wheel folder; a real offline install into a venv that sees its interpreter's torch."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from moebench.gpucheck import install


def _wheel(folder: Path, name: str, version: str = "1.0") -> Path:
    """A pure-Python wheel made by hand (no pip download, no network): one module."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: moebench-test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def _project(folder: Path, *deps: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "gpu-check-probe"\nversion = "0.1"\ndependencies = {list(deps)!r}\n'
        '[tool.setuptools]\npy-modules = ["gpu_check_probe"]\n'.replace("'", '"'))
    (folder / "gpu_check_probe.py").write_text("OK = True\n")
    return folder


def test_torch_is_pinned_to_the_interpreters_and_other_pins_apply_to_what_is_missing():
    have = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "typer": "0.20.0"}
    lines = ["numpy==2.4.6", "dm-tree==0.1.10", "Typer==0.29.2", "torch==2.13.0", "deepspeed==0.19.8"]
    assert install.gpu_constraints(have, lines) == ["torch==2.11.0+cu130", "dm-tree==0.1.10", "deepspeed==0.19.8"]
    with pytest.raises(install.InstallError, match="has no torch"):
        install.gpu_constraints({"numpy": "2"}, lines)


def test_the_wheel_folder_is_checked_first(tmp_path):
    with pytest.raises(install.InstallError, match="is not a folder"):
        install.check_wheels(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(install.InstallError, match="holds no .whl file"):
        install.check_wheels(str(tmp_path / "empty"))
    _wheel(tmp_path / "w", "torch", "2.13.0")
    with pytest.raises(install.InstallError, match="torch comes from the machine"):
        install.check_wheels(str(tmp_path / "w"))


def test_offline_commands_never_reach_an_index(tmp_path):
    _wheel(tmp_path / "wheels", "dummydep")
    cmds = install.install(python=sys.executable, venv=str(tmp_path / "v"), wheels=str(tmp_path / "wheels"),
                           dry_run=True)
    assert cmds[0] == [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "v")]
    pip = cmds[-1]
    assert pip[:4] == [str(tmp_path / "v" / "bin" / "python"), "-m", "pip", "install"]
    assert pip[pip.index("--find-links") + 1] == str(tmp_path / "wheels")
    assert {"--no-index", "--no-build-isolation", "-c"} <= set(pip) and pip[-2:] == ["-e", "."]
    assert not (tmp_path / "v").exists()  # a dry run creates nothing
    online = install.install(python=sys.executable, venv="", wheels=None, dry_run=True)
    assert len(online) == 1 and "--no-index" not in online[0] and online[0][0] == sys.executable


def test_an_existing_folder_that_is_not_a_venv_is_refused(tmp_path):
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "notes.txt").write_text("mine")
    with pytest.raises(install.InstallError, match="is not a virtual environment"):
        install.install(python=sys.executable, venv=str(tmp_path / "v"), dry_run=True)


def test_an_offline_install_from_a_wheel_folder_sees_the_interpreters_torch(tmp_path):
    wheels = tmp_path / "wheels"
    _wheel(wheels, "dummydep")
    project = _project(tmp_path / "proj", "dummydep", "torch>=1")
    venv = tmp_path / "venv"
    said = []
    install.install(python=sys.executable, venv=str(venv), wheels=str(wheels), project=str(project),
                    editable=False, echo=said.append)
    assert said[0].endswith(f"venv --system-site-packages --without-pip {venv}")
    code = "import dummydep, gpu_check_probe, torch; print(torch.__version__); print(dummydep.__file__)"
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", code],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    version, where = probe.stdout.split()
    assert version == torch.__version__  # the interpreter's own torch, not a download
    assert where.startswith(str(venv))    # what was missing landed in the venv
    assert (venv / install.PIN_FILE).read_text().splitlines()[0] == f"torch=={torch.__version__}"

    missing = _project(tmp_path / "proj2", "not-in-the-folder")
    with pytest.raises(install.InstallError, match="not-in-the-folder") as info:
        install.install(python=sys.executable, venv=str(venv), wheels=str(wheels), project=str(missing),
                        editable=False, echo=said.append)
    assert info.value.exit_code == 1 and f"WHEELS={wheels}" in str(info.value)
