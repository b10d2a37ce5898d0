"""`verify-parity --library` and `--list`: the matrix on the console (80 columns) and in --json,
the results folder, and one-line errors for libraries that cannot run."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.libraries import registry
from moebench.libraries.records import WIDTH, conformance
from moebench.libraries.spec import Adapter

ROW_FIELDS = {"library", "version", "model", "backend", "ep_mode", "world_size", "features", "verdict", "diagnosis"}


def _invoke(*args):
    return CliRunner().invoke(app, ["verify-parity", *args])


def _fits(text: str) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide


def _parity_runs() -> list:
    root = os.path.join(os.environ["MOEBENCH_RESULTS"], "parity")
    return os.listdir(root) if os.path.isdir(root) else []


def test_list_names_every_library_with_version_and_why_not():
    result = _invoke("--list")
    assert result.exit_code == 0, result.output
    block = result.output.split("libraries (verify-parity --library NAME):")[1]
    _fits(block)
    for name in registry.known():
        assert any(line.startswith(name + " ") for line in block.splitlines()), name
    fairscale = next(line for line in block.splitlines() if line.startswith("fairscale "))
    if registry.status("fairscale").why_not is None:
        assert " yes" in fairscale and registry.status("fairscale").version in fairscale
    doc = json.loads(_invoke("--list", "--json").output)
    assert {lib["name"] for lib in doc["libraries"]} == set(registry.known())
    assert all({"version", "why_not", "can_run", "extra"} <= set(lib) for lib in doc["libraries"])


class _Absent(Adapter):
    name = "absentlib"
    import_name = "moebench_test_no_such_module"
    extra = "absentlib"


def test_a_missing_library_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, "absentlib", "unused:ADAPTER")
    monkeypatch.setitem(registry._loaded, "absentlib", _Absent())
    result = _invoke("--library", "absentlib")
    assert result.exit_code == 2
    assert result.output.strip() == ("error: --library: absentlib cannot run here: not installed: "
                                     "pip install 'moebench[absentlib]'")
    assert _parity_runs() == []


@pytest.mark.parametrize("args, needle", [
    (("--library", "nosuchlib"), "unknown library 'nosuchlib'"),
    (("--library", " , "), "--library: is empty"),
    (("--library", "fairscale", "--checks", "ddp-sgd"), "drop --checks or --library"),
])
def test_bad_library_flags_are_one_line_exit_2(args, needle):
    result = _invoke(*args)
    assert result.exit_code == 2 and needle in result.output and len(result.output.strip().splitlines()) == 1
    assert _parity_runs() == []


def test_conformance_table_fits_80_columns_and_wraps_the_diagnosis():
    rows = [{"library": "transformers", "version": "5.23.0", "model": "deepseek_v3", "backend": "grouped_mm",
             "ep_mode": "all_to_all", "world_size": 4, "verdict": "fail", "elapsed_s": 12.25,
             "diagnosis": "rank-local: output right; gate/router wrong (4/4); first failure: rank 0: step 1: "
                          "grad mlp.gate.weight: rank-local " * 2},
            {"library": "fairscale", "version": "0.4.13", "model": "top2gate", "backend": "-", "ep_mode": "a2a-E=W",
             "world_size": 2, "verdict": "pass", "elapsed_s": 0.4, "diagnosis": None}]
    text = conformance(rows)
    _fits(text)
    lines = text.splitlines()
    assert lines[0].split() == ["library", "version", "model", "backend", "EP", "mode", "world", "verdict", "time"]
    failing = next(i for i, line in enumerate(lines) if line.startswith("transformers"))
    assert lines[failing + 1].startswith("    rank-local: output right") and lines[failing + 2].startswith("    ")
    assert lines[-1].startswith("fairscale") and "pass" in lines[-1]


def test_rows_with_features_get_a_features_column_within_80_columns():
    rows = [{"library": "deepspeed", "version": "0.19.8", "model": "engine", "backend": "zero0", "ep_mode": "ep=4",
             "world_size": 4, "features": features, "verdict": "pass", "elapsed_s": 1.9, "diagnosis": None}
            for features in ([], ["clip"], ["grad-accum"])]
    text = conformance(rows)
    _fits(text)
    lines = text.splitlines()
    assert lines[0].split() == ["library", "version", "model", "backend", "EP", "mode", "features", "world",
                                "verdict", "time"]
    assert [line.split()[5] for line in lines[2:]] == ["-", "clip", "grad-accum"]


@pytest.mark.multirank
def test_library_fairscale_json_rows_and_run_folder():
    pytest.importorskip("fairscale", reason="fairscale is not installed: pip install 'moebench[fairscale]'")
    result = _invoke("--library", "fairscale", "--world-size", "2", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{"):])
    assert len(doc["rows"]) == 2 and all(ROW_FIELDS <= set(r) for r in doc["rows"])
    assert {(r["world_size"], r["verdict"], r["diagnosis"]) for r in doc["rows"]} == {(2, "pass", None)}
    saved = json.load(open(os.path.join(doc["run_path"], "summary.json")))
    assert saved["rows"] == json.loads(json.dumps(doc["rows"])) and saved["kind"] == "parity"


@pytest.mark.multirank
def test_library_console_names_a_broken_row_under_it(monkeypatch):
    pytest.importorskip("fairscale", reason="fairscale is not installed: pip install 'moebench[fairscale]'")
    from fairscale.nn import moe as fairscale_moe

    class MarkedGate(fairscale_moe.Top2Gate):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for p in self.parameters():
                p.expert = True

    monkeypatch.setattr(fairscale_moe, "Top2Gate", MarkedGate)
    result = _invoke("--library", "fairscale", "--world-size", "2")
    assert result.exit_code == 1
    table = result.output[result.output.index("library  "):result.output.index("saved to ")]  # a path is a path
    _fits(table)
    lines = table.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("fairscale ")]
    assert len(rows) == 2 and all(" fail " in lines[i] for i in rows)
    assert all(lines[i + 1].startswith("    rank-local: ") for i in rows)
    # the sentence says where to look: only the gate is wrong, and what its gradient is
    under = " ".join(line.strip() for line in lines[rows[0] + 1:rows[1]])
    assert under.startswith("rank-local: output right; input gradient right; experts right; gate/router wrong")
    assert "this rank's own tokens alone would give, scaled by 1/2 (the world size)" in under
    assert "never all-reduced" in under


def test_resume_rows_say_where_they_were_loaded_under_the_row():
    base = {"library": "transformers", "version": "5.23.0", "model": "mixtral", "backend": "grouped_mm",
            "ep_mode": "all_to_all", "world_size": 2, "elapsed_s": 0.8, "diagnosis": None, "verdict": "pass"}
    text = conformance([{**base, "features": ["resume"]},
                        {**base, "features": ["resume"], "load_ep_mode": "all_reduce", "load_ep_size": 2,
                         "check": "transformers/mixtral/grouped_mm/all_to_all/w2/resume-to-all_reduce"},
                        {**base, "features": ["loss-curve"]},
                        # a DeepSpeed resume row: its features in full under it (the column cuts them at 80)
                        {**base, "library": "deepspeed", "model": "resume+elastic+dbe", "backend": "zero2",
                         "ep_mode": "ep=2", "features": ["resume", "elastic", "data-before-expert"],
                         "check": "deepspeed/resume+elastic+dbe/zero2/ep=2/w4/resume"}])
    _fits(text)
    lines = text.splitlines()
    assert lines[4] == "    resume: loaded at the same layout"
    assert lines[7] == "    resume-to-all_reduce: loaded under all_reduce at ep_size 2"
    assert lines[15] == "    resume+elastic+data-before-expert: loaded at the same layout"
    assert [line.split()[0] for line in lines if line.startswith(("transformers ", "deepspeed "))] == [
        "transformers"] * 3 + ["deepspeed"]  # a library's name is never broken
    # the features column wraps at its "+" and "-", never cuts (issue 32: "resume+no-op~" at 80 columns)
    start = lines[0].index("features")
    cells = [line[start:start + 10].strip() for line in lines[10:15]]
    assert "".join(cells) == "resume+elastic+data-before-expert" and "~" not in text


def test_resume_without_library_is_one_line_exit_2():
    result = _invoke("--resume")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert result.output.strip() == ("error: --resume: adds resume rows to a library's matrix; give --library NAME "
                                     "too, e.g. --library deepspeed")
    assert _parity_runs() == []
