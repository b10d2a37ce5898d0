"""Generated damage, value by value (issue 37): `moebench report` reads ANY results file without a traceback.

Real runs of every kind a report reads (the session's quick runs: fastmoe, deepspeed, a parity suite, env-check;
then a `verify-parity --library fairscale` run at world size 2, a tiny bench sweep, the recorded gpu-check
run and a `moebench checkpoint --against` audit), and in each of their files, at every numeric leaf (and every
null one: a `real_or_null` such as a comparison's noise-model `used`), each of: "nan", "inf", "-inf" (how
moebench.results.to_jsonable writes a non-finite float), a non-numeric string, null; every key deleted; the file
cut in half. One case is one change in one file of a copy of that run's kind folder (a run of each other kind
would only redraw the same figures).

What each case must give, decided by the schema (moebench.results.read_run, the reader the report uses):
- a change the schema accepts ("nan" where a `real` is declared, a field it leaves open) renders: the report is
  written, its run is shown and nothing is called damaged;
- one it rejects is named: `damaged: <file>: <reason>` in the report's list of the runs it read;
- never a traceback, never an exit other than 0 (a one-line error would be allowed: none is expected here).

Cases are one per (file, key path with list indices as `*`): the first place each field occurs. The default
tier runs a sample drawn with a fixed seed (one case per kind of change, and the issue's own cases); the slow
tier runs every case (tests/tiers.py). Figures are drawn: a non-finite number breaks a plot, not a table."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
from helpers import warmcli

from moebench import results
from moebench.report import build
from moebench.report.render import _md_cell
from moebench.schemas import SCHEMA_FILES

pytestmark = [pytest.mark.no_schema_check,  # the cases damage results files on purpose
              pytest.mark.multirank]  # the library run starts 2 ranks

SUBSTITUTES: dict[str, Any] = {"nan": "nan", "inf": "inf", "-inf": "-inf", "text": "not a number", "null": None}
"""A number's replacement, by name ("nan", "inf", "-inf": what the schemas' `real` allows besides a number)."""
CHANGES = (*SUBSTITUTES, "delete", "truncate")
SEED = 37
LIBRARY = ["verify-parity", "--library", "fairscale", "--world-size", "2"]
BENCH = ["bench", "--experts", "2", "--tokens", "16", "--top-k", "1", "--d-model", "8", "--d-hidden", "8",
         "--layers", "ideal,reference", "--ep-layers", "none", "--repeats", "1", "--warmup", "0", "--no-profile"]


@dataclasses.dataclass(frozen=True)
class Case:
    run: str
    """kind/run-id, relative to the results folder."""
    file: str
    change: str
    path: tuple = ()
    """Where in the document (metrics.jsonl: the line's index first); () for a truncation."""
    library: bool = False
    """The run is a `verify-parity --library` run."""

    def __str__(self) -> str:
        where = "".join(f"[{p!r}]" for p in self.path)
        return f"{self.run}/{self.file}{where} {self.change}"


@pytest.fixture(scope="module")
def every_kind(quick_runs_source, tmp_path_factory) -> Path:
    """A results folder with a healthy run of every kind a report reads (about 2 s beside the session's
    quick runs)."""
    pytest.importorskip("fairscale")
    root = tmp_path_factory.mktemp("every-kind") / "results"
    shutil.copytree(quick_runs_source[0], root)
    for args in (LIBRARY, BENCH):
        done = warmcli.run([*args, "--results-dir", str(root)], timeout=300)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    from helpers.gpucheck import write_recorded_run

    write_recorded_run(root)  # gpu-check needs a CUDA GPU: its recorded files (tests/gpucheck/recorded/)
    from helpers.checkpoints import audited, write_safetensors

    ckpt = tmp_path_factory.mktemp("checkpoint")
    audited(write_safetensors(ckpt / "sound"), root, against=write_safetensors(ckpt / "strided", order=[0, 2, 1, 3]))
    return root


# --------------------------------------------------------------------------- the cases, generated


def _read(path: Path) -> Any:
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines()] if path.name.endswith(".jsonl") else json.loads(text)


def _write(path: Path, doc: Any) -> None:
    if path.name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(line) + "\n" for line in doc))
    else:
        path.write_text(json.dumps(doc, indent=2))


