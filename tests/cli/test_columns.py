"""Every table fits the terminal it is in: the real CLI, piped with COLUMNS=80 and in an 80-column
pseudo-terminal, prints no line wider than 80 cells, cuts nothing (`…`), and shows every number of its
JSON whole. `--help` uses the width it has."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest
import typer
from helpers import warmcli
from rich.cells import cell_len

COLS = 80
CLI_TIMEOUT_S = 180.0
"""A command that has not ended by then hangs (the slowest here takes a few seconds)."""
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")


@pytest.fixture
def root():
    """A short results root, as a user's `results/` is: a long pytest path would be folded, not cut,
    but would hide whether the tables themselves fit."""
    path = Path(tempfile.mkdtemp(prefix="mbc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def piped(*args: str, columns: int = COLS, cwd=None) -> str:
    """stdout + stderr of `moebench ARGS` with stdout a pipe and COLUMNS set."""
    env = dict(os.environ, COLUMNS=str(columns))
    proc = warmcli.run(args, env=env, timeout=CLI_TIMEOUT_S, cwd=cwd)  # tests/helpers/warmcli.py
    assert proc.returncode in (0, 1), proc.stderr
    return proc.stdout + proc.stderr


def in_pty(*args: str, columns: int = COLS) -> str:
    """Everything `moebench ARGS` writes to a pseudo-terminal `columns` wide (no COLUMNS in its
    environment: the terminal's size decides), without colour codes."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "moebench", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=env, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + CLI_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
        else:
            raise AssertionError(f"moebench {' '.join(args)} still running after {CLI_TIMEOUT_S} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    assert proc.returncode in (0, 1), b"".join(chunks).decode(errors="replace")
    return _ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n")


def assert_fits(text: str, columns: int = COLS) -> None:
    # a progress bar redraws its line after a carriage return: each drawing must fit
    wide = [line for line in re.split(r"[\r\n]", text) if cell_len(line) > columns]
    assert not wide, f"{len(wide)} line(s) wider than {columns}:\n" + "\n".join(wide)
    assert "…" not in text, "something was cut:\n" + text


def assert_whole(number: str, text: str) -> None:
    """`number` appears as a token of its own (not the start of a cut or folded one)."""
    assert re.search(rf"(?<![\w.+-]){re.escape(number)}(?![\w.])", text), f"{number!r} not whole in:\n{text}"


def only_run(root: Path, kind: str) -> Path:
    (run,) = (root / kind).iterdir()
    return run


# env-check ------------------------------------------------------------------------------------------


def _env_check_numbers_and_words(text: str, root: Path) -> None:
    from moebench.envcheck.render import GAP, ITEM_WIDTH, STATUS_WIDTH

    doc = json.loads((only_run(root, "env") / "envcheck.json").read_text())
    c = doc["counts"]
    assert f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skip in {doc['elapsed_s']:.1f} s" in text
    body = COLS - STATUS_WIDTH - ITEM_WIDTH - GAP
    for check in doc["checks"]:
        for word in check["found"].split():
            if len(word) <= body:  # a longer word (a path) is split over lines, never cut
                assert_whole(word, text)
        for clause in filter(None, (part.strip() for part in check["hint"].split("; "))):
            if len(clause) < COLS - STATUS_WIDTH - len("fix: ") - 1:  # a clause that fits is on one line
                assert any(clause in line for line in text.splitlines()), clause


@pytest.mark.multirank
def test_env_check_fits_80_columns_in_a_terminal_with_its_probe(root):
    text = in_pty("env-check", "--results-dir", str(root))
    assert_fits(text)
    _env_check_numbers_and_words(text, root)
    assert len(text.splitlines()) < 120, "env-check should be compact (341 lines at 80 columns before)"


def test_env_check_piped_honours_columns(root):
    text = piped("env-check", "--no-probe", "--results-dir", str(root))
    assert_fits(text)
    _env_check_numbers_and_words(text, root)


def test_env_check_shows_a_fix_whole_on_its_own_line(monkeypatch, tmp_path):
    """The item that warns: what it needs and its fix each start a line; a command in the fix is whole."""
    from typer.testing import CliRunner

    import moebench.envcheck as envcheck
    from moebench.cli.app import app
    from moebench.envcheck.check import PLATFORM, WARN, Check, Report

    found = "release 13.0.88 at /usr/local/bin/nvcc (via PATH), but it cannot work here: " * 3
    fix = "nothing to do on a CPU-only machine; export CUDA_HOME=/usr/local/cuda-13.0"
    report = Report(checks=[Check(id="cuda.x", section=PLATFORM, title="nvcc (CUDA toolkit)", status=WARN,
                                  found=found, required="release == torch.version.cuda major", hint=fix)],
                    mode="full", created="2026-01-01T00:00:00+00:00", elapsed_s=0.25,
                    probe={"enabled": False, "timeout_s": 30.0}, moebench_version="0", hostname="h")
    monkeypatch.setattr(envcheck, "run_all", lambda **kw: report)
    monkeypatch.setenv("COLUMNS", str(COLS))
    out = CliRunner().invoke(app, ["env-check", "--results-dir", str(tmp_path)]).stdout
    assert_fits(out)
    lines = [line.strip() for line in out.splitlines()]
    assert "fix: nothing to do on a CPU-only machine;" in lines
    assert "export CUDA_HOME=/usr/local/cuda-13.0" in lines
    assert "needs: release == torch.version.cuda major" in lines
    assert_whole("13.0.88", out)


def test_env_check_records_its_real_wall_time(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import moebench.envcheck as envcheck
    from moebench.cli.app import app

    real = envcheck.run_all

    def slow(**kw):
        time.sleep(0.3)
        return real(**kw)

    monkeypatch.setattr(envcheck, "run_all", slow)
    assert CliRunner().invoke(app, ["env-check", "--no-probe", "--results-dir", str(tmp_path)]).exit_code in (0, 1)
    summary = json.loads((only_run(tmp_path, "env") / "summary.json").read_text())
    assert summary["wall_time_s"] >= 0.3


# verify-parity -------------------------------------------------------------------------------------


def _parity_numbers(text: str, root: Path) -> None:
    summary = json.loads((only_run(root, "parity") / "summary.json").read_text())
    assert summary["checks"]
    for c in summary["checks"]:
        for key in ("max_abs_diff", "max_rel_diff", "magnitude"):
            if c[key] is not None:
                assert_whole(f"{c[key]:.1e}", text)
        for part in (c["tolerance"] or "").split("/"):
            assert_whole(part, text)
        assert_whole(f"{c['elapsed_s']:.1f}s", text)
        assert c["name"] in text


@pytest.mark.multirank
def test_verify_parity_fits_80_columns_in_a_terminal(root):
    text = in_pty("verify-parity", "-n", "2", "--checks", "ddp-sgd,experts", "--results-dir", str(root))
    assert_fits(text)
    _parity_numbers(text, root)


@pytest.mark.multirank
def test_verify_parity_piped_honours_columns(root):
    text = piped("verify-parity", "-n", "2", "--checks", "experts", "--results-dir", str(root))
    assert_fits(text)
    _parity_numbers(text, root)


def test_verify_parity_table_stacks_what_does_not_fit(monkeypatch, capsys):
    """A vacuous check and every kind of number, laid out at 80 columns and at 60: nothing cut."""
    from moebench.cli import parity_console

    check = {"name": "replicate-bad-device-id", "status": "fail", "max_abs_diff": 1.234e-7, "max_rel_diff": 5.5e-3,
             "tolerance": "1e-05/4e-06", "magnitude": 12.5, "vacuous": 3, "unasserted": 2, "elapsed_s": 123.4,
             "reason": "", "unasserted_outside": 0}
    summary = {"world_size": 2, "comm_backend": "gloo", "tolerance": "strict", "checks": [check],
               "counts": {"pass": 0, "fail": 1, "skip": 0}, "vacuous_total": 3, "wall_time_s": 123.5,
               "run_path": "results/parity/x"}
    for columns in (COLS, 60):
        monkeypatch.setenv("COLUMNS", str(columns))
        parity_console.print_table(summary)
        out = capsys.readouterr().out
        assert_fits(out, columns)
        for number in ("1.2e-07", "5.5e-03", "1e-05", "4e-06", "1.2e+01", "123.4s", "3 VACUOUS", "2 unasserted"):
            assert number in out, (columns, number, out)


def test_verify_parity_list_fits(root):
    text = piped("verify-parity", "--list")
    assert_fits(text)


# run's closing tables, report ----------------------------------------------------------------------


def test_run_closing_tables_fit_80_columns_in_a_terminal(root):
    from moebench.report import claims

    text = in_pty("run", "fastmoe", "--steps", "4", "--results-dir", str(root))
    assert_fits(text)
    summary = json.loads((only_run(root, "fastmoe") / "summary.json").read_text())
    for count in [summary["params"]["total"], *summary["params"]["by_category"].values()]:
        assert_whole(f"{count:,}", text)
    assert_whole(f"{summary['test']['loss']:.4f}", text)
    if "measured vs chapter 6" in text:
        for row in summary["chapter_comparison"]:
            assert_whole(claims.format_number(row["measured"], row["unit"]), text)
            for part in claims.difference_text(row).split(" ("):  # the relative change may go under
                assert part.strip("()") in text, part


def test_report_verdicts_fit(root):
    """At 80 columns a claim beside its figures; at 60 (where rich cropped the figures at the edge) each
    claim above its figures."""
    from moebench.report.claims import format_published

    (root / "r").mkdir()
    for columns, text in ((COLS, in_pty("report", "--results-dir", str(root))),
                          (60, piped("report", "--results-dir", "r", columns=60, cwd=root))):
        assert_fits(text, columns)  # (at 60, results/ relative: the paths printed whole, to copy, fit too)
        (run,) = sorted((root / "report").iterdir() if columns == COLS else (root / "r" / "report").iterdir())
        for row in json.loads((run / "summary.json").read_text())["verdicts"]:
            published = format_published(row["published"], row["unit"])  # beside its verdict, both whole
            assert any(published in line and row["verdict"] in line for line in text.splitlines()), (columns, row)


# --help ----------------------------------------------------------------------------------------------


def test_help_uses_the_width_it_has_and_cuts_no_sentence():
    from moebench.cli.app import app

    wide = piped("--help", columns=200)
    assert max(len(line) for line in wide.splitlines()) > COLS, "help capped at 80 columns"
    for columns in (COLS, 200):
        text = piped("--help", columns=columns)
        assert_fits(text, columns)
        commands = text.split("Commands:")[1]
        assert "..." not in commands
        for name, command in typer.main.get_command(app).commands.items():
            first = command.get_short_help_str(limit=10_000)  # the first sentence, whole
            assert "".join(first.split()) in "".join(commands.split()), (name, first)


# runs ----------------------------------------------------------------------------------------------


_REAL_FASTMOE: list[Path] = []
"""One real 2-rank fastmoe run per session, copied into each test's root (summaries pass their schema)."""


def _real_fastmoe_run(root: Path) -> Path:
    if not _REAL_FASTMOE:
        template = Path(tempfile.mkdtemp(prefix="mb-runs-"))
        proc = warmcli.run(["run", "fastmoe", "--steps", "2", "-n", "2", "--results-dir", str(template)],
                           timeout=CLI_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        (run,) = (template / "fastmoe").iterdir()
        _REAL_FASTMOE.append(run)
    run = root / "fastmoe" / _REAL_FASTMOE[0].name
    shutil.copytree(_REAL_FASTMOE[0], run)
    return run


def _fake_runs(root: Path) -> list[dict]:
    """Three finished runs as their commands write them: a variant's (a real one, its start, loss and
    wall time set to known values), a parity run, an env-check."""
    from moebench import results

    made = []
    run = _real_fastmoe_run(root)
    summary = json.loads((run / "summary.json").read_text())
    summary.update({"started_at": "2026-11-20T10:00:00", "wall_time_s": 127.25})
    summary["loss"]["last"] = 1.234567
    (run / "summary.json").write_text(json.dumps(summary))
    made.append(summary)
    run = results.RunDir.create("parity", root=root)
    made.append(run.finish(results.STATUS_INTERRUPTED, {"started_at": "2026-11-21T10:00:00", "world_size": 4,
                                                         "wall_time_s": 14.5}))
    run = results.RunDir.create("env", root=root)
    made.append(run.finish(results.STATUS_OK, {"started_at": "2026-11-22T10:00:00", "wall_time_s": 3.25,
                                                "counts": {"ok": 1, "warn": 0, "fail": 0, "skip": 0}, "exit_code": 0,
                                                "strict": False, "report": "envcheck.json"}))
    return made


def test_runs_lists_header_preset_ranks_launcher_loss_and_start(root):
    made = _fake_runs(root)
    for columns, text in ((COLS, piped("runs", "--results-dir", str(root))),
                          (COLS, in_pty("runs", "--results-dir", str(root))),
                          (160, piped("runs", "--results-dir", str(root), columns=160))):
        assert_fits(text, columns)
        assert "3 run(s) under" in text.splitlines()[0]
        for header in ("kind", "run id", "status", "started", "what", "ranks", "launcher", "final loss", "wall"):
            assert header in text, header
        for summary in made:
            assert summary["run_id"] in text and summary["status"] in text
            assert summary["started_at"].replace("T", " ") in text
            assert_whole(f"{summary['wall_time_s']:.1f}", text)
        assert_whole("1.2346", text)  # final loss, 5 significant digits
        assert "quick" in text and "moebench" in text
        assert_whole("4", text)  # parity's ranks
    rows = json.loads(piped("runs", "--json", "--results-dir", str(root)))["runs"]
    assert [r["kind"] for r in rows] == ["env", "parity", "fastmoe"]  # newest first, whatever the kind
    fastmoe = rows[2]
    assert (fastmoe["preset"], fastmoe["world_size"], fastmoe["launcher"], fastmoe["final_loss"]) == \
        ("quick", 2, "moebench", 1.234567)


def test_runs_says_what_a_parity_run_verified(root):
    """A parity run's `what`: its checks, or each library's rows and the world sizes they ran at."""
    from moebench import results
    from moebench.parity.runner import CheckRecord

    def checks(n: int) -> list[dict]:
        made = [CheckRecord(name=f"c{i}", status="skip", seed_source="", description="", catches="", world_size=2,
                            elapsed_s=0.0, reason="skipped") for i in range(n)]
        return [results.to_jsonable(record) for record in made]

    run = results.RunDir.create("parity", root=root)
    run.finish(results.STATUS_INTERRUPTED, {"world_size": 4, "checks": checks(2)})
    run = results.RunDir.create("parity", root=root)
    rows = [{"library": "deepspeed", "world_size": 2}, {"library": "deepspeed", "world_size": 4},
            {"library": "fairscale", "world_size": 2}]
    run.finish(results.STATUS_INTERRUPTED, {"world_size": 2, "checks": checks(3), "rows": rows})
    listed = json.loads(piped("runs", "--json", "--results-dir", str(root)))["runs"]
    assert [(r["verified"], r["world_size"]) for r in listed] == [("deepspeed 2 rows, fairscale 1 row", "2,4"),
                                                                   ("2 checks", 4)]
    text = piped("runs", "--results-dir", str(root), columns=160)
    assert "deepspeed 2 rows, fairscale 1 row" in text and "2 checks" in text
    assert_whole("2,4", text)


def test_runs_one_line_per_run_when_wide_two_when_narrow(root):
    _fake_runs(root)
    assert len(piped("runs", "--results-dir", str(root), columns=160).splitlines()) == 1 + 1 + 3
    assert len(piped("runs", "--results-dir", str(root)).splitlines()) == 1 + 2 + 2 * 3


def test_runs_unknown_kind_is_bad_input(root):
    env = dict(os.environ, COLUMNS=str(COLS))
    proc = subprocess.run([sys.executable, "-m", "moebench", "runs", "--kind", "foo", "--results-dir", str(root)],
                          capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --kind: unknown kind foo; expected one of bench, deepspeed, env, fastmoe, gpu-check, parity, "
        "report"]
    proc = subprocess.run([sys.executable, "-m", "moebench", "runs", "--kind", "deepspeed", "--results-dir",
                           str(root)], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.strip() == f"no deepspeed runs under {root}"
    assert not any(root.iterdir())


def test_verify_parity_one_line_per_check_at_80_when_nothing_is_vacuous(monkeypatch, capsys):
    from moebench.cli import parity_console

    check = {"name": "replicate-bad-device-id", "status": "pass", "max_abs_diff": 1.5e-8, "max_rel_diff": 1.4e-3,
             "tolerance": "1e-05/2e-07", "magnitude": 1.2, "vacuous": 0, "unasserted": 0, "elapsed_s": 12.4,
             "reason": "", "unasserted_outside": 0}
    summary = {"world_size": 2, "comm_backend": "gloo", "tolerance": "strict", "checks": [check],
               "counts": {"pass": 1, "fail": 0, "skip": 0}, "vacuous_total": 0, "wall_time_s": 12.5,
               "run_path": "results/parity/x"}
    monkeypatch.setenv("COLUMNS", str(COLS))
    parity_console.print_table(summary)
    out = capsys.readouterr().out
    assert_fits(out)
    (row,) = [line for line in out.splitlines() if "replicate-bad-device-id" in line]
    assert row.split() == ["replicate-bad-device-id", "pass", "1.5e-08", "1.4e-03", "1e-05/2e-07", "1.2e+00", "12.4s"]
    assert "0 vacuous comparison(s)" in out


# bench (plain text, 80 columns) --------------------------------------------------------------------


def test_bench_text_wraps_long_lines_instead_of_cutting_numbers():
    from moebench.bench.output import format_train

    result = {"rates": {"gemm_flop_per_s": 123.4e9, "memory_bytes_per_s": 12.5e9},
              "variants": [{"variant": "deepspeed", "preset": "chapter", "trainable_params": 273_123_456,
                            "tokens_per_step": 204_800, "step_s": 12.345678, "optimizer": "torch.optim.Adam " * 6,
                            "phases": []}]}
    text = format_train(result)
    assert_fits(text)
    for number in ("123", "12.5", "273.1", "204800", "12346 ms"):
        assert number in " ".join(text.split()), number
