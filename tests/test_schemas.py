"""moebench/schemas: every JSON file the real CLI writes validates; broken documents do not."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from moebench import results
from moebench.schemas import (
    SCHEMA_FILES,
    results_files,
    schema_for,
    validate_document,
    validate_file,
    validate_tree,
)

jsonschema = pytest.importorskip("jsonschema")
pytest_plugins = ["pytester"]

@pytest.fixture(scope="module")
def cli_results(quick_runs_source, tmp_path_factory) -> Path:
    """A fastmoe run, a DeepSpeed quick run, three parity checks and an env-check, through the real CLI
    (tests/helpers/quickruns.py)."""
    root = tmp_path_factory.mktemp("schema-results") / "results"
    shutil.copytree(quick_runs_source[0], root)
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
    # each training run: config, summary, params, env, metrics; the parity run: config, summary; env-check: its own
    per_kind = {"fastmoe": 5, "deepspeed": 5, "parity": 2}
    found = {kind: sum(1 for _ in (cli_results / kind).rglob("*.json*")) for kind in per_kind}
    assert found == per_kind
    env_check = len(results_files(cli_results / "env"))
    assert validate_tree(cli_results) == len(results_files(cli_results)) == 12 + env_check
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
    helpers = pytester.mkpydir("helpers")  # and the helpers it imports (signal dispositions, environments)
    for name in ("procsignals.py", "userenv.py", "quickruns.py", "warmcli.py"):
        (helpers / name).write_text((Path(__file__).parent / "helpers" / name).read_text())
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


def _shortened(node, keep: int = 2):
    """A document with every list cut to its first `keep` items (mutants of a small document validate fast)."""
    if isinstance(node, dict):
        return {k: _shortened(v, keep) for k, v in node.items()}
    if isinstance(node, list):
        return [_shortened(v, keep) for v in node[:keep]]
    return node


WRONG = (None, "x", -1, 2**70, 1.5, [], {}, True)
"""What a damaged value can be: each type JSON has (and an integer past 64 bits)."""


def _mutants(node, depth: int = 0):
    """Documents that differ from `node` in one place: a key dropped, a value of another type, a list item
    of another type."""
    if depth > 6:
        return
    if isinstance(node, dict):
        for key, value in node.items():
            yield {k: v for k, v in node.items() if k != key}
            for wrong in WRONG:
                if type(wrong) is not type(value):
                    yield {**node, key: wrong}
            for inner in _mutants(value, depth + 1):
                yield {**node, key: inner}
    elif isinstance(node, list) and node:
        for wrong in WRONG[:3]:
            yield [wrong, *node[1:]]
        for inner in _mutants(node[0], depth + 1):
            yield [inner, *node[1:]]


def test_the_fast_validator_gives_jsonschemas_verdicts(cli_results):
    """jsonschema-rs (when installed) decides alone that a document is valid: on every results file of real
    runs, and every mutant of them with one value dropped or of another type, it must say what jsonschema
    says (which stays the authority for why a document is invalid)."""
    import jsonschema_rs  # noqa: F401 - installed by `make install` (the fast extra)

    from moebench.schemas import _fast_validator, _rust_validator

    documents = []
    for path in sorted(results_files(cli_results)):
        texts = path.read_text().splitlines()[:3] if path.name == "metrics.jsonl" else [path.read_text()]
        for text in texts:
            document = _shortened(json.loads(text))
            documents += [(SCHEMA_FILES[path.name], m) for m in [document, *_mutants(document)]]
    found = _disagreements(_rust_validator, _fast_validator, documents)
    print(f"fast validator: {len(documents)} documents, {len(found)} disagreements")
    assert len(documents) > 2000 and not found, f"{len(found)} of {len(documents)}: {found[:5]}"


def _disagreements(fast_of, slow_of, documents) -> list[str]:
    """The documents on which the two validators' verdicts differ (one the fast one cannot represent is asked
    of jsonschema alone, as moebench does)."""
    found = []
    for schema_file, document in documents:
        try:
            quick = fast_of(schema_file).is_valid(document)
        except (ValueError, OverflowError):
            continue
        if quick != slow_of(schema_file).is_valid(document):
            found.append(f"{schema_file}: fast says {quick}: {json.dumps(document)[:200]}")
    return found


def test_the_agreement_check_sees_a_fast_validator_that_accepts_too_much():
    from moebench.schemas import _fast_validator

    class Lenient:
        def is_valid(self, document):
            return True

    documents = [("summary.schema.json", {"status": "ok"}), ("params.schema.json", {"total": "x"})]
    assert len(_disagreements(lambda _: Lenient(), _fast_validator, documents)) == 2