def _leaves(doc: Any, path: tuple = ()):
    """(key path, value) of every leaf and every dict key's value, depth first."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield (*path, key), value
            yield from _leaves(value, (*path, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _leaves(value, (*path, index))


def _pattern(path: tuple) -> tuple:
    return tuple("*" if isinstance(p, int) else p for p in path)


def cases(root: Path) -> list[Case]:
    """Every case, one per (file, field, change): the first occurrence of each field."""
    out: list[Case] = []
    for file in sorted(p for p in root.glob("*/*/*") if p.name in SCHEMA_FILES and p.parent.parent.name != "report"):
        run = f"{file.parent.parent.name}/{file.parent.name}"
        library = "rows" in _read(file.parent / "summary.json") and file.parent.parent.name == "parity"
        seen: set[tuple] = set()
        for path, value in _leaves(_read(file)):
            if _pattern(path) in seen:
                continue
            seen.add(_pattern(path))
            numeric = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
            changes = [*(c for c in SUBSTITUTES if numeric and SUBSTITUTES[c] != value), "delete"]
            out += [Case(run, file.name, change, path, library) for change in changes]
        out.append(Case(run, file.name, "truncate", library=library))
    return out


def _apply(case: Case, root: Path) -> None:
    path = root / case.run / case.file
    if case.change == "truncate":
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
        return
    doc = _read(path)
    parent = doc
    for key in case.path[:-1]:
        parent = parent[key]
    if case.change == "delete":
        del parent[case.path[-1]]
    else:
        parent[case.path[-1]] = SUBSTITUTES[case.change]
    _write(path, doc)


def _issue_cases(all_cases: list[Case]) -> list[Case]:
    """The issue's: a library run's comparison whose noise-model ratio (`used`) or difference is "nan"."""
    wanted = []
    for field in ("used", "max_abs_diff"):
        wanted.append(next(c for c in all_cases if c.change == "nan" and c.path[-1:] == (field,)
                           and "comparisons" in c.path and c.library and c.file == "summary.json"))
    return wanted


def sample(all_cases: list[Case]) -> list[Case]:
    """The default tier's cases: the issue's, and one of each change drawn with SEED among the files a report reads
    numbers from (summary, metrics, params, gpucheck), each change in a run of another kind (in turn)."""
    rng = random.Random(SEED)
    read = [c for c in all_cases if c.file in ("summary.json", "metrics.jsonl", "params.json", "gpucheck.json")]
    kinds = sorted({c.run.split("/")[0] for c in read})
    rng.shuffle(kinds)
    chosen = _issue_cases(all_cases)
    for turn, change in enumerate(CHANGES):
        pool = [c for c in read if c.change == change and c not in chosen]
        chosen.append(rng.choice([c for c in pool if c.run.startswith(f"{kinds[turn % len(kinds)]}/")] or pool))
    return chosen


# --------------------------------------------------------------------------- one case


def _case_root(every_kind: Path, case: Case, tmp: Path) -> Path:
    """A results folder holding a copy of the case's kind folder (every run of that kind: a parity suite and a
    library run side by side), with the case's change made."""
    root = tmp / "results"
    kind = case.run.split("/")[0]
    shutil.copytree(every_kind / kind, root / kind)
    _apply(case, root)
    return root


def _check(case: Case, root: Path) -> str:
    """What is wrong with the report of one case ("" when it is right)."""
    run = root / case.run
    damage = results.read_run(run).damage
    try:
        result = build.build_report([], root=str(root))
    except Exception as exc:  # noqa: BLE001 - what the issue is about: say where, go on with the other cases
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno} {frame.name})"
    md = (result.path / "REPORT.md").read_text()
    if damage:
        if not damage.startswith(f"{case.file}: "):
            return f"the damage names another file: {damage}"
        if _md_cell(f"damaged: {damage}") not in md:
            return f"REPORT.md does not name the damage `damaged: {damage}`"
    else:
        if run.name not in md and not _holds_nothing_shown(run):
            return "REPORT.md does not show the run (the change is one the schema accepts)"
        if "damaged:" in md:
            return "REPORT.md calls something damaged though the schema accepts the change"
    written = results.read_back(result.path / "summary.json")
    return "" if written["status"] == "ok" else f"the report's status is {written['status']}"


def _holds_nothing_shown(run: Path) -> bool:
    """A bench run with neither a layer sweep (`rows`) nor a --train breakdown: a report shows the latest bench
    run that has one, and leaves out one that has neither (deleting `rows` makes one)."""
    summary = results.read_back(run / "summary.json")
    return summary["kind"] == "bench" and not summary.get("rows") and not summary.get("train")


