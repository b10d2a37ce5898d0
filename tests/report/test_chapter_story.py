"""A run that is not the chapter's experiment tells one story everywhere: `run` says once that it
is not comparable and how to make it so, summary.json and `report` give the same short reason, the
figures carry no chapter marks, and English output uses English units (issue 18, item 3)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import warmcli

from moebench import published
from moebench.report import build, chapter, claims, figures

REASON_MAX_CHARS = 200
"""A verdict's reason is one line of a table: the full list of differing settings lives once, in
the variant's section of REPORT.md."""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return warmcli.run(args, timeout=300, env={**__import__("os").environ, "COLUMNS": "80"})


@pytest.fixture
def quick_runs(quick_runs_source, tmp_path) -> tuple[Path, dict[str, str]]:
    """A quick fastmoe run and a quick deepspeed run (tests/helpers/quickruns.py), copied: a test writes its
    report there; their console output."""
    source, consoles = quick_runs_source
    root = tmp_path / "story" / "results"
    for kind in ("fastmoe", "deepspeed"):
        shutil.copytree(source / kind, root / kind)
    return root, consoles


def _summary(root: Path, kind: str) -> dict:
    return json.loads((next((root / kind).iterdir()) / "summary.json").read_text())


@pytest.mark.parametrize("kind", ["fastmoe", "deepspeed"])
def test_a_quick_run_says_once_that_it_is_not_comparable_and_how(quick_runs, kind):
    root, consoles = quick_runs
    console = consoles[kind]
    assert console.count("not comparable with chapter 6") == 1, console
    assert f"for a comparable run: moebench run {kind} --preset chapter\n" in console  # whole, on its own line
    assert "measured vs chapter" not in console and "-99." not in console, console
    summary = _summary(root, kind)
    assert summary["chapter_comparable"] is False
    assert summary["chapter_note"].startswith("not comparable with chapter 6: preset quick differs (")
    # summary.json gives the verdicts `report` gives: not run, for the one reason
    assert {r["verdict"] for r in summary["chapter_comparison"]} == {claims.NOT_RUN}
    assert {r["reason"] for r in summary["chapter_comparison"]} == {summary["chapter_note"]}


def test_report_gives_the_reason_once_and_short(quick_runs, tmp_path):
    root, _ = quick_runs
    out = _cli("report", "--results-dir", str(root))
    assert out.returncode == 0, out.stderr
    report_md = Path(out.stdout.split("report: ", 1)[1].split()[0]).read_text()
    summary = json.loads((Path(out.stdout.split("report: ", 1)[1].split()[0]).parent / "summary.json").read_text())
    for kind in ("fastmoe", "deepspeed"):
        rows = [r for r in summary["verdicts"] if r["variant"] == kind]
        reasons = {r["reason"] for r in rows}
        assert len(reasons) == 1, reasons
        reason = reasons.pop()
        assert len(reason) <= REASON_MAX_CHARS and "\n" not in reason, reason
        assert "None" not in reason and f"moebench run {kind} --preset chapter" in reason, reason
        assert report_md.count(reason) == 1, f"{kind}: the reason is repeated in REPORT.md's verdict table"
        assert out.stdout.count(f"{kind}: not comparable") == 1, out.stdout  # the console says it once too
    assert "\n  run: moebench verify-parity --world-size 4\n" in out.stdout  # a command whole, on its own line
    assert "(chapter None)" not in report_md
    assert "steps 4 (chapter unset)" in report_md  # the whole list, once, in the fastmoe section


