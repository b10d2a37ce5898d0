"""`moebench report`, built from fixture results: real (small) runs of every kind, then edited
copies of them for each situation (chapter values, a failed run, a missing one, ...)."""

from __future__ import annotations

import base64
import html.parser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import browser, warmcli

from moebench import published
from moebench.report import build, claims, collect, verdict_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return warmcli.run(args, timeout=300, **kw)  # tests/helpers/warmcli.py


@pytest.fixture(scope="session")
def source_results(quick_runs_source) -> Path:
    """One small real run of each kind (tests/helpers/quickruns.py): fastmoe with the gshard gate, DeepSpeed
    quick, two parity checks and more, env-check."""
    return quick_runs_source[0]


@pytest.fixture
def results_root(source_results, tmp_path) -> Path:
    root = tmp_path / "results"
    shutil.copytree(source_results, root)
    return root


def _run(root: Path, kind: str) -> Path:
    return next((root / kind).iterdir())


def _edit(path: Path, **changes) -> dict:
    data = json.loads(path.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    path.write_text(json.dumps(data))
    return data


def _as_chapter(root: Path, kind: str) -> Path:
    """Make a run's config.json the chapter preset's (the report then judges its numbers)."""
    run = _run(root, kind)
    config = json.loads((run / "config.json").read_text())
    chapter = verdict_rows.chapter_config(kind)
    for section in ("model", "moe", "train", "engine"):
        if section in chapter:
            config[section] = {**chapter[section], **{k: v for k, v in config.get(section, {}).items()
                                                      if (section, k) in collect.IGNORED_FOR_CHAPTER}}
    config["preset"] = "chapter"
    (run / "config.json").write_text(json.dumps(config))
    return run


def _rows(result, variant: str) -> dict[str, dict]:
    return {r["key"]: r for r in result.rows if r["variant"] == variant}


def test_every_section_is_present_in_both_renderings(results_root):
    result = build.build_report([], root=str(results_root))
    md = (result.path / "REPORT.md").read_text()
    page = (result.path / "report.html").read_text()
    for heading in ("Verdicts", "Environment", "fastmoe", "deepspeed", "Expert load", "Parity"):
        assert f"## {heading}" in md
        assert f"<h2>{heading}</h2>" in page
    assert published.CHAPTER in md  # cited by name, never by a path outside the repository
    assert "../shared" not in md and "../shared" not in page
    summary = json.loads((result.path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["kind"] == "report"
    assert summary["counts"] == result.counts
    assert sum(result.counts.values()) == len(result.rows) == len(published.FASTMOE) + len(published.DEEPSPEED) + 1


def test_numbers_equal_the_json_they_came_from(results_root):
    _as_chapter(results_root, "fastmoe")
    _as_chapter(results_root, "deepspeed")
    result = build.build_report([], root=str(results_root))
    md = (result.path / "REPORT.md").read_text()
    for kind in ("fastmoe", "deepspeed"):
        summary = json.loads((_run(results_root, kind) / "summary.json").read_text())
        for key, row in _rows(result, kind).items():
            expected = claims.lookup(summary, key)
            assert row["measured"] == expected, key
            if expected is not None:
                assert claims.format_number(expected, row["unit"]) in md, key
    fastmoe = json.loads((_run(results_root, "fastmoe") / "summary.json").read_text())
    assert _rows(result, "fastmoe")["params.total"]["measured"] == fastmoe["params"]["total"]
    assert _rows(result, "fastmoe")["data.batch_input_max"]["measured"] == fastmoe["data"]["batch_input_max"]
    ds = json.loads((_run(results_root, "deepspeed") / "summary.json").read_text())
    drop = _rows(result, "deepspeed")["derived.epoch_loss_drop_pct"]
    assert drop["measured"] is None  # a 2-epoch run has no epoch 5
    assert _rows(result, "deepspeed")["epoch_loss.1"]["measured"] == ds["epoch_loss"][0]
    parity = json.loads((_run(results_root, "parity") / "summary.json").read_text())
    assert f"{parity['counts']['pass']} pass" in _rows(result, "parity")["parity"]["measured"]


def test_a_run_that_is_not_the_chapter_experiment_is_not_judged(results_root):
    result = build.build_report([], root=str(results_root))
    for row in _rows(result, "fastmoe").values():
        assert row["verdict"] == claims.NOT_RUN
        assert "not comparable with chapter 6" in row["reason"] and "d_model 64 (chapter 1024)" in row["reason"]
        assert "moebench run fastmoe --preset chapter" in row["reason"]


@pytest.mark.parametrize("factor,verdict", [(1.0, "reproduced"), (1.09, "reproduced"), (1.2, "differs"),
                                            (0.85, "differs")])
def test_verdict_follows_the_tolerance(results_root, factor, verdict):
    run = _as_chapter(results_root, "fastmoe")
    _edit(run / "summary.json", loss__last=1.11 * factor)
    result = build.build_report([], root=str(results_root))
    row = _rows(result, "fastmoe")["loss.last"]
    assert row["verdict"] == verdict
    if verdict == "differs":
        assert "the chapter prints no batch size" in row["reason"]  # the likely cause
        assert row["difference"] == pytest.approx(1.11 * factor - 1.11)


def test_known_differences_carry_their_explanation(results_root):
    run = _as_chapter(results_root, "fastmoe")
    _edit(run / "summary.json", params__by_category__attention=4 * 1024**2 + 4 * 1024)
    row = _rows(build.build_report([], root=str(results_root)), "fastmoe")["params.by_category.attention"]
    assert row["verdict"] == "differs" and "4·d² + 4·d" in row["reason"]


def test_shapes_are_compared_exactly(results_root):
    run = _as_chapter(results_root, "deepspeed")
    _edit(run / "summary.json", test__input_shape=[32, 8, 512], test__output_shape=[32, 8, 511])
    rows = _rows(build.build_report([], root=str(results_root)), "deepspeed")
    assert rows["test.input_shape"]["verdict"] == "reproduced"
    assert rows["test.output_shape"]["verdict"] == "differs"


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_a_failed_or_interrupted_run_is_reported_as_such(results_root, status):
    run = _as_chapter(results_root, "fastmoe")
    _edit(run / "summary.json", status=status, error="RuntimeError: boom at step 3")
    result = build.build_report([], root=str(results_root))
    for row in _rows(result, "fastmoe").values():
        assert row["verdict"] == "not run"
        assert run.name in row["reason"] and ("failed" if status == "failed" else "was interrupted") in row["reason"]
        assert "boom at step 3" in row["reason"]
    md = (result.path / "REPORT.md").read_text()
    assert f"status {status}" in md


@pytest.mark.no_schema_check
def test_an_abandoned_run_is_reported_as_such(results_root):
    run = _as_chapter(results_root, "deepspeed")
    _edit(run / "summary.json", status="running", pid=2**22 + 12345)  # a writer that is gone
    rows = _rows(build.build_report([], root=str(results_root)), "deepspeed")
    assert all(r["verdict"] == "not run" and "abandoned" in r["reason"] for r in rows.values())


def test_a_missing_run_is_not_run(results_root):
    shutil.rmtree(results_root / "deepspeed")
    shutil.rmtree(results_root / "parity")
    result = build.build_report([], root=str(results_root))
    for r in _rows(result, "deepspeed").values():
        assert r["verdict"] == "not run" and f"no deepspeed run under {results_root}" in r["reason"]
        assert "moebench run deepspeed --preset chapter" in r["reason"]
    assert _rows(result, "parity")["parity"]["verdict"] == "not run"
    assert "Not run: no deepspeed run found" in (result.path / "REPORT.md").read_text()


def test_since_ignores_older_runs(results_root):
    result = build.build_report([], root=str(results_root), since="2999-01-01T00:00:00")
    assert result.counts["not run"] == len(result.rows)
    assert all("started since 2999-01-01T00:00:00" in r["reason"] for r in result.rows)


def test_a_failing_parity_check_differs(results_root):
    run = _run(results_root, "parity")
    data = json.loads((run / "summary.json").read_text())
    data["counts"] = {"pass": 1, "fail": 1, "skip": 0}
    data["checks"][0]["status"] = "fail"
    data["status"] = "failed"
    (run / "summary.json").write_text(json.dumps(data))
    row = _rows(build.build_report([], root=str(results_root)), "parity")["parity"]
    assert row["verdict"] == "differs" and data["checks"][0]["name"] in row["reason"]


def test_figures_are_non_empty_pngs(results_root):
    result = build.build_report([], root=str(results_root))
    names = {p.name for p in result.path.glob("*.png")}
    assert {"params-fastmoe.png", "params-deepspeed.png", "loss-fastmoe.png", "loss-deepspeed.png",
            "experts-fastmoe.png", "experts-deepspeed.png", "parity.png"} <= names
    import matplotlib.image

    for name in names:
        data = (result.path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name
        pixels = matplotlib.image.imread(result.path / name)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 500 and pixels.std() > 0.01, name  # not blank


class _Checker(html.parser.HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.images: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def test_html_is_well_formed_and_embeds_every_figure(results_root):
    result = build.build_report([], root=str(results_root))
    page = (result.path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    checker = _Checker()
    checker.feed(page)
    assert not checker.errors and not checker.stack
    embedded = sorted(base64.b64decode(src.split(",", 1)[1]) for src in checker.images)
    assert all(src.startswith("data:image/png;base64,") for src in checker.images)  # nothing fetched
    assert embedded == sorted(p.read_bytes() for p in result.path.glob("*.png"))
    assert "http://" not in page and "https://" not in page


def test_several_runs_of_one_kind_are_compared(results_root, tmp_path):
    first = _run(results_root, "fastmoe")
    out = _cli("run", "fastmoe", "--steps", "6", "--lr", "0.01", "--results-dir", str(results_root))
    assert out.returncode == 0, out.stderr
    second = next(p for p in (results_root / "fastmoe").iterdir() if p != first)
    result = build.build_report([str(first), str(second)], root=str(results_root))
    md = (result.path / "REPORT.md").read_text()
    assert "## Comparison: 2 fastmoe runs" in md
    assert "| train.lr | 0.003 | 0.01 |" in md and "| train.steps | 4 | 6 |" in md
    assert (result.path / "compare-fastmoe.png").stat().st_size > 5_000
    assert [r.path for r in result.runs["fastmoe"]] == [first, second]
    assert result.runs["deepspeed"] == []  # only what was given


def test_cli_prints_the_verdicts_and_the_path(results_root):
    # a fresh interpreter, as a user's: the report command's one test without the warm one
    out = _cli("report", "--results-dir", str(results_root), env={"COLUMNS": "80", **_env()}, fresh=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines[:-2]) <= 80  # the two paths are printed whole
    assert "chapter 6: verdicts" in out.stdout and "fastmoe: parameters, total" in out.stdout
    assert lines[-2].startswith("report: ") and lines[-2].endswith("REPORT.md")
    assert lines[-1].strip().endswith("report.html")
    doc = json.loads(_cli("report", "--json", "--results-dir", str(results_root)).stdout)
    assert Path(doc["report_path"]).is_dir() and len(doc["verdicts"]) == sum(doc["counts"].values())


def _env():
    import os

    return dict(os.environ)


@pytest.mark.parametrize("args,flag", [(["no/such/run"], "RUN"), (["--since", "yesterday"], "--since"),
                                       (["--results-dir", " "], "--results-dir")])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(results_root, args, flag):
    out = _cli("report", *args, "--results-dir", str(results_root)) if "--results-dir" not in args else \
        _cli("report", *args)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and flag in out.stderr and "Traceback" not in out.stderr
    assert not (results_root / "report").exists()


def test_a_run_given_twice_or_of_another_kind_is_refused(results_root):
    run = str(_run(results_root, "fastmoe"))
    out = _cli("report", run, run, "--results-dir", str(results_root))
    assert out.returncode == 2 and "given twice" in out.stderr
    build.build_report([], root=str(results_root))
    report_run = str(_run(results_root, "report"))
    out = _cli("report", report_run, "--results-dir", str(results_root))
    assert out.returncode == 2 and "'report' run" in out.stderr


def test_every_published_figure_has_a_reasoned_tolerance():
    for fig in (*published.FASTMOE, *published.DEEPSPEED):
        assert fig.section and fig.label
        if isinstance(fig.value, tuple):
            assert fig.tolerance_text() == "exact"
        else:
            assert fig.tolerance > 0 and fig.tolerance_reason, fig.key
        assert fig.known_difference or fig.if_differs or fig.key.startswith("params."), fig.key


@pytest.mark.browser
def test_report_renders_in_headless_chromium(results_root, tmp_path):
    """report.html in a real browser (Debian's `chromium`, headless): every figure loaded (an <img> with a
    non-zero naturalWidth), every table rendered (a height, body rows), read back from the page by a checker
    script injected into a copy of it (tests/helpers/browser.py says how); then a screenshot of the whole page,
    kept in tmp_path (its path is printed)."""
    chromium = browser.find()
    result = build.build_report([], root=str(results_root))
    page = result.path / "report.html"
    text = page.read_text()
    checked = browser.check_page(chromium, page, tmp_path)
    assert len(checked["images"]) == text.count("<img ") >= 6, checked["images"]  # every PNG the report drew
    assert len(checked["tables"]) == text.count("<table>") >= 4, checked["tables"]
    assert browser.problems(checked) == []
    shot = browser.screenshot(chromium, page, tmp_path / "report.png", checked["height"])
    print(f"screenshot of the report in chromium: {shot}")
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (min(checked["height"], browser.MAX_SHOT_HEIGHT), browser.WIDTH)
    assert pixels.std() > 0.05  # text, tables and figures, not an empty page


@pytest.mark.browser
def test_the_browser_check_finds_a_broken_figure_and_an_empty_table(results_root, tmp_path):
    """The check above can fail: in a copy of the page one embedded figure's PNG is cut to its first bytes and
    one table loses its rows; the browser reports exactly those two."""
    chromium = browser.find()
    result = build.build_report([], root=str(results_root))
    text = (result.path / "report.html").read_text()
    images = list(re.finditer(r'src="data:image/png;base64,([^"]+)"', text))
    second = images[1]
    cut = base64.b64encode(base64.b64decode(second.group(1))[:40]).decode("ascii")  # a PNG's header, no image
    text = text[:second.start(1)] + cut + text[second.end(1):]
    last_body = text.rindex("<tbody>")
    text = text[:last_body] + "<tbody>" + text[text.index("</tbody>", last_body):]
    broken = tmp_path / "broken.html"
    broken.write_text(text)
    found = browser.problems(browser.check_page(chromium, broken, tmp_path))
    tables = text.count("<table>")
    assert len(found) == 2, found
    assert found[0].startswith("figure 2 did not load (0x0): "), found
    assert found[1].startswith(f"table {tables} did not render ("), found


def test_both_variants_record_routing_per_step(source_results):
    """What the expert-load figures are drawn from: kept routes per expert per step, and the drops."""
    fastmoe = _run(source_results, "fastmoe")
    config = json.loads((fastmoe / "config.json").read_text())
    routes = config["train"]["batch_size"] * config["train"]["seq_len"] * config["moe"]["top_k"]
    for line in (fastmoe / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kept = sum(sum(layer) for layer in record["tokens_per_expert"])
        layers = len(record["tokens_per_expert"])
        assert record["dropped_route_frac"] == pytest.approx((routes * layers - kept) / (routes * layers))
    summary = json.loads((fastmoe / "summary.json").read_text())
    assert 0 < summary["routing"]["dropped"]  # gshard drops at capacity
    data = summary["data"]
    assert data["input_min"] <= data["batch_input_min"] < data["batch_input_max"] <= data["input_max"]

    ds = _run(source_results, "deepspeed")
    ds_summary = json.loads((ds / "summary.json").read_text())
    per_step = [json.loads(line) for line in (ds / "metrics.jsonl").read_text().splitlines()]
    for layer, totals in enumerate(ds_summary["routing"]["per_layer"]):
        summed = [sum(rec["tokens_per_expert"][layer][e] for rec in per_step) for e in range(totals["experts"])]
        assert summed == totals["tokens_kept_per_expert"]  # per step adds up to the run's totals


def test_the_latest_bench_is_shown_whatever_its_date(results_root):
    out = _cli("bench", "--experts", "4", "--tokens", "256", "--top-k", "2", "--d-model", "64", "--d-hidden", "128",
               "--layers", "ideal,reference", "--ep-layers", "none", "--repeats", "1", "--no-profile",
               "--results-dir", str(results_root))
    assert out.returncode == 0, out.stderr
    bench = json.loads((_run(results_root, "bench") / "summary.json").read_text())
    result = build.build_report([], root=str(results_root), since="2999-01-01T00:00:00")
    md = (result.path / "REPORT.md").read_text()
    assert "## Layer speed (moebench bench)" in md and bench["run_id"] in md
    reference = next(r for r in bench["rows"] if r["layer"] == "reference")
    assert f"| reference | 4 | 256 | 2 | {reference['tokens_per_s']:,.0f} |" in md
    assert list(result.path.glob("bench-*.png"))  # copied beside the report, so the HTML embeds them

    # A newer --train run adds its table; the sweep's rows still come from the sweep.
    out = _cli("bench", "--train", "--preset", "quick", "--repeats", "1", "--results-dir", str(results_root))
    assert out.returncode == 0, out.stderr
    md = (build.build_report([], root=str(results_root)).path / "REPORT.md").read_text()
    assert f"| reference | 4 | 256 | 2 | {reference['tokens_per_s']:,.0f} |" in md
    assert "| fastmoe (quick) | optimizer |" in md and "| deepspeed (quick) | forward |" in md


def test_parity_is_judged_on_the_whole_suite_only(results_root):
    from moebench.parity import registry

    row = _rows(build.build_report([], root=str(results_root)), "parity")["parity"]
    ran = len(json.loads((_run(results_root, "parity") / "summary.json").read_text())["checks"])
    assert row["verdict"] == "not run" and f"ran {ran} of" in row["reason"] and "without --checks" in row["reason"]
    run = _run(results_root, "parity")
    data = json.loads((run / "summary.json").read_text())
    template = data["checks"][0]
    data["checks"] = [{**template, "name": check.name} for check in registry.all_checks()]
    data["counts"] = {"pass": len(data["checks"]), "fail": 0, "skip": 0}
    (run / "summary.json").write_text(json.dumps(data))
    row = _rows(build.build_report([], root=str(results_root)), "parity")["parity"]
    assert row["verdict"] == "reproduced" and row["measured"].startswith(f"{len(data['checks'])} pass")


def test_the_chapter_run_is_judged_whatever_the_order_or_a_newer_quick_run(results_root):
    chapter = _as_chapter(results_root, "fastmoe")
    out = _cli("run", "fastmoe", "--steps", "3", "--results-dir", str(results_root))  # newer, not the chapter's
    assert out.returncode == 0, out.stderr
    quick = next(p for p in (results_root / "fastmoe").iterdir() if p != chapter)
    for paths in ([], [str(quick), str(chapter)], [str(chapter), str(quick)]):
        result = build.build_report(paths, root=str(results_root))
        assert result.primary["fastmoe"].path == chapter
        assert all(r["run_id"] == chapter.name and r["verdict"] != "not run" or r["key"].startswith("data.")
                   for r in _rows(result, "fastmoe").values())
    cli = _cli("report", "--results-dir", str(results_root))
    assert f"fastmoe    {chapter.name} (ok)" in cli.stdout  # the console names the runs it judged


def test_a_kind_not_among_the_given_runs_says_so(results_root):
    result = build.build_report([str(_run(results_root, "fastmoe"))], root=str(results_root))
    deepspeed = _rows(result, "deepspeed").values()
    assert all("no deepspeed run among the RUN folders given" in r["reason"] for r in deepspeed)
    assert "no parity run among the RUN folders given" in _rows(result, "parity")["parity"]["reason"]


@pytest.mark.no_schema_check
def test_a_damaged_summary_is_not_judged_given_or_latest(results_root):
    run = _run(results_root, "deepspeed")
    text = (run / "summary.json").read_text()
    (run / "summary.json").write_text(text[: len(text) // 2])
    out = _cli("report", str(run), "--results-dir", str(results_root))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert f"not judged (5 deepspeed claim(s)): run {run.name} is damaged:\n  summary.json: not JSON (cut short?)" \
        in out.stdout, out.stdout
    rows = _rows(build.build_report([], root=str(results_root)), "deepspeed")
    assert all(r["verdict"] == "not run" and r["reason"].startswith(f"not judged: run {run.name} is damaged "
                                                                    "(summary.json: not JSON (cut short?)")
               for r in rows.values())


def test_a_results_dir_that_does_not_exist_is_an_error(tmp_path):
    out = _cli("report", "--results-dir", str(tmp_path / "typo"))
    assert out.returncode == 2 and "--results-dir" in out.stderr and "does not exist" in out.stderr
    assert not (tmp_path / "typo").exists()


def test_html_has_no_raw_markdown(results_root):
    page = (build.build_report([], root=str(results_root)).path / "report.html").read_text()
    assert "`" not in page and "<code>moebench run fastmoe --preset chapter</code>" in page


def test_the_drop_tolerance_carries_the_end_loss_tolerance():
    fig = next(f for f in published.FASTMOE if f.key == "loss.drop_pct")
    assert fig.tolerance == pytest.approx(100 * published.LOSS_REL * 1.11 / 2.04)  # 5.44 pp
    ds = next(f for f in published.DEEPSPEED if f.key == "derived.epoch_loss_drop_pct")
    assert ds.tolerance == pytest.approx(100 * published.LOSS_REL * 1.000710 / 1.784354)
