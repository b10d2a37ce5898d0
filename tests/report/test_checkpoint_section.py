"""The report's checkpoint-audit section (moebench/report/sections/checkpoint.py), from real `moebench checkpoint`
audits of small safetensors checkpoints (tests/helpers/checkpoints.py): a sound one and a broken one are both shown,
the broken one's problem lines word for word, in REPORT.md, report.html, the console and the report's JSON; an
unreadable audit file is one line; only the newest audit of each folder is shown.

The checks read content, not presence: `assert_shows` is run against section implementations broken on purpose
(problems dropped, a line reworded, a broken checkpoint called sound, a trap left out) and must fail on each."""

from __future__ import annotations

import html
import json
import textwrap
from pathlib import Path

import pytest
from helpers.checkpoints import audited, write_safetensors
from typer.testing import CliRunner

from moebench import results
from moebench.cli.app import app
from moebench.report import build
from moebench.report.sections import checkpoint as section

HEADING = "## Checkpoint audits (moebench checkpoint)"
TRAP = ("trap: with its optimizer state at ep_size 2 only (the optimizer files are per EP rank, by its global "
        "rank); DeepSpeed does not check it")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """sound/, broken/ (expert 2 missing, expert 3 a copy of expert 0), strided/ (sound's experts in the strided
    order of ep_size 2). Outside any test's tmp_path: a checkpoint's files are none of moebench's results files."""
    base = tmp_path_factory.mktemp("checkpoints")
    return {"sound": write_safetensors(base / "sound"),
            "broken": write_safetensors(base / "broken", drop=2, duplicate=(0, 3)),
            "strided": write_safetensors(base / "strided", order=[0, 2, 1, 3])}


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "results"
    path.mkdir()
    return path


def _section(report: Path) -> str:
    text = (report / "REPORT.md").read_text()
    assert HEADING in text
    return text.split(HEADING, 1)[1].split("\n## ", 1)[0]


def _console(root: Path, *args: str) -> str:
    done = CliRunner().invoke(app, ["report", "--results-dir", str(root), *args])
    assert done.exit_code == 0 and "Traceback" not in done.output, done.output
    return done.output


def _unfolded(console: str) -> str:
    """The console's checkpoint lines joined back (a folded line goes on with an indent)."""
    return " ".join(line.strip() for line in console.splitlines())


def assert_shows(doc: dict, run: Path, report: Path, console: str, verdict: str) -> None:
    """What a report must say of one audit: its folder, format, verdict, every problem line and trap word for word
    (REPORT.md, report.html, the console), every load (REPORT.md, report.html) and its JSON record."""
    section_md = _section(report)
    page = (report / "report.html").read_text()
    block = section_md.split(f"### {doc['path']}\n", 1)[1].split("\n### ", 1)[0]
    saved = section.saved_words(doc["saved"]) or "-"
    assert f"| {doc['path']} | {doc['format']} | {saved} | {verdict} | {run.name} |" in section_md, section_md
    assert f"Verdict: {verdict}." in block, block
    for line in doc["lines"]:
        assert f"- {line}\n" in block, (line, block)
        assert f"<li>{html.escape(line)}</li>" in page, line
        assert line in _unfolded(console), (line, console)
    assert block.count("\n- ") == len(doc["lines"]) + len(doc["loads"]) + len(
        (doc.get("against") or {}).get("layers", [])), block
    for line in doc["loads"]:
        assert f"- {line}\n" in block and f"<li>{html.escape(line)}</li>" in page, line
        if line.startswith("trap:"):
            assert line in _unfolded(console), (line, console)
    assert f"checkpoint {run.name}: {verdict}, {doc['format']}" in console.splitlines(), console
    summary = json.loads((report / "summary.json").read_text())
    (record,) = [r for r in summary["checkpoints"] if r["run_id"] == run.name]
    assert record["path"] == doc["path"] and record["verdict"] == verdict.split(" (")[0]
    assert record["problems"] == doc["lines"], record


def _report(root: Path, *args: str) -> tuple[Path, str]:
    console = _console(root, *args)
    return sorted((root / "report").iterdir())[-1], console


