"""Files read back survive damage: every results file kind x every way of damaging it, through
`moebench runs` and `moebench report` in-process. The damaged run is listed `damaged: <file>:
<reason>`, the other runs as usual; the report says which claims (or section) it could not judge
and why. No traceback, no crash, exit 0.

The cases are generated: a new file kind in a run folder (moebench.schemas.SCHEMA_FILES) is
damaged every way the day it appears; a new damage is one entry of DAMAGES."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from moebench import results
from moebench.cli.app import app
from moebench.schemas import SCHEMA_FILES

pytestmark = [pytest.mark.no_schema_check,  # these tests damage results files on purpose
              pytest.mark.multirank]  # the healthy parity run starts 2 ranks
runner = CliRunner()

BENCH = ["bench", "--experts", "2", "--tokens", "16", "--top-k", "1", "--d-model", "8", "--d-hidden", "8",
         "--layers", "ideal,reference", "--ep-layers", "none", "--repeats", "1", "--warmup", "0", "--no-profile"]
HEALTHY = {
    "fastmoe": ["run", "fastmoe", "--steps", "2"],
    "parity": ["verify-parity", "-n", "2", "--checks", "all-gather-variable"],
    "env": ["env-check", "--no-probe"],
    "bench": BENCH,
}
"""One real run of each kind a report reads (deepspeed's files are fastmoe's kinds)."""


def _cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("healthy") / "results"
    for kind, args in HEALTHY.items():
        done = _cli(*args, "--results-dir", str(root))
        assert done.exit_code == 0, (kind, done.output)
    from helpers.gpucheck import write_recorded_run

    write_recorded_run(root)  # gpu-check needs a CUDA GPU: its recorded files (tests/gpucheck/recorded/)
    from helpers.checkpoints import audited, write_safetensors

    audited(write_safetensors(tmp_path_factory.mktemp("checkpoint") / "sound"), root)  # a sound audit's files
    return root


def _file_kinds(root: Path) -> list[tuple[str, str]]:
    """(run kind, file name) of every file with a schema in the healthy runs."""
    return sorted((run.parent.name, f.name) for run in root.glob("*/*") for f in run.iterdir()
                  if f.name in SCHEMA_FILES)


# --------------------------------------------------------------------------- damage, generated


def _numbers(doc: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(key path, value) of every number in a document, depth first (bools are not numbers)."""
    if isinstance(doc, dict):
        return [n for k, v in doc.items() for n in _numbers(v, (*path, k))]
    if isinstance(doc, list):
        return [n for i, v in enumerate(doc) for n in _numbers(v, (*path, i))]
    return [(path, doc)] if isinstance(doc, (int, float)) and not isinstance(doc, bool) else []