def test_a_run_that_is_not_the_chapter_gets_no_chapter_marks_on_its_figures(quick_runs, tmp_path, monkeypatch):
    root, _ = quick_runs
    drawn: dict[str, dict] = {}
    real_loss, real_params = figures.plot_loss, figures.plot_params

    def loss(metrics, path, **kw):
        drawn[path.name] = kw
        return real_loss(metrics, path, **kw)

    def params(by_category, published_counts, path, **kw):
        drawn[path.name] = {"published": published_counts}
        return real_params(by_category, published_counts, path, **kw)

    monkeypatch.setattr(figures, "plot_loss", loss)
    monkeypatch.setattr(figures, "plot_params", params)
    build.build_report([], root=str(root))
    for kind in ("fastmoe", "deepspeed"):
        assert drawn[f"loss-{kind}.png"]["chapter_marks"] == []
        assert drawn[f"params-{kind}.png"]["published"] == {}

    # the same run made the chapter's experiment gets them (the check above can fail)
    run = next((root / "fastmoe").iterdir())
    config = json.loads((run / "config.json").read_text())
    chapter_cfg = chapter.chapter_config("fastmoe")
    for section in ("model", "moe", "train"):
        config[section] = chapter_cfg[section]
    (run / "config.json").write_text(json.dumps(config))
    drawn.clear()
    build.build_report([], root=str(root))
    assert drawn["loss-fastmoe.png"]["chapter_marks"] and drawn["params-fastmoe.png"]["published"]


def test_no_label_covers_the_epoch_boundaries_text(monkeypatch, tmp_path):
    """A chapter mark whose value sits at the bottom of the axes (a run whose loss stays above the
    chapter's) once had its label drawn over "epoch boundaries"."""
    import matplotlib.text

    figures.pyplot()
    captured = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: captured.append(fig) or path)
    metrics = [{"step": s, "loss": 2.1 - 0.01 * s, "aux_loss": 2.0} for s in range(1, 17)]
    figures.plot_loss(metrics, tmp_path / "loss.png", title="t", steps_per_epoch=8, eval_loss=1.99, aux_coef=0.01,
                      chapter_marks=[(4.5, 1.784354, "chapter epoch 1 mean 1.784354")])
    (fig,) = captured
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]
    epoch = [t for t in texts if "epoch boundaries" in t.get_text()]
    assert epoch, "the epoch boundaries are not named"
    labels = [t for t in texts if isinstance(t, matplotlib.text.Annotation)]
    assert labels
    for text in epoch:
        box = text.get_window_extent(renderer)
        for label in labels:
            assert not box.overlaps(label.get_window_extent(renderer)), f"{label.get_text()!r} covers it"


def _is_cjk(ch: str) -> bool:
    return "\u2e80" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef"  # CJK and full-width forms


def test_published_figures_are_shown_in_english_units():
    for fig in (*published.FASTMOE, *published.DEEPSPEED):
        for text in (fig.label, fig.section, fig.unit, claims.format_published(fig.value, fig.unit)):
            assert not any(_is_cjk(ch) for ch in text), f"{fig.key}: {text!r}"
    assert any(fig.section.endswith("≈ 273 M") for fig in published.FASTMOE)


@pytest.mark.parametrize("kind", ["fastmoe", "deepspeed"])
def test_a_chapter_config_is_compared_and_a_seed_or_ep_size_does_not_change_that(kind):
    from moebench import config as config_tree
    from moebench import train, variants

    variant = variants.by_name(kind)
    summary = {"params": {"total": 273e6, "by_category": {}}, "loss": {"first": 2.0, "last": 1.1, "drop_pct": 45.0},
               "epoch_loss": [1.78, 1.5, 1.3, 1.1, 1.0], "test": {"input_shape": [32, 8, 512],
                                                                   "output_shape": [32, 8, 512]}}
    for overrides in ({}, {("train", "seed"): 7}):
        record = config_tree.as_dict(variants.resolve_config(variant, "chapter", overrides))
        out = train.with_comparison(summary, variant.published, kind=kind, config=record)
        assert out["chapter_comparable"] is True and "chapter_note" not in out
        assert any(r["verdict"] != claims.NOT_RUN for r in out["chapter_comparison"])
    record = config_tree.as_dict(variants.resolve_config(variant, "chapter", {("train", "lr"): 0.5}))
    out = train.with_comparison(summary, variant.published, kind=kind, config=record)
    assert out["chapter_comparable"] is False and "lr 0.5 (chapter 0.001)" in out["chapter_note"]
