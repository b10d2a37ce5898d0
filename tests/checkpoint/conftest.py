"""Real checkpoints, made once per session by the frameworks themselves (each maker is a script run in a child:
two gloo ranks for DCP and DeepSpeed, W = 2 or 4 for the frameworks' own checkpointers, save_pretrained for Hugging
Face). Read-only: a test that breaks one copies it first (`broken_copy`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
MAKE_TIMEOUT_S = 600
"""A maker imports torch (and DeepSpeed or transformers) in two ranks: a minute on a busy 2-core machine."""


def _make(script: str, folder: Path, world: int | None = None) -> Path:
    done = folder / ".done"
    if not done.exists():
        size = [] if world is None else [str(world)]
        result = subprocess.run([sys.executable, str(HERE / script), str(folder), *size], capture_output=True,
                                text=True, timeout=MAKE_TIMEOUT_S)
        assert result.returncode == 0, f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        done.write_text("")
    return folder


@pytest.fixture(scope="session")
def dcp_folders(tmp_path_factory) -> Path:
    return _make("make_dcp.py", tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> Path:
    return _make("make_hf.py", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def ds_folders(tmp_path_factory) -> Path:
    return _make("make_deepspeed.py", tmp_path_factory.mktemp("deepspeed"))


@pytest.fixture(scope="session")
def megatron_folders(tmp_path_factory) -> Path:
    return _make("make_megatron.py", tmp_path_factory.mktemp("megatron"))


@pytest.fixture(scope="session")
def framework_folders(tmp_path_factory):
    """framework_folders(name, W) -> the folder `make_<name>.py` filled at world size W (autoep, torchtitan,
    automodel: each framework's own checkpointer), made once per session for each (name, W)."""
    made: dict[tuple[str, int], Path] = {}

    def folder(name: str, world: int) -> Path:
        if (name, world) not in made:
            made[name, world] = _make(f"make_{name}.py", tmp_path_factory.mktemp(f"{name}-w{world}"), world)
        return made[name, world]
    return folder


@pytest.fixture
def broken_copy(tmp_path_factory):
    """broken_copy(folder) -> a private copy of a made checkpoint, to damage (outside tmp_path, whose results files
    are checked against moebench's schemas: a model's config.json is none of moebench's)."""
    def copy(folder: Path) -> Path:
        target = tmp_path_factory.mktemp("broken") / folder.name
        shutil.copytree(folder, target, symlinks=True)
        return target
    return copy


def audit(*args: str) -> tuple[int, str, str, float]:
    """The real CLI, in process: (exit code, stdout, stderr, seconds)."""
    import time

    from typer.testing import CliRunner

    from moebench.cli.app import app

    start = time.monotonic()
    result = CliRunner().invoke(app, ["checkpoint", *[str(a) for a in args]])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr, time.monotonic() - start


def audit_json(*args: str) -> tuple[int, dict]:
    """--json: (exit code, the document)."""
    import json

    code, out, err, _ = audit(*args, "--json")
    assert code in (0, 1), f"exit {code}: {out[-500:]} {err[-500:]}"
    return code, json.loads(out)
