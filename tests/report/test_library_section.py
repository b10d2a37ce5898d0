"""`moebench report` shows the latest `verify-parity --library` run in a section of its own (issue 16:
"a section in moebench report (table plus figure)"), built from real small runs: a parity run of two
built-in checks, then a newer `--library fairscale` run at world size 2. The library run never replaces
the run the chapter's parity verdict is judged on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.report import build

MOEBENCH = [sys.executable, "-m", "moebench"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADING = "## Library conformance (verify-parity --library)"

pytest.importorskip("fairscale")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MOEBENCH, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A two-check parity run, then a newer fairscale run (about 10 s together)."""
    root = tmp_path_factory.mktemp("library") / "results"
    for args in (["verify-parity", "-n", "2", "--checks", "ddp-sgd"],
                 ["verify-parity", "--library", "fairscale", "--world-size", "2"]):
        out = _cli(*args, "--results-dir", str(root))
        assert out.returncode == 0, out.stderr
    return root


@pytest.fixture
def root(source, tmp_path) -> Path:
    copy = tmp_path / "results"
    shutil.copytree(source, copy)
    return copy


def _runs(root: Path) -> tuple[Path, Path]:
    """(the built-in checks' run, the library run)."""
    runs = sorted((root / "parity").iterdir())
    library = [r for r in runs if "rows" in json.loads((r / "summary.json").read_text())]
    assert len(runs) == 2 and len(library) == 1
    return next(r for r in runs if r not in library), library[0]


def _parity_row(result) -> dict:
    return next(r for r in result.rows if r["variant"] == "parity")


def test_a_library_run_does_not_replace_the_parity_verdicts_run(root):
    suite, library = _runs(root)
    result = build.build_report([], root=str(root))
    assert result.primary["parity"].path == suite and _parity_row(result)["run_id"] == suite.name
    assert "ran 1 of" in _parity_row(result)["reason"]  # judged on the suite run's own merits
    assert result.library.path == library
    # given as RUN folders, in either order: the same split
    for paths in ([str(suite), str(library)], [str(library), str(suite)]):
        given = build.build_report(paths, root=str(root))
        assert given.primary["parity"].path == suite and given.library.path == library


def test_only_a_library_run_leaves_parity_not_run(root):
    suite, library = _runs(root)
    shutil.rmtree(suite)
    result = build.build_report([], root=str(root))
    row = _parity_row(result)
    assert result.primary["parity"] is None and row["verdict"] == "not run" and "no parity run" in row["reason"]
    assert result.library.path == library
    assert HEADING in (result.path / "REPORT.md").read_text()


def test_the_section_has_the_conformance_table_and_a_figure(root):
    _, library = _runs(root)
    summary = json.loads((library / "summary.json").read_text())
    result = build.build_report([], root=str(root))
    md = (result.path / "REPORT.md").read_text()
    section = md[md.index(HEADING):]
    assert library.name in section
    assert ("| library | version | model | backend | EP mode | features | world | verdict | largest diff / tolerance "
            "| diagnosis |") in section
    for row in summary["rows"]:  # every row, with the values of summary.json
        assert row["features"] == ["loss-curve"]  # the fairscale rows also compare a 3-step loss curve
        assert (f"| {row['library']} | {row['version']} | {row['model']} | {row['backend']} | {row['ep_mode']} "
                f"| loss-curve | {row['world_size']} | {row['verdict']} |") in section
    png = result.path / "library.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and "library.png" in section
    assert "library.png" in json.loads((result.path / "summary.json").read_text())["figures"]
    assert 'class="fail"' not in (result.path / "report.html").read_text().split("Library conformance")[1]


def test_a_failed_row_shows_its_verdict_and_diagnosis(root):
    _, library = _runs(root)
    data = json.loads((library / "summary.json").read_text())
    data["rows"][0] = {**data["rows"][0], "verdict": "fail",
                       "diagnosis": "rank-local: gate/router wrong; grad gate.wg.weight never all-reduced",
                       "diagnosis_name": "rank-local"}
    (library / "summary.json").write_text(json.dumps(data))
    result = build.build_report([], root=str(root))
    md = (result.path / "REPORT.md").read_text()
    assert "| fail |" in md[md.index(HEADING):]
    assert "grad gate.wg.weight never all-reduced |" in md
    assert 'class="fail"' in (result.path / "report.html").read_text().split("Library conformance")[1]