def _set(doc: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _wrong(value: Any) -> Any:
    """A value of another JSON type."""
    if isinstance(value, bool) or value is None:
        return [value]
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return 12345
    return [] if isinstance(value, dict) else {}


def _per_document(change: Callable[[Any], Any]) -> Callable[[str, str], str]:
    """Apply `change` to the document (metrics.jsonl: to its first line); NaN is written as the
    literal `NaN`, which strict JSON does not have."""
    def damage(name: str, text: str) -> str:
        if name.endswith(".jsonl"):
            first, rest = text.split("\n", 1)
            return json.dumps(change(json.loads(first)), allow_nan=True) + "\n" + rest
        return json.dumps(change(json.loads(text)), allow_nan=True)
    return damage


def _wrong_types(doc: Any) -> Any:
    return {k: v if k == "schema" else _wrong(v) for k, v in doc.items()}


def _nan(doc: Any) -> Any:
    path, _ = _numbers(doc)[0]
    _set(doc, path, math.nan)
    return doc


def _negative(doc: Any) -> Any:
    path, _ = next((p, v) for p, v in _numbers(doc) if isinstance(v, int))
    _set(doc, path, -1)
    return doc


DAMAGES: dict[str, Callable[[str, str], str]] = {
    "truncated": lambda name, text: text[: len(text) // 2],
    "empty list": _per_document(lambda doc: []),
    "wrong types": _per_document(_wrong_types),
    "NaN": _per_document(_nan),
    "negative count": _per_document(_negative),
    "binary": lambda name, text: "\x00\x89PNG\r\n\x1a\n\udcff".encode("utf-8", "surrogateescape").decode("latin-1"),
}
"""name -> (file name, healthy text) -> damaged text."""


def _write_damaged(path: Path, damage: str) -> None:
    text = DAMAGES[damage](path.name, path.read_text())
    if damage == "binary":
        path.write_bytes(b"\x00\x89PNG\r\n\x1a\n\xff\xfe" + bytes(range(256)))
    else:
        path.write_text(text)


@pytest.fixture
def no_figures(monkeypatch):
    """The figures are not what is read back here: drawing them would cost most of the time."""
    from moebench.report import figures

    for name in ("plot_loss", "plot_params", "plot_expert_load", "plot_parity", "plot_overlay"):
        monkeypatch.setattr(figures, name, lambda *a, **k: None)


def _check_case(healthy: Path, tmp_path: Path, kind: str, name: str, damage: str) -> None:
    root = tmp_path / "results"
    shutil.copytree(healthy, root)
    for old in (root / "report").glob("*"):
        shutil.rmtree(old)
    (run,) = (root / kind).iterdir()
    _write_damaged(run / name, damage)
    where = f"{kind}/{name} {damage}"

    listed = _cli("runs", "--results-dir", str(root))
    assert listed.exit_code == 0 and "Traceback" not in listed.output, (where, listed.output)
    lines = listed.output.splitlines()
    row = next(i for i, line in enumerate(lines) if run.name in line)
    assert lines[row].split()[2] == "damaged", (where, listed.output)
    # under its row (at 80 columns a run takes two lines: the damage follows both)
    assert any(line.startswith(f"  damaged: {name}: ") for line in lines[row + 1:row + 3]), (where, listed.output)
    for other in root.glob("*/*"):  # every other run is shown as usual
        if other != run and other.parent.name != "report":
            assert any(other.name in line and " ok " in line for line in lines), (where, other, listed.output)
    as_json = json.loads(_cli("runs", "--json", "--results-dir", str(root)).output)
    (mine,) = [r for r in as_json["runs"] if r["run_id"] == run.name]
    assert mine["status"] == "damaged" and mine["damage"].startswith(f"{name}: "), (where, mine)

    report = _cli("report", "--results-dir", str(root))
    assert report.exit_code == 0 and "Traceback" not in report.output, (where, report.output)
    assert f"run {run.name} is damaged:\n  {name}: " in report.output, (where, report.output)
    written = results.read_back(next((root / "report").iterdir()) / "summary.json")
    assert written["status"] == "ok" and name in written["not_judged"][kind], (where, written)


def test_every_file_kind_damaged_every_way(healthy, tmp_path, no_figures):
    kinds = _file_kinds(healthy)
    assert {name for _, name in kinds} == set(SCHEMA_FILES), kinds  # every file kind with a schema is covered
    tried = 0
    for kind, name in kinds:
        for damage in DAMAGES:
            _check_case(healthy, tmp_path / f"{kind}-{name}-{damage}".replace(" ", "_"), kind, name, damage)
            tried += 1
    print(f"{tried} damaged files ({len(kinds)} file kinds x {len(DAMAGES)} damages): runs and report named each")


def test_the_issues_cases(healthy, tmp_path, no_figures):
    """summary.json `[]` (it hid every run), a loss of "nan" and a negative parameter count
    (the report judged them without a word)."""
    def loss_nan(doc):
        doc["loss"]["last"] = "nan"
        return doc

    def params_negative(doc):
        doc["by_category"]["total"] = -273_000_000
        return doc

    for name, change, reason in (("summary.json", lambda doc: [], "[] is not of type 'object'"),
                                 ("summary.json", loss_nan, "['loss']['last']: 'nan' is not of type 'number'"),
                                 ("params.json", params_negative, "['by_category']['total']: -273000000 is less")):
        root = tmp_path / f"{name}-{reason[:8]}" / "results"
        shutil.copytree(healthy, root)
        (run,) = (root / "fastmoe").iterdir()
        (run / name).write_text(json.dumps(change(json.loads((run / name).read_text()))))
        listed = _cli("runs", "--results-dir", str(root)).output
        assert f"  damaged: {name}: {reason}" in listed.replace("\n    ", " "), listed
        report = _cli("report", "--results-dir", str(root))
        assert report.exit_code == 0, report.output
        assert "not judged (11 fastmoe claim(s))" in report.output, report.output


def test_a_metrics_line_cut_by_a_killed_writer_is_not_damage(healthy, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(healthy, root)
    (run,) = (root / "fastmoe").iterdir()
    summary = results.read_back(run / "summary.json")
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "error": "SIGTERM"}))
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "lo')
    files = results.read_run(run)
    assert files.damage == "" and len(files.documents["metrics.jsonl"]) == 2
    assert files.status == "interrupted"
    (run / "summary.json").write_text(json.dumps(summary))  # the same cut in a run that ended "ok" is damage
    assert results.read_run(run).damage.startswith("metrics.jsonl: line 3: not JSON")


@pytest.mark.parametrize("command", ["runs", "report"])
def test_a_results_dir_that_is_a_file_is_named_as_such(tmp_path, command):
    path = tmp_path / "results.txt"
    path.write_text("not a folder")
    done = _cli(command, "--results-dir", str(path))
    assert done.exit_code == 2, done.output
    assert f"error: --results-dir: {path} is not a folder" in done.output, done.output
    assert "Traceback" not in done.output and path.read_text() == "not a folder"
