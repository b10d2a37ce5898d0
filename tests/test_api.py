"""The Python API (moebench.run / verify_parity / env_check): the same documents as `--json`, the same
validation as the CLI, and `import moebench` stays cheap (issue 18, item 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import warmcli

import moebench
from moebench.errors import UserError


def _cli_json(*args: str, results_dir) -> dict:
    out = warmcli.run([*args, "--results-dir", str(results_dir), "--json"], timeout=300)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


def _cli_error(*args: str, results_dir) -> str:
    out = warmcli.run([*args, "--results-dir", str(results_dir)], timeout=120)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    return line.removeprefix("error: ")


def _runs(root) -> list:
    return sorted(p for p in root.glob("*/*") if p.is_dir()) if root.exists() else []


def test_import_moebench_loads_no_torch():
    code = ("import sys, moebench; moebench.run; "
            "print(sorted(m for m in ('torch', 'typer', 'moebench.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # moebench.run resolves to the facade without importing torch or the CLI: the work happens on call
    assert out.stdout.split("\n")[0] == "['moebench.api']", out.stderr


def test_run_returns_what_run_json_prints(tmp_path):
    settings = {"moe_impl": "reference", "steps": 4, "experts": 4, "seed": 3}
    api = moebench.run("fastmoe", "quick", results_dir=str(tmp_path / "api"), **settings)
    cli = _cli_json("run", "fastmoe", "--preset", "quick", "--moe-impl", "reference", "--steps", "4",
                    "--experts", "4", "--seed", "3", results_dir=tmp_path / "cli")
    assert api["status"] == cli["status"] == "ok"
    assert set(api) == set(cli)
    assert set(api["params"]) == set(cli["params"])
    # the same config reached the model: the same parameter count and the same data, hence the same loss
    assert api["params"] == cli["params"]
    assert api["steps"] == cli["steps"] == 4
    api_config = json.loads((Path(api["run_path"]) / "config.json").read_text())
    cli_config = json.loads((Path(cli["run_path"]) / "config.json").read_text())
    assert api_config == cli_config


def test_verify_parity_returns_what_verify_parity_json_prints(tmp_path):
    api = moebench.verify_parity(world_size=2, checks=["all-gather-variable"], results_dir=str(tmp_path / "api"))
    cli = _cli_json("verify-parity", "-n", "2", "--checks", "all-gather-variable", results_dir=tmp_path / "cli")
    assert api["status"] == cli["status"] == "ok"
    assert set(api) == set(cli)
    assert [c["name"] for c in api["checks"]] == [c["name"] for c in cli["checks"]] == ["all-gather-variable"]
    assert set(api["checks"][0]) == set(cli["checks"][0])


def test_env_check_returns_what_env_check_json_prints(tmp_path):
    api = moebench.env_check(probe=False, results_dir=str(tmp_path / "api"))
    cli = _cli_json("env-check", "--no-probe", results_dir=tmp_path / "cli")
    assert set(api) == set(cli)
    assert [c["id"] for c in api["checks"]] == [c["id"] for c in cli["checks"]]


@pytest.mark.parametrize("call, flags", [
    (lambda root: moebench.run("fastmoe", experts=0, results_dir=root), ["run", "fastmoe", "--experts", "0"]),
    (lambda root: moebench.verify_parity(world_size=0, results_dir=root), ["verify-parity", "--world-size", "0"]),
    (lambda root: moebench.env_check(probe_timeout_s=0, results_dir=root), ["env-check", "--probe-timeout", "0"]),
], ids=["experts-0", "world-size-0", "probe-timeout-0"])
def test_bad_input_is_the_clis_user_error_and_writes_nothing(tmp_path, call, flags):
    root = tmp_path / "results"
    with pytest.raises(UserError) as caught:
        call(str(root))
    assert str(caught.value) == _cli_error(*flags, results_dir=root)
    assert _runs(root) == []


def test_bad_python_values_are_user_errors(tmp_path):
    root = str(tmp_path / "results")
    with pytest.raises(UserError, match="no setting 'expert'.*experts"):
        moebench.run("fastmoe", expert=4, results_dir=root)
    with pytest.raises(UserError, match="--steps: must be int, got True"):
        moebench.run("fastmoe", steps=True, results_dir=root)
    with pytest.raises(UserError, match="--lr: must be float, got '0.1'"):
        moebench.run("fastmoe", lr="0.1", results_dir=root)
    with pytest.raises(UserError, match="unknown variant 'fast'"):
        moebench.run("fast", results_dir=root)
    with pytest.raises(UserError, match="--checks: unknown check"):
        moebench.verify_parity(checks="all-gather-variable,nope", results_dir=root)
    assert _runs(tmp_path / "results") == []


CLI_ONLY = {"--list", "--json", "--help", "--backend"}
"""verify-parity's options with no API argument: what to print (the API returns the document) and a hidden alias."""
API_NAME = {"--timeout": "timeout_s", "--impl": "impls", "--row": "rows", "--json-full": "full",
            "--allow-import": "allow_imports"}
"""Where the argument is not the flag without its dashes."""


def test_the_api_takes_every_option_of_verify_parity():
    import inspect

    import typer

    from moebench.cli.app import app

    root = typer.main.get_command(app)
    command = root.get_command(None, "verify-parity")
    flags = {name for p in command.params if p.param_type_name == "option" for name in p.opts if name.startswith("--")}
    wanted = {API_NAME.get(f, f[2:].replace("-", "_")) for f in flags - CLI_ONLY}
    api = set(inspect.signature(moebench.verify_parity).parameters)
    assert wanted <= api, sorted(wanted - api)
    assert api - wanted == set(), sorted(api - wanted)  # and nothing the command does not have


@pytest.mark.multirank
def test_the_api_verifies_a_library_like_the_command(tmp_path):
    pytest.importorskip("fairscale")
    doc = moebench.verify_parity(library="fairscale", world_size=2, results_dir=str(tmp_path),
                                 rows=["*/a2a-E=W/*"])
    assert [(r["library"], r["world_size"], r["verdict"]) for r in doc["rows"]] == [("fairscale", 2, "pass")]
    assert doc["comparisons_printed"] == "failed" and all(c["comparisons"] == [] for c in doc["checks"])
    with pytest.raises(UserError, match="--row: matches no row: nothing/here"):
        moebench.verify_parity(library="fairscale", world_size=2, results_dir=str(tmp_path), rows=["nothing/here"])
    with pytest.raises(UserError, match="--resume: applies to library rows"):
        moebench.verify_parity(resume=True, results_dir=str(tmp_path))
    assert len(_runs(tmp_path)) == 1  # the refusals wrote nothing


@pytest.mark.parametrize("name", ["run", "verify_parity", "env_check", "checkpoint"])
def test_the_api_doc_gives_each_functions_whole_signature(name):
    """docs/api.md's heading of each function names every parameter it takes, in order."""
    import inspect
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    heading = re.search(rf"^## `moebench\.{name}\((.*)\)`$", text, re.M)
    assert heading, f"docs/api.md has no heading for moebench.{name}"
    documented = [re.split(r"[=\s]", p.strip().lstrip("*"))[0] for p in heading.group(1).split(",")]
    documented = [p for p in documented if p]
    actual = [p.name for p in inspect.signature(getattr(moebench, name)).parameters.values()]
    assert documented == actual, (documented, actual)