def test_the_features_column_is_there_only_when_some_row_has_features(root):
    """DeepSpeed's engine rows share model, backend and EP mode and differ by their features: the report, like
    the console, shows a features column when some row has features ("-" for a plain row), and none when no
    row has any."""
    _, library = _runs(root)
    data = json.loads((library / "summary.json").read_text())
    data["rows"][0] = {**data["rows"][0], "features": ["grad-accum", "clip"]}
    data["rows"][1] = {**data["rows"][1], "features": []}
    (library / "summary.json").write_text(json.dumps(data))
    md = (build.build_report([], root=str(root)).path / "REPORT.md").read_text()
    section = md[md.index(HEADING):]
    assert "| library | version | model | backend | EP mode | features | world | verdict |" in section
    first, second = data["rows"][:2]
    assert f"| {first['ep_mode']} | grad-accum+clip | {first['world_size']} | {first['verdict']} |" in section
    assert f"| {second['ep_mode']} | - | {second['world_size']} | {second['verdict']} |" in section
    for row in data["rows"]:
        row["features"] = []
    (library / "summary.json").write_text(json.dumps(data))
    md = (build.build_report([], root=str(root)).path / "REPORT.md").read_text()
    assert "| library | version | model | backend | EP mode | world | verdict |" in md[md.index(HEADING):]


def test_the_console_names_the_library_run_apart_from_parity(root):
    suite, library = _runs(root)
    rows = json.loads((library / "summary.json").read_text())["rows"]
    out = _cli("report", "--results-dir", str(root))
    assert out.returncode == 0, out.stderr
    assert f"parity     {suite.name} (ok)" in out.stdout
    line = f"library    {library.name} (ok): {len(rows)} rows, {len(rows)} pass, 0 fail, 0 skip"
    assert line in out.stdout.splitlines() and len(line) <= 80


def test_a_refused_row_is_counted_as_refused(root):
    _, library = _runs(root)
    data = json.loads((library / "summary.json").read_text())
    data["rows"][0] = {**data["rows"][0], "verdict": "refused", "diagnosis_name": "refused",
                       "diagnosis": "refused: DeepSpeed refused the load: RuntimeError: parameter-alignment"}
    (library / "summary.json").write_text(json.dumps(data))
    md = (build.build_report([], root=str(root)).path / "REPORT.md").read_text()
    assert f"{len(data['rows']) - 1} pass, 0 fail, 0 skip, 1 refused by the library." in md
    assert "| refused |" in md[md.index(HEADING):]
    out = _cli("report", "--results-dir", str(root))
    assert f"{len(data['rows'])} rows, {len(data['rows']) - 1} pass, 0 fail, 0 skip, 1 refused" in out.stdout


def test_a_huge_or_infinite_ratio_keeps_its_bar_and_label_inside_the_axis(tmp_path):
    """A failing row can be 1e9 x its tolerance (or inf: a difference over an exact comparison's zero
    tolerance). Its bar stops at BAR_CAP and its label, the true number, starts there, inside the axis."""
    from moebench.report import figures

    rows = [("ok", 0.02, "pass"), ("far", 3.4e9, "fail"), ("exact-broken", float("inf"), "fail")]
    fig, ax = figures._ratio_bars(rows, size=(8, 3), with_status=True)
    ax.set_xlim(figures.TOLERANCE_FLOOR / 10, 1e6)  # as plot_library
    ends = [bar.get_x() + bar.get_width() for bar in ax.patches]
    assert ends[0] < 1 and all(end <= figures.BAR_CAP * 1.01 for end in ends[1:])
    labels = {t.get_text().strip(): t.get_position()[0] for t in ax.texts}
    assert labels == {"2.0e-02 pass": 0.02, "3.4e+09 fail": figures.BAR_CAP, "inf fail": figures.BAR_CAP}
    figures.pyplot().close(fig)
