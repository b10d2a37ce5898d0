"""The root app: help, version, sub-commands composed from the registry."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from moebench import __version__, variants
from moebench.cli.app import app

runner = CliRunner()


def test_version_and_help():
    assert runner.invoke(app, ["--version"]).output.strip() == f"moebench {__version__}"
    out = runner.invoke(app, ["--help"]).output
    for command in ("env-check", "run", "verify-parity"):
        assert command in out


def test_run_lists_every_registered_variant():
    for flag in ("--list", "--list-names"):  # --list-names: the old spelling, hidden
        result = runner.invoke(app, ["run", flag])
        assert result.exit_code == 0
        assert result.output.split() == [v.name for v in variants.VARIANTS]


def test_unknown_command_is_a_usage_error():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "moebench", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"moebench {__version__}"


def test_flag_parsing_errors_are_one_line_and_exit_2():
    for args in (["run", "fastmoe", "--steps", "abc"], ["verify-parity", "-n", "abc"],
                 ["run", "fastmoe", "--no-such-flag"], ["env-check", "--probe-timeout", "x"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)


def test_results_dir_that_cannot_be_created_is_bad_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for command in (["run", "fastmoe"], ["env-check", "--no-probe"]):
        result = runner.invoke(app, [*command, "--results-dir", str(blocker)])
        assert result.exit_code == 2 and "--results-dir" in result.output
    result = runner.invoke(app, ["run", "fastmoe", "--results-dir", ""])
    assert result.exit_code == 2 and "--results-dir" in result.output


def test_ctrl_c_in_a_command_says_interrupted_and_exits_130(monkeypatch):
    from moebench import train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run_variant", interrupted)
    result = runner.invoke(app, ["run", "fastmoe"])
    assert result.exit_code == 130 and "interrupted" in result.output