def test_a_sound_and_a_broken_audit_are_both_shown_word_for_word(folders, root):
    sound, sound_run = audited(folders["sound"], root)
    broken, broken_run = audited(folders["broken"], root)
    assert sound["status"] == "sound" and broken["status"] == "problems"
    assert {p["name"] for p in broken["problems"]} == {"missing-expert", "duplicate-expert"}
    report, console = _report(root)
    assert_shows(sound, sound_run, report, console, "sound")
    assert_shows(broken, broken_run, report, console, f"problems found ({len(broken['lines'])})")
    md = _section(report)
    assert md.index(broken["path"]) < md.index(sound["path"])  # newest first
    lines = console.splitlines()
    start = lines.index(f"checkpoint {broken_run.name}: problems found ({len(broken['lines'])}), safetensors")
    for line in lines[start:lines.index(f"checkpoint {sound_run.name}: sound, safetensors") + 2]:
        assert len(line) <= 80 or line.strip() in (sound["path"], broken["path"]), line  # a path is printed whole
    listed = json.loads(_console(root, "--json"))["checkpoints"]
    assert [r["run_id"] for r in listed] == [broken_run.name, sound_run.name]
    assert listed[0]["problems"] == broken["lines"] and listed[1]["verdict"] == "sound"


def test_saved_at_traps_and_against_are_shown(folders, root):
    doc, run = audited(folders["sound"], root, against=folders["strided"])
    assert [p["name"] for p in doc["problems"]] == ["permutation", "permutation"]
    doc = {**doc, "saved": {"ep_size": 2, "zero_stage": 0, "tp_size": None}, "loads": [*doc["loads"], TRAP]}
    (run / "checkpoint.json").write_text(json.dumps(doc))  # as a DeepSpeed regular checkpoint's audit says them
    report, console = _report(root)
    assert_shows(doc, run, report, console, f"problems found ({len(doc['lines'])})")
    block = _section(report)
    assert "saved at ep_size 2, zero_stage 0;" in block and "tp_size" not in block
    assert f"Compared with --against {doc['against']['path']} (safetensors), expert by expert:" in block
    for layer in doc["against"]["layers"]:
        line = (f"against layer {layer['against_layer']}: {layer['matched']} of {layer['against_experts']} experts "
                "in place")
        assert f"- {line}\n" in block and line in console, (line, console)
    assert "  saved at ep_size 2, zero_stage 0" in console.splitlines()


def test_only_the_newest_audit_of_each_folder_is_shown(folders, root):
    _, older = audited(folders["broken"], root)
    doc, newer = audited(folders["broken"], root)
    sound, sound_run = audited(folders["sound"], root)
    result = build.build_report([], root=str(root))
    assert [r.path for r in result.checkpoints] == [sound_run, newer]
    assert older.name not in _section(result.path)
    since = build.build_report([], root=str(root), since=sound_run.name[:15])  # started at or after it
    assert sound_run in [r.path for r in since.checkpoints]
    given = build.build_report([str(older)], root=str(root))  # a RUN folder given: that audit
    assert [r.path for r in given.checkpoints] == [older] and older.name in _section(given.path)


def test_no_audit_no_section(root):
    result = build.build_report([], root=str(root))
    assert result.checkpoints == [] and "Checkpoint audits" not in (result.path / "REPORT.md").read_text()
    assert "checkpoints" not in json.loads((result.path / "summary.json").read_text())


@pytest.mark.no_schema_check  # a damaged file on purpose
@pytest.mark.parametrize("damage", ["not json", "binary", "schema"])
def test_an_unreadable_audit_file_is_one_line(folders, root, damage):
    sound, _ = audited(folders["sound"], root)
    _, run = audited(folders["broken"], root)
    target = run / "checkpoint.json"
    if damage == "not json":
        target.write_text(target.read_text()[:100])
    elif damage == "binary":
        target.write_bytes(b"\x00\x89PNG\r\n\x1a\n\xff\xfe")
    else:
        target.write_text(json.dumps({**json.loads(target.read_text()), "status": "fine"}))
    report, console = _report(root)
    md = _section(report)
    said = [line for line in md.splitlines() if run.name in line]
    assert len(said) == 1 and said[0].startswith(f"Audit {run.name} not shown: it is damaged (checkpoint.json: "), md
    assert sound["path"] in md  # the readable audit is shown as ever
    assert f"checkpoint {run.name} (damaged)" in console.splitlines(), console
    assert f"run {run.name} is damaged:\n  checkpoint.json: " in console, console  # under the table, as every run
    summary = json.loads((report / "summary.json").read_text())
    assert summary["not_judged"]["checkpoint"].startswith(f"{run}: checkpoint.json: ")
    assert [r["verdict"] for r in summary["checkpoints"]] == ["not shown", "sound"]


