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
    result = runner.invoke(app, ["run", "--list-names"])
    assert result.exit_code == 0
    assert result.output.split() == [v.name for v in variants.VARIANTS]


def test_unknown_command_is_a_usage_error():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "moebench", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"moebench {__version__}"
