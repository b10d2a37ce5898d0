"""`moebench report` shows the latest `verify-parity --library` run in a section of its own (issue 16:
"a section in moebench report (table plus figure)"), built from real small runs: a parity run of two
built-in checks, then a newer `--library fairscale` run at world size 2. The library run never replaces
the run the chapter's parity verdict is judged on."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import warmcli

from moebench.report import build

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADING = "## Library conformance (verify-parity --library)"

pytest.importorskip("fairscale")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return warmcli.run(args, timeout=300)  # tests/helpers/warmcli.py


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
    assert ("| library | version | model | backend | EP mode | features | world | verdict | largest diff / allowance "
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


def _as_new_run(run: Path, **summary_changes) -> Path:
    """A copy of a run folder under a newer run id (its summary changed as given)."""
    from moebench import results

    made = results.RunDir.create("parity", root=run.parent.parent).path
    for f in run.iterdir():
        shutil.copy(f, made / f.name)
    data = json.loads((made / "summary.json").read_text())
    data.update({"run_id": made.name, "run_path": str(made), **summary_changes})
    (made / "summary.json").write_text(json.dumps(data))
    return made


def test_an_interrupted_library_run_is_never_the_parity_claims_run(root):
    """Issue 32: a `--library deepspeed --resume` run interrupted before writing its rows was taken as the
    chapter's parity run ("0 reproduced, 0 differ, 17 not run") though a good suite run was on disk."""
    suite, library = _runs(root)
    interrupted = _as_new_run(library, status="interrupted", error="interrupted (SIGINT)")
    data = json.loads((interrupted / "summary.json").read_text())
    del data["rows"]  # it ended before writing them; its config.json still names rows
    (interrupted / "summary.json").write_text(json.dumps(data))
    result = build.build_report([], root=str(root))
    assert result.primary["parity"].path == suite and _parity_row(result)["run_id"] == suite.name
    assert interrupted in [r.path for r in result.libraries]


def test_the_parity_claim_comes_from_the_latest_complete_whole_suite_run(root):
    suite, _ = _runs(root)
    newer = _as_new_run(suite, status="interrupted", error="interrupted (SIGTERM)")
    result = build.build_report([], root=str(root))
    assert result.primary["parity"].path == suite  # not the newer interrupted one
    shutil.rmtree(suite)  # the only whole-suite run left is interrupted: reported as such
    result = build.build_report([], root=str(root))
    assert result.primary["parity"].path == newer and "was interrupted" in _parity_row(result)["reason"]


def test_every_library_run_since_and_the_latest_of_each_otherwise(root):
    """A fairscale run and a --ds-config run made before the latest run are listed, one table and one figure
    each; with --since, every library run since then."""
    _, library = _runs(root)
    other = _as_new_run(library, ds_config={"path": "/x/ds.json", "settings": {}})
    again = _as_new_run(library)  # the same thing verified again: the newest of the two is shown
    result = build.build_report([], root=str(root))
    assert [r.path for r in result.libraries] == [again, other]
    md = (result.path / "REPORT.md").read_text()
    assert md.count("| library | version |") == 2 and "--ds-config /x/ds.json" in md
    assert (result.path / "library.png").exists() and (result.path / f"library-{other.name}.png").exists()
    since = build.build_report([], root=str(root), since=library.name[:15])
    assert [r.path for r in since.libraries] == [again, other, library]
    out = _cli("report", "--results-dir", str(root))
    assert all(f"library    {r.name} (ok)" in out.stdout for r in (again, other))


def test_the_library_figure_has_every_row_refused_skipped_and_noise_judged_ones_too(monkeypatch, tmp_path):
    """Issue 32: library.png drew 42 of 54 rows (bf16 and refused ones left out, no note). Every row is on
    it now: a noise-judged row as its distance over the allowance, labelled; a refused or skipped one as its
    status and reason without a bar."""
    from moebench.report import figures

    captured = {}
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: captured.setdefault("fig", fig) and path)
    tol = {"kind": "allclose", "max_abs_diff": 1e-7, "atol": 1e-6, "rtol": 0.0, "magnitude": 1.0}
    checks = [{"name": "a/w2", "comparisons": [tol]},
              {"name": "b/w2/bf16", "comparisons": [{"kind": "equal", "used": 0.31}]},
              {"name": "c/w2/load", "comparisons": [], "reason": "DeepSpeed refused the load: RuntimeError"},
              {"name": "d/w2", "comparisons": [], "reason": "needs 4 ranks"}]
    rows = [{"check": "a/w2", "verdict": "pass"}, {"check": "b/w2/bf16", "verdict": "pass"},
            {"check": "c/w2/load", "verdict": "refused", "diagnosis": "refused: DeepSpeed refused the load"},
            {"check": "d/w2", "verdict": "skip"}]
    assert figures.plot_library(rows, checks, tmp_path / "x.png", title="t") is not None
    ax = captured["fig"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a/w2", "b/w2/bf16", "c/w2/load", "d/w2"]
    texts = [t.get_text() for t in ax.texts]
    assert any("3.1e-01 pass (noise model)" in t for t in texts)
    assert any(t.strip().startswith("refused: DeepSpeed refused the load") for t in texts)
    assert any(t.strip() == "skip: needs 4 ranks" for t in texts)
    assert len(ax.patches) == 2  # bars for the two rows with an allowance only
    figures.pyplot().close(captured["fig"])


def test_the_parity_figure_lists_every_check(monkeypatch, tmp_path):
    """Issue 32: parity.png drew 12 of 13 checks (the one with assertions only was left out)."""
    from moebench.report import figures

    captured = {}
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: captured.setdefault("fig", fig) and path)
    checks = [{"name": "ddp-sgd", "status": "pass", "comparisons": [
                  {"kind": "allclose", "max_abs_diff": 0.0, "atol": 1e-6, "rtol": 0.0, "magnitude": 1.0}]},
              {"name": "mp-group-rank", "status": "pass", "comparisons": [{"kind": "raises"}]},
              {"name": "deepspeed-moe-ep", "status": "skip", "reason": "needs DeepSpeed", "comparisons": []}]
    figures.plot_parity(checks, tmp_path / "p.png", title="t")
    ax = captured["fig"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ddp-sgd", "mp-group-rank", "deepspeed-moe-ep"]
    texts = [t.get_text().strip() for t in ax.texts]
    assert "pass: assertions only, no tolerance" in texts and "skip: needs DeepSpeed" in texts
    figures.pyplot().close(captured["fig"])


def test_escape_codes_in_a_results_file_never_reach_the_report(root):
    """A library run written before labels were checked (or by hand) may hold a terminal's escape sequences in its
    labels and diagnoses: REPORT.md and report.html show them escaped, never raw (issue 37)."""
    _, library = _runs(root)
    summary = json.loads((library / "summary.json").read_text())
    summary["rows"][0]["backend"] = "\x1b[31mred\x1b[0m"
    summary["rows"][0]["model"] = "bell\x07"
    (library / "summary.json").write_text(json.dumps(summary))
    result = build.build_report([], root=str(root))
    for name in ("REPORT.md", "report.html"):
        text = (result.path / name).read_text()
        assert "\x1b" not in text and "\x07" not in text, name
        assert "\\x1b[31mred\\x1b[0m" in text, name