def test_an_audit_folder_without_its_document_is_one_line(folders, root):
    _, run = audited(folders["sound"], root)
    (run / "checkpoint.json").unlink()
    report, console = _report(root)
    assert [line for line in _section(report).splitlines() if run.name in line] == [
        f"Audit {run.name} not shown: its folder has no checkpoint.json (status ok)."]
    assert f"checkpoint {run.name} (ok): no checkpoint.json" in console.splitlines()


def test_markup_and_escape_codes_in_an_audit_are_shown_as_text(folders, root):
    doc, run = audited(folders["broken"], root)
    doc["lines"][0] = "missing-expert: <script>alert(1)</script> \x1b[31mred\x1b[0m"
    (run / "checkpoint.json").write_text(json.dumps(doc))
    report, console = _report(root)
    page = (report / "report.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "\x1b" not in console and "\x1b" not in (report / "REPORT.md").read_text()
    assert "\\x1b[31mred\\x1b[0m" in console


def test_the_section_reads_the_files_the_audit_writes():
    from moebench.checkpoint_audit import run

    assert (section.KIND, section.REPORT_FILE) == (run.KIND, run.REPORT_FILE)
    assert section.TRAP == "trap:"  # read_deepspeed's traps start so


# --------------------------------------------------------------------------- the checks catch a broken section


def _drop_problems(audit):
    return {"lines": ()}


def _reword(audit):
    return {"lines": tuple(line.replace("missing-expert", "missing expert") for line in audit.lines)}


def _sound(audit):
    return {"verdict": section.SOUND, "lines": ()}


def _drop_traps(audit):
    return {"traps": ()}


def _first_problem_only(audit):
    return {"lines": audit.lines[:1]}


@pytest.mark.parametrize("breakage", [_drop_problems, _reword, _sound, _drop_traps, _first_problem_only],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_checks_fail_on_a_broken_section(folders, root, monkeypatch, breakage):
    import dataclasses

    doc, run = audited(folders["broken"], root)
    doc = {**doc, "loads": [*doc["loads"], TRAP]}
    (run / "checkpoint.json").write_text(json.dumps(doc))
    report, console = _report(root)
    verdict = f"problems found ({len(doc['lines'])})"
    assert_shows(doc, run, report, console, verdict)  # the real section passes
    real = section.read
    monkeypatch.setattr(section, "read", lambda r: dataclasses.replace(real(r), **breakage(real(r))))
    report, console = _report(root)
    with pytest.raises(AssertionError):
        assert_shows(doc, run, report, console, verdict)


def test_console_lines_fold_at_80_columns_and_keep_every_word(folders, root):
    doc, run = audited(folders["broken"], root)
    long_line = "missing-expert: " + " ".join(["word"] * 60)
    doc["lines"] = [long_line] * (section.CONSOLE_PROBLEMS + 3)
    (run / "checkpoint.json").write_text(json.dumps(doc))
    lines = section.console_lines([results_run(run)])
    assert all(len(line) <= 80 for line in lines if line.strip() != doc["path"]), lines
    assert " ".join(line.strip() for line in lines).count(long_line) == section.CONSOLE_PROBLEMS
    assert lines[-1] == "  ... and 3 more problem line(s): every one is in REPORT.md"
    assert textwrap.dedent(lines[2]).startswith("missing-expert: word")


def results_run(path: Path):
    from moebench.report import collect

    run = collect.load_run(path)
    assert run.documents.get("checkpoint.json") is not None and results.read_run(path).damage == ""
    return run
