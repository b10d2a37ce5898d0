"""Hostile input generated from the CLI itself: every command and option of the Typer app gets the
hostile values of its kind, so a new flag is covered the day it is added.

Each option declares its bound beside its definition (moebench.bounds: a number's range, a name's
length, a path's kind, a list's items; or a Literal of choices; or it is a bare on/off flag). For
every hostile value its bound refuses, the real command is run in-process and must: exit 2 within
a few seconds, print at most a couple of lines, no traceback, name the flag, and create nothing (the
steps that would do work or write are replaced by a tripwire). A value the bound accepts (0 for a
seed, a folder for --results-dir) is accepted by declaration, not by a special case here.
"""

from __future__ import annotations

import json
import os
import time
import typing

import pytest
import typer.main
from typer.testing import CliRunner

from moebench import bounds
from moebench.cli.app import app

pytestmark = pytest.mark.faults

CASE_SECONDS = 5.0
"""A refusal comes before any work: seconds, not minutes (the first case of a command pays its imports)."""
MAX_LINES = 2
"""One `error:` line; a second is allowed for a wrapped message, never a traceback or a table."""
HUGE_INT = "9" * 23
LONG = "a" * 5000

NUMBER_VALUES = ["0", "-1", HUGE_INT, str(2**63), "1e308", "inf", "-inf", "nan", "abc", "1.5", ""]
NAME_VALUES = ["", LONG, "bogus-unknown", "a\nb", "../x", " "]
TEXT_VALUES = ["", LONG, "a\nb", "bogus"]
CHOICE_VALUES = ["", "bogus", LONG]


def _path_values(fixtures) -> list[str]:
    values = [str(fixtures["file"]), str(fixtures["dir"]), str(fixtures["file"] / "sub"), "/" + LONG,
              "/tmp/" + "b" * 300, "a\nb", ""]
    if os.geteuid() != 0:  # root writes anywhere: an unwritable folder cannot be made for it
        values.append(str(fixtures["unwritable"] / "sub"))
    return values


def _list_values(bound: bounds.Items) -> list[str]:
    values = ["", LONG, "bogus", ",,", f"{bound.example},{bound.example}", ",".join(["1"] * 300)]
    if isinstance(bound.item, bounds.Number):
        values += ["0", "-1", HUGE_INT, "1e308", "nan", "1,abc"]
    return values


