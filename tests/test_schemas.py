"""moebench/schemas: every JSON file the real CLI writes validates; broken documents do not."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moebench import results
from moebench.schemas import (
    SCHEMA_FILES,
    schema_for,
    validate_document,
    validate_file,
    validate_tree,
)

jsonschema = pytest.importorskip("jsonschema")
pytest_plugins = ["pytester"]

RUN_TIMEOUT_S = 600


def _moebench(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, results.RESULTS_ENV: str(root)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "moebench", *args], capture_output=True, text=True,
                          env=env, timeout=RUN_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> Path:
    """One fastmoe run (--steps 2) and one DeepSpeed quick run (--epochs 1), through the real CLI."""
    root = tmp_path_factory.mktemp("schema-results")
    for args in (["run", "fastmoe", "--steps", "2"], ["run", "deepspeed", "--preset", "quick", "--epochs", "1"]):
        done = _moebench(root, *args)
        assert done.returncode == 0, f"moebench {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return root


def _run_folder(root: Path, kind: str) -> Path:
    (folder,) = (root / kind).iterdir()
    return folder


def test_every_schema_is_a_valid_draft_2020_12_schema():
    for name in SCHEMA_FILES:
        schema = schema_for(name)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)
    assert schema_for("loss.png") is None and schema_for("results/x/y/notes.json") is None


def test_schema_keys_match_what_the_writer_stamps():
    for name, key in results.SCHEMAS.items():
        assert schema_for(name)["properties"]["schema"] == {"const": key}
    from moebench.envcheck.check import SCHEMA

    assert schema_for("envcheck.json")["properties"]["schema"] == {"const": SCHEMA}


@pytest.mark.parametrize("kind", ["fastmoe", "deepspeed"])
def test_real_cli_runs_validate(cli_results, kind):
    folder = _run_folder(cli_results, kind)
    names = sorted(p.name for p in folder.iterdir() if p.name in SCHEMA_FILES)
    assert names == ["config.json", "env.json", "metrics.jsonl", "params.json", "summary.json"]
    for name in names:
        validate_file(folder / name)
    assert results.read_json(folder / "summary.json")["status"] == "ok"


def test_validate_tree_counts_every_file(cli_results):
    assert validate_tree(cli_results) == 10
    assert validate_tree(cli_results / "no-such-folder") == 0


def _ok_summary(cli_results, kind="fastmoe") -> dict:
    return results.read_json(_run_folder(cli_results, kind) / "summary.json")


def _invalid(name: str, document) -> str:
    with pytest.raises(jsonschema.ValidationError) as info:
        validate_document(name, document)
    return info.value.message


def test_a_summary_with_an_unknown_status_fails(cli_results):
    assert "'done' is not one of" in _invalid("summary.json", {**_ok_summary(cli_results), "status": "done"})


@pytest.mark.parametrize("kind", ["fastmoe", "deepspeed"])
def test_an_ok_training_summary_without_loss_fails(cli_results, kind):
    summary = _ok_summary(cli_results, kind)
    del summary["loss"]
    assert "'loss' is a required property" in _invalid("summary.json", summary)


def test_a_failed_run_needs_only_the_envelope_and_its_error(cli_results):
    envelope = {k: v for k, v in _ok_summary(cli_results).items()
                if k in ("schema", "kind", "run_id", "run_path", "status", "started_at", "wall_time_s", "pid", "host")}
    validate_document("summary.json", {**envelope, "status": "failed", "error": "RuntimeError: boom"})
    validate_document("summary.json", {**envelope, "status": "running"})
    assert "'error' is a required property" in _invalid("summary.json", {**envelope, "status": "interrupted"})
    assert "'pid' is a required property" in _invalid(
        "summary.json", {k: v for k, v in envelope.items() if k != "pid"} | {"status": "running"})


def test_non_finite_losses_are_allowed_as_strings_only(cli_results):
    summary = _ok_summary(cli_results)
    summary["test"]["loss"] = "nan"
    validate_document("summary.json", summary)
    summary["test"]["loss"] = "NaN!"
    _invalid("summary.json", summary)


def test_a_chapter_comparison_row_needs_every_column(cli_results):
    summary = _ok_summary(cli_results, "deepspeed")
    summary["chapter_comparison"] = copy.deepcopy(summary["chapter_comparison"])
    del summary["chapter_comparison"][0]["published"]
    assert "'published' is a required property" in _invalid("summary.json", summary)


def test_params_without_by_category_fails(cli_results):
    params = results.read_json(_run_folder(cli_results, "fastmoe") / "params.json")
    del params["by_category"]
    assert "'by_category' is a required property" in _invalid("params.json", params)


@pytest.mark.no_schema_check  # the broken files stay in tmp_path
def test_a_bad_metrics_line_is_named_by_file_and_line(cli_results, tmp_path):
    lines = (_run_folder(cli_results, "fastmoe") / "metrics.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    del bad["step_time_s"]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    with pytest.raises(jsonschema.ValidationError, match=r"metrics\.jsonl:2: .*'step_time_s' is a required"):
        validate_file(path)


@pytest.mark.no_schema_check
def test_a_broken_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "run" / "summary.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": "moebench.summary/1", "status": "ok"}))
    with pytest.raises(jsonschema.ValidationError, match=str(path).replace(".", r"\.")):
        validate_tree(tmp_path)
    path.write_text("{not json")
    with pytest.raises(jsonschema.ValidationError, match="not JSON"):
        validate_file(path)


def test_the_autouse_check_catches_an_invalid_file_a_test_leaves(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(tiers=(Path(__file__).parent / "tiers.py").read_text())  # the conftest applies it
    pytester.makeini("[pytest]\nmarkers =\n    no_schema_check: opt out\n    slow: slow tier\n")
    pytester.makepyfile(test_leaves_junk="""
        import json, pytest

        def _junk(tmp_path):
            (tmp_path / "params.json").write_text(json.dumps({"schema": "moebench.params/1", "total": 1}))

        def test_junk(tmp_path):
            _junk(tmp_path)

        @pytest.mark.no_schema_check
        def test_junk_opted_out(tmp_path):
            _junk(tmp_path)
    """)
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    outcome.assert_outcomes(passed=2, errors=1)
    outcome.stdout.fnmatch_lines(["*ERROR at teardown of test_junk*", "*params.json*required property*"])
