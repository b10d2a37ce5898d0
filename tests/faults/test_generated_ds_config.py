"""Hostile DeepSpeed configs generated from DeepSpeed's config schema as moebench reads it (variants/deepspeed/
ds_schema.py: every bounded key, every section, the optimizer and scheduler types) and from the shapes a file can
take, fed to `verify-parity --ds-config` and `run deepspeed --ds-config` in-process: a key DeepSpeed adds is covered
the day moebench reads it.

Every case must: exit 2 with one `error: --ds-config:` line that names what is wrong (the key given the bad value,
or what the file holds), no traceback, nothing created; a value the key's bound accepts may instead reach the point
where work starts (a tripwire), never a traceback.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app

pytestmark = pytest.mark.faults

CASE_SECONDS = 5.0
"""A refusal comes before any work: seconds, not minutes (the first case pays DeepSpeed's import)."""
COMMANDS = (("verify-parity", "-n", "2"), ("run", "deepspeed", "--preset", "quick"))
VALUES = [-1, 0, 1.5, 10**21, 1e308, "abc", None, True, [1], {"a": 1}, "auto"]
"""What every bounded key is given: below, at and between bounds, past any count, the wrong JSON types, "auto"."""
SHAPES = [("null", "holds null"), ("[1, 2]", "holds a list"), ('"text"', "holds a string"), ("7", "holds a number"),
          ("true", "holds true"), ('{"a": 1, "a": 2}', "gives the key 'a' twice"), ('{"a": NaN}', "NaN or Infinity"),
          ('{"a": 1e999}', "beyond float range"), ('{"a":' * 40 + "1" + "}" * 40, "nests deeper"),
          ('{"a": ', "is not valid JSON"), (b"\xff\xfe{}", "not UTF-8")]
"""A file's whole text and what the refusal must say about it."""


class ReachedWork(Exception):
    """The config got past every check to the point where work starts."""


@pytest.fixture
def tripwires(monkeypatch):
    from moebench import results, train
    from moebench.parity import runner as parity_runner

    def trip(*args, **kwargs):
        raise ReachedWork("reached work")

    for owner, name in ((results.RunDir, "create"), (train, "run_variant"), (parity_runner, "verify_parity")):
        monkeypatch.setattr(owner, name, trip)


def _tree(dotted: tuple[str, ...], value) -> dict:
    doc = value
    for key in reversed(dotted):
        doc = {key: doc}
    if dotted[0] in ("fp16", "bf16", "bfloat16") and dotted[-1] != "enabled":
        doc[dotted[0]]["enabled"] = True  # a section that is on: its keys are read
    return doc


def _cases():
    from moebench.variants.deepspeed import ds_schema

    for dotted, bound in sorted(ds_schema.bounds().items()):
        for value in VALUES:
            shown = value if not isinstance(value, float) or value.is_integer() is False else int(value)
            refused = value != "auto" and bool(bound.problem(int(value) if isinstance(value, float) and
                                                             value.is_integer() and bound.integer else value))
            yield ".".join(dotted), json.dumps(_tree(dotted, value)), refused, str(shown)
    for section in ds_schema.SECTION_KEYS:
        for value in (5, "x", [1], None):
            yield section, json.dumps({section: value}), True, str(value)
    for key, value in (("optimizer.type", "os.system"), ("optimizer.type", "__import__"), ("optimizer.type", 3),
                       ("scheduler.type", "Frobnicate"), ("scheduler.type", None)):
        section, field = key.split(".")
        yield key, json.dumps({section: {field: value}}), True, str(value)


def _run(runner, command, path):
    start = time.monotonic()
    result = runner.invoke(app, [*command, "--ds-config", path])
    return result, time.monotonic() - start


def _verdict(result, elapsed: float, must_say: str | None) -> str:
    """"" when the case behaved; else what went wrong."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    if isinstance(result.exception, ReachedWork):
        return "" if must_say is None else "reached work"
    if result.exit_code != 2 or not isinstance(result.exception, (SystemExit, type(None))):
        return f"exit {result.exit_code}: {result.exception!r} {result.output[-200:]!r}"
    if "Traceback" in result.output or len(lines) != 1 or not lines[0].startswith("error: --ds-config: "):
        return f"{len(lines)} lines: {result.output[:240]!r}"
    if must_say is not None and must_say not in lines[0]:
        return f"does not say {must_say!r}: {lines[0][:200]!r}"
    if elapsed > CASE_SECONDS:
        return f"{elapsed:.1f} s"
    return ""


SAMPLED_VALUES = 3
"""The default tier gives each bounded key 3 of VALUES, in turn (every value still meets a third of the keys): the
bound check is one path for all keys; the slow tier gives every key every value."""


def _sampled(cases: list[tuple]) -> list[tuple]:
    """Each bounded key's SAMPLED_VALUES values, starting at its own place in VALUES; the other cases whole."""
    from moebench.variants.deepspeed import ds_schema

    turn = {".".join(dotted): i for i, dotted in enumerate(sorted(ds_schema.bounds()))}
    seen: dict[str, int] = {}
    kept = []
    for case in cases:
        key = case[0]
        if key in turn:
            seen[key] = seen.get(key, -1) + 1  # this case's place in VALUES
            if (seen[key] - turn[key]) % len(VALUES) >= SAMPLED_VALUES:
                continue
        kept.append(case)
    return kept


@pytest.mark.parametrize("sweep", ["sampled", pytest.param("every", marks=pytest.mark.slow)])
def test_generated_hostile_ds_configs(tmp_path, monkeypatch, tripwires, capsys, sweep):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the schema is read from DeepSpeed: no accelerator probe
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a stray ./results would show up here
    monkeypatch.setenv("MOEBENCH_RESULTS", str(work / "results"))
    runner = CliRunner()
    failures: list[str] = []
    tried = refused = reached = 0
    cases = [(key, text, refused_, shown, key) for key, text, refused_, shown in _cases()]
    if sweep == "sampled":
        cases = _sampled(cases)
    cases += [(f"file {i}", text, True, "", said) for i, (text, said) in enumerate(SHAPES)]
    for key, text, must_refuse, shown, must_say in cases:
        path = tmp_path / "ds.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        for command in COMMANDS:
            tried += 1
            result, elapsed = _run(runner, command, str(path))
            reached += isinstance(result.exception, ReachedWork)
            refused += result.exit_code == 2
            problem = _verdict(result, elapsed, must_say if must_refuse else None)
            if problem:
                failures.append(f"{command[0]} {key}={shown[:30]}: {problem}")
            debris = os.listdir(work)
            if debris:
                failures.append(f"{command[0]} {key}={shown[:30]}: created {debris}")
                for name in debris:
                    os.system(f"rm -rf {work / name}")  # noqa: S605 - a tmp folder of this test
    summary = {"invocations": tried, "refused": refused, "reached_work": reached, "failures": len(failures)}
    with capsys.disabled():
        print(f"\ngenerated ds-config suite: {json.dumps(summary)}")
    assert not failures, "\n".join(failures[:40])
    assert tried >= (500 if sweep == "every" else 150) and refused > 10 * reached  # nearly all refused before work