def _walk(command, path=()):
    """(command path, click command) for the root group and every command and group under it."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, path + (name,))


def _kind(param) -> tuple[str, object]:
    """What an option declares: ("flag", None), ("bound", Bound) or ("choice", choices); ("none", None) else."""
    if getattr(param, "is_flag", False):
        return "flag", None
    info = param.type_descriptor.parameter_info
    if isinstance(getattr(info, "parser", None), bounds.Parser):
        return "bound", info.parser.bound
    annotation = param.type_descriptor.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return "choice", typing.get_args(annotation)
    return "none", None


def _options():
    root = typer.main.get_command(app)
    for path, command in _walk(root):
        for param in command.params:
            yield path, param


def _hostile(kind, declared, fixtures) -> list[str]:
    if kind == "flag":
        return ["=x"]  # `--json=x`: an on/off flag takes no value
    if kind == "choice":
        return CHOICE_VALUES
    return {"number": NUMBER_VALUES, "name": NAME_VALUES, "text": TEXT_VALUES,
            "path": _path_values(fixtures), "list": _list_values(declared) if kind == "bound" and
            isinstance(declared, bounds.Items) else []}[declared.kind]


def _refused_by_declaration(kind, declared, value: str) -> bool:
    if kind == "flag":
        return True
    if kind == "choice":
        return value.lower() not in [c.lower() for c in declared]
    return not bounds.accepts(declared, value)


class ReachedWork(Exception):
    """A hostile value got past every check to the point where work starts."""


@pytest.fixture
def tripwires(monkeypatch):
    """Every step that does work or writes raises instead (a value that slips through fails fast)."""
    from moebench import envcheck, results, train
    from moebench.bench import core
    from moebench.parity import runner as parity_runner
    from moebench.report import build

    def trip(*args, **kwargs):
        raise ReachedWork("reached work")

    for owner, name in ((results.RunDir, "create"), (train, "run_variant"), (core, "run_bench"),
                        (parity_runner, "verify_parity"), (envcheck, "run_all"), (build, "build_report")):
        monkeypatch.setattr(owner, name, trip)


def test_every_option_declares_its_bounds():
    """A new option with no bound, no choices and no on/off meaning fails here."""
    undeclared = [f"{' '.join(path) or 'moebench'} {param.opts[0] if param.opts else param.name}"
                  for path, param in _options() if _kind(param)[0] == "none"]
    assert not undeclared, f"options without a declared bound (moebench.bounds): {undeclared}"


def test_an_undeclared_option_is_caught():
    """The check above can fail: a plain option is "none"; the same option with a bound is not."""
    import typer

    from moebench.cli import flags

    probe = typer.Typer(add_completion=False)

    @probe.command()
    def cmd(plain: str = typer.Option("", "--plain"), count: int = flags.bounded_option(
            1, "--count", bound=bounds.Number(integer=True, min=1, max=9)), on: bool = typer.Option(False, "--on")):
        """probe"""

    kinds = {p.opts[0]: _kind(p)[0] for p in typer.main.get_command(probe).params}
    assert kinds == {"--plain": "none", "--count": "bound", "--on": "flag"}


def test_every_bound_refuses_the_values_no_option_takes(tmp_path):
    """Whatever an option accepts, none takes an empty value, 5000 characters or a newline; no number
    takes 1e308, a 23-digit integer, nan or a word (a Number bound without a max says why)."""
    for path, param in _options():
        kind, declared = _kind(param)
        if kind != "bound":
            continue
        where = f"{' '.join(path)} {param.opts[0] if param.opts else param.name}"
        for value in ("", LONG, "a\nb"):
            assert not bounds.accepts(declared, value), f"{where} accepts {value[:20]!r}"
        if declared.kind == "number":
            for value in ("1e308", HUGE_INT, "nan", "abc"):
                assert not bounds.accepts(declared, value), f"{where} accepts {value!r}"


def test_generated_hostile_invocations(tmp_path, monkeypatch, tripwires, capsys):
    fixtures = {"file": tmp_path / "fixtures" / "a-file", "dir": tmp_path / "fixtures" / "a-dir",
                "unwritable": tmp_path / "fixtures" / "read-only"}
    fixtures["dir"].mkdir(parents=True)
    fixtures["unwritable"].mkdir()
    fixtures["unwritable"].chmod(0o500)
    fixtures["file"].write_text("x")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a stray ./results or ./env would show up here
    monkeypatch.setenv("MOEBENCH_RESULTS", str(work / "results"))
    runner = CliRunner()
    commands, options = set(), 0
    tried = accepted = named = 0
    failures: list[str] = []
    slowest = (0.0, "")
    for path, param in _options():
        kind, declared = _kind(param)
        commands.add(path)
        options += 1
        flag = param.opts[0] if param.opts else param.name
        for value in _hostile(kind, declared, fixtures):
            if not _refused_by_declaration(kind, declared, value):
                accepted += 1
                continue
            if kind == "flag":
                args = [*path, f"{flag}{value}"]
            elif param.param_type_name == "argument":
                args = [*path, "--", value]
            else:
                args = [*path, flag, value]
            tried += 1
            start = time.monotonic()
            result = runner.invoke(app, args)
            elapsed = time.monotonic() - start
            slowest = max(slowest, (elapsed, " ".join(args)[:80]))
            lines = [line for line in result.output.splitlines() if line.strip()]
            names = [param.metavar or param.name.upper()] if param.param_type_name == "argument" else (
                param.opts + param.secondary_opts)
            said = any(n in result.output for n in names)
            named += said
            case = f"moebench {' '.join(args)[:100]!r}"
            if result.exit_code != 2:
                failures.append(f"{case}: exit {result.exit_code}: {result.output[-200:]!r} {result.exception!r}")
            elif "Traceback" in result.output or not isinstance(result.exception, (SystemExit, type(None))):
                failures.append(f"{case}: traceback / {result.exception!r}")
            elif len(lines) > MAX_LINES or not lines[0].startswith("error: "):
                failures.append(f"{case}: {len(lines)} lines: {result.output[:200]!r}")
            elif not said:
                failures.append(f"{case}: does not name {names}: {lines[0][:120]!r}")
            elif elapsed > CASE_SECONDS:
                failures.append(f"{case}: {elapsed:.1f} s")
            debris = os.listdir(work)
            if debris:
                failures.append(f"{case}: created {debris}")
                for name in debris:
                    os.system(f"rm -rf {work / name}")  # noqa: S605 - a tmp folder of this test
    summary = {"commands": len(commands), "options": options, "refused_invocations": tried,
               "accepted_by_declaration": accepted, "flag_named": named, "failures": len(failures),
               "slowest_s": round(slowest[0], 2), "slowest": slowest[1]}
    with capsys.disabled():
        print(f"\ngenerated hostile suite: {json.dumps(summary)}")
    assert not failures, "\n".join(failures[:40])
    assert tried >= 400 and named == tried