def _check_cli(case: Case, root: Path) -> str:
    """The real command on the same folder: exit 0 (or one line on stderr), no traceback."""
    done = warmcli.run(["report", "--results-dir", str(root)], timeout=300)
    if "Traceback" in done.stdout + done.stderr:
        return f"a traceback:\n{done.stderr[-3000:]}"
    if done.returncode != 0 and len(done.stderr.strip().splitlines()) != 1:
        return f"exit {done.returncode}, stderr not one line:\n{done.stderr}"
    damage = results.read_run(root / case.run).damage
    if damage and f"run {Path(case.run).name} is damaged:" not in done.stdout:
        return f"the console does not name the damaged run:\n{done.stdout}"
    return ""


def _run_cases(every_kind: Path, chosen: list[Case], tmp_path: Path, *, cli: list[Case] = ()) -> None:
    failures = []
    for number, case in enumerate(chosen):
        root = _case_root(every_kind, case, tmp_path / f"case-{number}")
        if problem := _check(case, root):
            failures.append(f"{case}: {problem}")
        if case in cli and (problem := _check_cli(case, root)):
            failures.append(f"{case} (moebench report): {problem}")
    if len(chosen) < 50:
        print("cases:", *chosen, sep="\n  ")
    print(f"{len(chosen)} damaged files, {len(cli)} through the real command; {len(failures)} wrong")
    assert not failures, f"{len(failures)} of {len(chosen)} cases:\n" + "\n".join(failures)


# --------------------------------------------------------------------------- the tests


def test_the_healthy_runs_of_every_kind_render_together(every_kind, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(every_kind, root)
    result = build.build_report([], root=str(root))
    md = (result.path / "REPORT.md").read_text()
    for run in root.glob("*/*"):
        if run.parent.name != "report":
            assert run.name in md, run
    assert "damaged" not in md and result.library is not None


def test_sampled_damage_renders_or_is_named(every_kind, tmp_path):
    """The default tier's sample (a fixed seed): one case of each change, the issue's two (a library run's
    comparison with `used` or `max_abs_diff` "nan"); the issue's first and a rejected one through the real
    command too."""
    all_cases = cases(every_kind)
    assert {c.run.split("/")[0] for c in all_cases} >= {"fastmoe", "deepspeed", "parity", "env", "bench",
                                                         "gpu-check"}
    chosen = sample(all_cases)
    rejected = next(c for c in chosen if c.change == "text")
    _run_cases(every_kind, chosen, tmp_path, cli=[chosen[0], rejected])


@pytest.mark.slow
def test_every_damage_renders_or_is_named(every_kind, tmp_path):
    all_cases = cases(every_kind)
    cli = random.Random(SEED).sample(all_cases, 20)
    _run_cases(every_kind, all_cases, tmp_path, cli=cli)


def test_a_nan_ratio_is_said_non_finite_never_drawn_as_a_pass(monkeypatch, tmp_path):
    """The issue's row: a library check whose noise-model ratio (`used`) or difference is "nan" in the file has a
    NaN share of its allowance whatever else it compared, whichever comes first; the figure draws it no bar (and
    never one in the pass colour) but "non-finite (nan)", and the table says the same."""
    import math

    import matplotlib.colors

    from moebench.report import figures

    captured = {}
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: captured.setdefault("fig", fig) and path)
    ok = {"kind": "allclose", "max_abs_diff": 1e-7, "atol": 1e-6, "rtol": 0.0, "magnitude": 1.0}
    checks = [{"name": "a/w2/bf16", "comparisons": [ok, {"kind": "equal", "used": "nan"}]},
              {"name": "b/w2", "comparisons": [{**ok, "max_abs_diff": "nan"}, ok]},
              {"name": "c/w2", "comparisons": [ok]}]
    assert all(math.isnan(figures.check_ratio(c)) for c in checks[:2])
    assert math.isnan(figures.check_ratio({"comparisons": [{"kind": "equal", "used": "nan"}, ok]}))  # either order
    assert figures.ratio_text(figures.check_ratio(checks[0])) == "non-finite (nan)"
    rows = [{"check": c["name"], "verdict": "pass"} for c in checks]
    assert figures.plot_library(rows, checks, tmp_path / "x.png", title="t") is not None
    ax = captured["fig"].axes[0]
    (bar,) = ax.patches  # c/w2's, the third row: the two NaN rows have none
    assert bar.get_y() + bar.get_height() / 2 == pytest.approx(2) and bar.get_facecolor()[:3] == pytest.approx(
        matplotlib.colors.to_rgb(figures.COLORS["measured"]))
    texts = {t.get_text().strip(): t.get_color() for t in ax.texts}
    assert texts["non-finite (nan): pass (noise model)"] == figures.COLORS["chapter"]
    assert texts["non-finite (nan): pass"] == figures.COLORS["chapter"]
    figures.pyplot().close(captured["fig"])
