"""Your own launch (moebench/libraries/setups.py): the setup flags as a registry the CLI, the Python API and the
docs read; which library each is read by; and the bad input every file flag refuses alike (a FIFO, /dev/zero, a
folder, a file past 1 MiB, bytes that are not UTF-8): one line naming the flag, exit 2, nothing under results/."""

from __future__ import annotations

import importlib
import os

import pytest
from typer.testing import CliRunner

import moebench
from moebench.cli.app import app
from moebench.cli.parity import BOUNDS
from moebench.errors import UserError
from moebench.libraries import setups
from moebench.libraries.registry import known
from moebench.libraries.verify import LibraryRequest, rerun_command

FILE_FLAGS = [s.flag for s in setups.SETUP_FLAGS if s.is_path]


def _cli(*args: str):
    return CliRunner().invoke(app, ["verify-parity", *args])


def _refused(result, flag: str, *words: str) -> str:
    line = result.output.strip()
    assert result.exit_code == 2, result.output
    assert len(line.splitlines()) == 1 and line.startswith(f"error: {flag}: "), line
    assert "Traceback" not in line and all(w in line for w in words), line
    return line


def test_every_setup_flag_is_a_cli_flag_an_api_argument_and_read_by_registered_libraries():
    """The registry is the one definition: each flag has its CLI option and bound, its LibraryRequest field and
    Python API argument, readers that resolve to functions, and implies a library that reads it."""
    import inspect

    api_args = inspect.signature(moebench.verify_parity).parameters
    for s in setups.SETUP_FLAGS:
        assert s.flag in BOUNDS and s.field in api_args and hasattr(LibraryRequest(), s.field)
        assert s.implies in s.readers and set(s.readers) <= set(known()), s
        for path in s.readers.values():
            module, _, attr = path.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), path


@pytest.mark.parametrize("flag", ["--hf-config", "--recipe", "--torchtitan-args"])
def test_a_setup_flag_no_given_library_reads_is_refused(tmp_path, flag):
    (tmp_path / "x").write_text("{}")
    value = "--module deepseek_v3" if flag == "--torchtitan-args" else str(tmp_path / "x")
    readers = " or ".join(setups.BY_FLAG[flag].readers)
    _refused(_cli("--library", "fairscale", f"{flag}={value}", "--results-dir", str(tmp_path / "r")), flag,
             f"is read by {readers}'s rows", f"drop {flag}")
    assert not (tmp_path / "r").exists()


def test_a_setup_flag_with_only_an_adapter_is_refused(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    _refused(_cli("--adapter", "my_pkg.moe:ADAPTER", "--hf-config", str(tmp_path / "c.json")), "--hf-config",
             "not an adapter's", "--library transformers")


def test_allow_import_without_a_recipe_or_torchtitan_args_is_refused(tmp_path):
    _refused(_cli("--library", "fairscale", "--allow-import", "my_pkg"), "--allow-import", "--recipe")
    with pytest.raises(UserError, match="--allow-import"):
        moebench.verify_parity(library="fairscale", allow_imports=["my_pkg"], results_dir=str(tmp_path))
    (tmp_path / "r.yaml").write_text("model: {}")
    _refused(_cli("--recipe", str(tmp_path / "r.yaml"), "--allow-import", "my pkg"), "--allow-import",
             "dotted module name")


def test_the_api_refuses_a_setup_argument_of_the_wrong_type(tmp_path):
    with pytest.raises(UserError, match="--torchtitan-args: torchtitan_args= takes a string"):
        moebench.verify_parity(torchtitan_args=["--module", "x"], results_dir=str(tmp_path))
    with pytest.raises(UserError, match="--hf-config: hf_config= takes a path"):
        moebench.verify_parity(hf_config=3, results_dir=str(tmp_path))


@pytest.fixture
def hostile_files(tmp_path):
    """name -> (path, the words its refusal says)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # 200 MB, sparse: nothing is written or read but the size
        f.truncate(200 * 1024 * 1024)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"model_type": "qwen3_moe", "name": "\xe9"}')
    folder = tmp_path / "folder.json"
    folder.mkdir()
    return {"fifo": (str(fifo), "not a regular file"), "dev-zero": ("/dev/zero", "not a regular file"),
            "200 MB": (str(big), "209,715,200 bytes"), "not UTF-8": (str(latin), "not UTF-8 text (at byte offset 37)"),
            "folder": (str(folder), "is a folder")}


@pytest.mark.parametrize("flag", FILE_FLAGS)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "200 MB", "not UTF-8", "folder"])
def test_every_file_flag_refuses_a_special_huge_or_binary_file_in_one_line(tmp_path, hostile_files, flag, kind):
    """Never read past the bound (a FIFO would block, /dev/zero never ends): one line, exit 2, no run folder."""
    path, words = hostile_files[kind]
    results = tmp_path / "results"
    line = _refused(_cli(flag, path, "-n", "2", "--results-dir", str(results)), flag, words)
    assert path in line or os.path.basename(path) in line
    assert not results.exists()


def test_a_failing_rows_rerun_command_carries_the_setup_its_library_reads(tmp_path):
    """The "rerun alone" line of a failing row gives back the same setup flags, absolute, and only those its
    library reads."""
    from types import SimpleNamespace

    ds, hf = tmp_path / "ds.json", tmp_path / "config.json"
    request = LibraryRequest(libraries=("autoep", "transformers"), ds_config=str(ds), hf_config=str(hf))
    prepared = SimpleNamespace(request=request, adapters=())
    config = SimpleNamespace(seed=0, tolerance="strict")
    autoep = rerun_command(prepared, {"library": "autoep", "world_size": 2, "check": "autoep/x/w2"}, config)
    assert f"--ds-config {ds}" in autoep and f"--hf-config {hf}" in autoep
    tf = rerun_command(prepared, {"library": "transformers", "world_size": 2, "check": "transformers/x/w2"}, config)
    assert f"--hf-config {hf}" in tf and "--ds-config" not in tf
    titan = LibraryRequest(libraries=("torchtitan",), torchtitan_args="--module deepseek_v3 --config x")
    line = rerun_command(SimpleNamespace(request=titan, adapters=()),
                         {"library": "torchtitan", "world_size": 4, "check": "torchtitan/y/w4"}, config)
    assert "--torchtitan-args '--module deepseek_v3 --config x'" in line


def test_list_and_the_row_hint_show_the_rows_of_the_users_setup(tmp_path):
    """`--list` with a setup flag lists the rows that setup gives (not the default matrix), and a --row that
    matches none points to that same listing."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"gradient_clipping": 0.5}')
    listed = _cli("--list", "--ds-config", str(ds), "-n", "2")
    assert listed.exit_code == 0, listed.output
    keys = [line.strip() for line in listed.output.splitlines()[1:]]
    assert keys == ["deepspeed/engine/zero0/ep=2/w2/ds-config", "deepspeed/engine/zero0/ep=1/w2/ds-config"]
    _refused(_cli("--ds-config", str(ds), "-n", "2", "--row", "nothing", "--results-dir", str(tmp_path / "r")),
             "--row", f"--list --library deepspeed --ds-config {ds} lists them")
