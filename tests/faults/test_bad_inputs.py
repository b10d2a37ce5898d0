"""Bad input to every command: one line naming the flag, exit 2, nothing created (a table of
well over 130 invocations; each runs the real CLI in-process)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app

pytestmark = pytest.mark.faults
runner = CliRunner()

RUN_BOTH = ["run fastmoe", "run deepspeed"]
POSITIVE_INTS = ["--layers", "--d-model", "--heads", "--d-hidden", "--top-k", "--batch-size", "--seq-len",
                 "--samples", "--epochs", "--steps", "--world-size", "--experts"]
POSITIVE_FLOATS = ["--lr", "--timeout"]


def _cases() -> list[tuple[str, list[str], str]]:
    cases: list[tuple[str, list[str], str]] = []
    for command in RUN_BOTH:
        for flag in POSITIVE_INTS:
            for value in ("0", "-1", "abc", "1.5"):
                cases.append((command, [flag, value], flag))
        for flag in POSITIVE_FLOATS:
            for value in ("0", "-1", "nan", "inf", "abc"):
                cases.append((command, [flag, value], flag))
        for value in ("-1", "nan", "inf", "abc"):
            cases.append((command, ["--aux-loss-coef", value], "--aux-loss-coef"))
        for value in ("-1", str(2**63), "abc"):
            cases.append((command, ["--seed", value], "--seed"))
        for flag in ("--device", "--comm-backend"):
            cases += [(command, [flag, "bogus"], flag), (command, [flag, ""], flag)]
        cases += [(command, ["--preset", ""], "--preset"), (command, ["--preset", "nope"], "--preset"),
                  (command, ["--preset", "../quick"], "--preset"), (command, ["--results-dir", ""], "--results-dir"),
                  (command, ["--bogus-flag"], "--bogus-flag"), (command, ["--world-size", "65"], "--world-size")]
    fastmoe = "run fastmoe"
    cases += [(fastmoe, ["--gate", "bogus"], "--gate"), (fastmoe, ["--gate", ""], "--gate"),
              (fastmoe, ["--moe-impl", "bogus"], "--moe-impl"), (fastmoe, ["--moe-impl", "fmoe"], "--moe-impl"),
              (fastmoe, ["--experts", "100000"], "--experts"), (fastmoe, ["--ds-config", "x.json"], "--ds-config"),
              (fastmoe, ["--gate", "switch", "--top-k", "2"], "--top-k")]
    deepspeed = "run deepspeed"
    for flag in ("--capacity-factor", "--eval-capacity-factor"):
        cases += [(deepspeed, [flag, v], flag) for v in ("0", "-1", "nan", "inf")]
    cases += [(deepspeed, ["--min-capacity", v], "--min-capacity") for v in ("-1", "abc")]
    cases += [(deepspeed, ["--zero-stage", v], "--zero-stage") for v in ("3", "-1", "abc", "9")]
    cases += [(deepspeed, ["--ep-size", v], "--ep-size") for v in ("0", "3", "abc")]
    cases += [(deepspeed, ["--noisy-gate-policy", v], "--noisy-gate-policy") for v in ("bogus", "")]
    cases += [(deepspeed, ["--ds-config", v], "--ds-config") for v in ("", "/dev/zero", "/nonexistent.json", "/tmp")]
    cases += [(deepspeed, ["--experts", v], "--experts") for v in ("four", "4,x", "0", "4,8,16")]
    cases += [(deepspeed, ["--gate", "naive"], "--gate")]
    parity = "verify-parity"
    cases += [(parity, ["-n", v], "--world-size" if v != "abc" else "-n") for v in ("0", "65", "abc")]
    cases += [(parity, ["--timeout", v], "--timeout") for v in ("0", "-1", "nan", "inf")]
    cases += [
        (parity, ["--comm-backend", "bogus"], "--comm-backend"),
        (parity, ["--tolerance", "loose"], "--tolerance"),
        (parity, ["--checks", ""], "--checks"),
        (parity, ["--checks", ",,"], "--checks"),
        (parity, ["--checks", "nope"], "--checks"),
        (parity, ["--impl", ""], "--impl"),
        (parity, ["--impl", "nokey"], "--impl"),
        (parity, ["--seed", "-1"], "--seed"),
        (parity, ["--results-dir", ""], "--results-dir"),
        (parity, ["--bogus-flag"], "--bogus-flag"),
    ]
    env = "env-check"
    cases += [(env, ["--probe-timeout", v], "--probe-timeout") for v in ("0", "-1", "nan", "abc", "99999")]
    cases += [(env, ["--results-dir", ""], "--results-dir"), (env, ["--json", "--report"], "--report"),
              (env, ["--bogus-flag"], "--bogus-flag")]
    bench = "bench"
    for flag in ("--experts", "--tokens", "--top-k", "--world-size"):
        cases += [(bench, [flag, v], flag) for v in ("", "abc", "0", "-2")]
    cases += [(bench, ["--world-size", "65"], "--world-size"), (bench, ["--world-size", "1,99"], "--world-size"),
              (bench, ["--experts", "2", "--top-k", "3"], "--top-k"),
              (bench, ["--layers", "bogus"], "--layers"), (bench, ["--layers", ""], "--layers"),
              (bench, ["--ep-layers", "bogus"], "--ep-layers"), (bench, ["--ep-layers", ""], "--ep-layers"),
              (bench, ["--d-model", "0"], "--d-model"), (bench, ["--d-hidden", "-1"], "--d-hidden"),
              (bench, ["--repeats", "0"], "--repeats"), (bench, ["--warmup", "-1"], "--warmup"),
              (bench, ["--results-dir", ""], "--results-dir"), (bench, ["--bogus-flag"], "--bogus-flag"),
              (bench, ["--train", "--preset", ""], "--preset"), (bench, ["--train", "--preset", "nope"], "--preset")]
    cases += [(bench, ["--timeout", v], "--timeout") for v in ("0", "-1", "nan", "inf", "abc")]
    report = "report"
    cases += [(report, ["--since", v], "--since") for v in ("", "yesterday-ish", "2026-13-45")]
    cases += [(report, ["--results-dir", ""], "--results-dir"), (report, ["--bogus-flag"], "--bogus-flag")]
    cases += [("runs", ["--kind", ""], "--kind"), ("runs", ["--results-dir", ""], "--results-dir")]
    return cases


CASES = _cases()


def test_the_table_is_big_enough():
    assert len(CASES) >= 130


@pytest.mark.parametrize("command,args,flag", CASES, ids=[f"{c}|{' '.join(a)}" for c, a, _ in CASES])
def test_bad_invocation_is_one_line_exit_2_nothing_created(tmp_path, monkeypatch, command, args, flag):
    root = tmp_path / "results"
    monkeypatch.setenv("MOEBENCH_RESULTS", str(root))
    monkeypatch.chdir(tmp_path)  # a stray ./results or ./env would show up here
    result = runner.invoke(app, [*command.split(), *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], result.output
    assert "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)
