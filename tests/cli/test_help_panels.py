"""The help reads by what the reader is doing: verify-parity's options in panels (the built-in checks, a library,
your launch, your layer, resume and repro, output and limits), every default shown one way, choices in the docs'
casing, and one convention for every list-valued flag (comma-separated, or the flag repeated: the same)."""

from __future__ import annotations

import re

import pytest

# typer >= 0.29 vendors click (moebench/cli/app.py)
import typer._click as click
import typer.main
from typer.testing import CliRunner

from moebench.cli import parity
from moebench.cli.app import app
from moebench.cli.help import LISTS, join_repeated
from moebench.errors import UserError

PANELS = ["The built-in checks", "A library", "Your launch (read by the framework's own parser)", "Your layer",
          "Resume and repro", "Output and limits"]


def _command(*path: str):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _help(*path: str, width: int = 80) -> str:
    command = _command(*path)
    ctx = click.Context(command, info_name=path[-1], terminal_width=width, max_content_width=width)
    return command.get_help(ctx)


def _panels(text: str) -> dict[str, list[str]]:
    out, current = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":") and not line.startswith("Usage"):
            current = out.setdefault(line[:-1], [])
        elif current is not None and re.match(r"  (-\w, )?--[\w-]+", line):
            current.append(re.match(r"  (?:-\w, )?(--[\w-]+)", line).group(1))
    return out


def test_verify_parity_help_groups_its_options_by_what_you_are_doing():
    panels = _panels(_help("verify-parity"))
    assert [p for p in panels if p in PANELS] == PANELS
    assert panels["The built-in checks"] == ["--checks", "--tolerance", "--impl"]
    assert panels["A library"] == ["--library", "--row"]
    assert panels["Your launch (read by the framework's own parser)"] == [
        "--ds-config", "--hf-config", "--recipe", "--torchtitan-args", "--allow-import"]
    assert panels["Your layer"] == ["--adapter"]
    assert panels["Resume and repro"] == ["--resume", "--repro"]
    assert "--json" in panels["Output and limits"] and "--help" == panels["Output and limits"][-1]


def test_the_summary_says_what_it_checks_before_the_exit_codes():
    text = _help("verify-parity")
    summary = " ".join(text.split("\n\n")[1].split())
    assert "against the same mathematics on one process" in summary and "exit" not in summary.lower()
    assert "Exit status: 0" in text


def test_impl_and_adapter_say_what_tells_them_apart():
    options = {p.opts[0]: p.help for p in _command("verify-parity").params if p.param_type_name == "option"}
    assert "inside a built-in check" in options["--impl"]
    assert "whole MoE layer" in options["--adapter"]


@pytest.mark.parametrize("path", [("verify-parity",), ("run", "fastmoe"), ("run", "deepspeed"), ("bench",),
                                  ("report",), ("env-check",), ("runs",), ("gpu-check",)])
def test_every_default_reads_one_way(path):
    text = _help(*path, width=200)
    assert "[default: (" not in text
    assert all(len(line) <= 80 for line in _help(*path).splitlines())


def test_choices_are_shown_as_the_docs_spell_them():
    assert "--noisy-gate-policy none|jitter|rsample" in " ".join(_help("run", "deepspeed", width=200).split())


@pytest.mark.parametrize("path", [("verify-parity",), ("run", "deepspeed"), ("bench",)])
def test_the_list_convention_is_said_where_a_list_flag_is(path):
    assert " ".join(LISTS.split()) in " ".join(_help(*path).split())


def test_a_repeated_comma_list_flag_joins():
    lists = {"--experts": "--experts", "--world-size": "--world-size", "-n": "--world-size"}
    assert join_repeated(["--experts", "4", "--quick", "--experts=8,16"], lists) == ["--experts", "4,8,16", "--quick"]
    assert join_repeated(["-n", "1", "--world-size", "2"], lists) == ["--world-size", "1,2"]
    assert join_repeated(["--experts", "4", "--", "--experts", "8"], lists) == ["--experts", "4", "--", "--experts",
                                                                                 "8"]
    assert join_repeated(["--tokens", "1", "--tokens", "2"], lists) == ["--tokens", "1", "--tokens", "2"]


def test_bench_takes_a_repeated_list_as_its_comma_list():
    command = _command("bench")
    ctx = command.make_context("bench", ["--experts", "4", "--experts", "8", "-n", "1", "-n", "2"])
    assert ctx.params["experts"] == "4,8" and ctx.params["world_size"] == "1,2"


def test_verify_parity_takes_commas_and_repeats_alike():
    assert parity._joined(["fairscale", "transformers"], "--library") == "fairscale,transformers"
    assert parity._joined(["fairscale,transformers"], "--library") == "fairscale,transformers"
    assert parity._joined([], "--library") is None
    assert parity._split(["a/*", "b/*,c/*"]) == ["a/*", "b/*", "c/*"]
    with pytest.raises(UserError, match="--checks: experts given twice"):
        parity._joined(["experts", "ddp-sgd,experts"], "--checks")


def test_a_name_given_twice_over_repeats_is_one_line_and_exit_2():
    result = CliRunner().invoke(app, ["verify-parity", "--checks", "experts", "--checks", "experts"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: --checks: experts given twice; name each once"], lines


def test_repeatable_flags_take_commas_too():
    ctx = _command("verify-parity").make_context(
        "verify-parity", ["--row", "a/*,b/*", "--row", "c/*", "--allow-import", "pkg.a,pkg.b"])
    assert ctx.params["row"] == ["a/*,b/*", "c/*"] and parity._split(ctx.params["row"]) == ["a/*", "b/*", "c/*"]
