"""JSON Schemas (draft 2020-12) of every JSON file moebench writes, and a validator for them.

    from moebench.schemas import schema_for, validate_file, validate_tree
    validate_file("results/fastmoe/<run-id>/summary.json")   # raises jsonschema.ValidationError
    validate_tree("results")                                  # every known file below; returns how many

The schemas are chosen by file name (results/<kind>/<run-id>/<name>):

    summary.json   summary.schema.json    (the `schema` key: moebench.summary/1)
    config.json    config.schema.json     (moebench.config/1)
    params.json    params.schema.json     (moebench.params/1)
    env.json       env.schema.json        (moebench.env/1)
    envcheck.json  envcheck.schema.json   (moebench.env-check/1)
    gpucheck.json  gpucheck.schema.json   (moebench.gpu-check/1)
    checkpoint.json checkpoint.schema.json (moebench.checkpoint/1)
    metrics.jsonl  metrics.schema.json    (every line; no `schema` key)

Torch-free; jsonschema (a dependency: moebench.results.read_back validates every file it reads)
is imported only when something is validated. Where jsonschema-rs is installed (`make install` installs it:
the `fast` extra) a valid document is recognised by it, about 200 times faster on a large parity summary;
jsonschema still says why an invalid one is invalid, and is the authority: a test holds the two to the same
verdicts (tests/test_schemas.py).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

SCHEMA_FILES = {
    "summary.json": "summary.schema.json",
    "config.json": "config.schema.json",
    "params.json": "params.schema.json",
    "env.json": "env.schema.json",
    "envcheck.json": "envcheck.schema.json",
    "gpucheck.json": "gpucheck.schema.json",
    "checkpoint.json": "checkpoint.schema.json",
    "metrics.jsonl": "metrics.schema.json",
}
"""Results file name -> the schema file (in this package) that describes it."""

JSONL_FILES = frozenset({"metrics.jsonl"})
"""Files validated line by line (one JSON object a line)."""


@functools.cache
def _load(schema_file: str) -> dict:
    from importlib.resources import files

    return json.loads((files(__package__) / schema_file).read_text(encoding="utf-8"))


def schema_for(path: str | os.PathLike) -> dict | None:
    """The JSON Schema of a results file, chosen by its name; None for a file moebench has no schema for."""
    schema_file = SCHEMA_FILES.get(Path(path).name)
    return None if schema_file is None else _load(schema_file)


@functools.cache
def _validator(schema_file: str):
    import jsonschema

    schema = _load(schema_file)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@functools.cache
def _rust_validator(schema_file: str):
    """jsonschema-rs's validator of the schema, or None where it is not installed."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    return jsonschema_rs.validator_for(_load(schema_file))


def _surely_valid(schema_file: str, document: Any) -> bool:
    """True when the fast validator says `document` matches; False when it says not, or is not there (then
    jsonschema decides, and says why)."""
    fast = _rust_validator(schema_file)
    try:
        return fast is not None and fast.is_valid(document)
    except (ValueError, OverflowError):  # a value it cannot represent (an integer past 64 bits): ask jsonschema
        return False


def _relocated(error, where: str):
    """`error` (the best match of the instance's errors) with `where` leading its message."""
    import jsonschema

    path = "".join(f"[{p!r}]" for p in error.absolute_path) or "(top level)"
    return jsonschema.ValidationError(
        f"{where}: {path}: {error.message}", validator=error.validator, path=error.absolute_path,
        cause=error.cause, context=error.context, validator_value=error.validator_value,
        instance=error.instance, schema=error.schema, schema_path=error.absolute_schema_path)


def _check(validator, document: Any, where: str) -> None:
    import jsonschema

    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        raise _relocated(error, where)


def _inlined(node: Any, defs: dict, depth: int = 0) -> Any:
    """`node` with every local `{"$ref": "#/$defs/x"}` replaced by the definition itself (the
    schemas have no recursive definitions). The same checks, about twice as fast: jsonschema
    resolves a reference at every use, and a parity summary has thousands of uses."""
    if depth > 32:
        raise ValueError("a schema's $defs refer to each other in a cycle: cannot inline them")
    if isinstance(node, list):
        return [_inlined(item, defs, depth) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        target = _inlined(defs[ref[len("#/$defs/"):]], defs, depth + 1)
        rest = {k: _inlined(v, defs, depth) for k, v in node.items() if k != "$ref"}
        return {"allOf": [target, rest]} if rest else target
    return {k: _inlined(v, defs, depth) for k, v in node.items() if k != "$defs"}


@functools.cache
def _fast_validator(schema_file: str):
    """The reader's validator: `_validator`'s schema with its references inlined."""
    import jsonschema

    schema = _load(schema_file)
    _validator(schema_file)  # the schema as written is checked once
    inlined = _inlined(schema, schema.get("$defs", {}))
    return jsonschema.validators.validator_for(schema)(inlined)


MESSAGE_CHARS = 160
"""A schema error quotes the offending value; a long list or string is cut to keep the reason one line."""


def first_error(name: str, document: Any) -> str | None:
    """Why `document` does not match the schema of the file `name` ("<key path>: <message>", one short
    line), or None when it matches. The reader of results files (moebench.results.read_back) uses it."""
    import jsonschema

    schema_file = SCHEMA_FILES.get(Path(name).name)
    if schema_file is None:
        raise ValueError(f"no schema for a file named {Path(name).name!r}; known: {', '.join(SCHEMA_FILES)}")
    if _surely_valid(schema_file, document):
        return None
    error = jsonschema.exceptions.best_match(_fast_validator(schema_file).iter_errors(document))
    if error is None:
        return None
    path = "".join(f"[{p!r}]" for p in error.absolute_path)
    message = " ".join(error.message.split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 3] + "..."
    return f"{path}: {message}" if path else message


def validate_document(name: str, document: Any, where: str | None = None) -> None:
    """Validate one parsed document (one metrics line for metrics.jsonl) against the schema of `name`."""
    schema_file = SCHEMA_FILES.get(Path(name).name)
    if schema_file is None:
        raise ValueError(f"no schema for a file named {Path(name).name!r}; known: {', '.join(SCHEMA_FILES)}")
    if not _surely_valid(schema_file, document):
        _check(_validator(schema_file), document, where or name)


def validate_file(path: str | os.PathLike) -> None:
    """Validate one results file; raises jsonschema.ValidationError naming the file (and the line of a
    metrics.jsonl), ValueError for a file name without a schema or a file that is not JSON."""
    import jsonschema

    path = Path(path)
    schema_file = SCHEMA_FILES.get(path.name)
    if schema_file is None:
        raise ValueError(f"{path}: no schema for a file named {path.name!r}; known: {', '.join(SCHEMA_FILES)}")
    validator = _validator(schema_file)
    text = path.read_text(encoding="utf-8")
    if path.name in JSONL_FILES:
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                document = _parse(line, f"{path}:{number}", jsonschema)
                if not _surely_valid(schema_file, document):
                    _check(validator, document, f"{path}:{number}")
        return
    document = _parse(text, str(path), jsonschema)
    if not _surely_valid(schema_file, document):
        _check(validator, document, str(path))


def _parse(text: str, where: str, jsonschema) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise jsonschema.ValidationError(f"{where}: not JSON: {exc}") from None


def results_files(root: str | os.PathLike) -> list[Path]:
    """Every file below `root` (or `root` itself) with a schema, sorted; temporary files are left out."""
    root = Path(root)
    if root.is_file():
        return [root] if root.name in SCHEMA_FILES else []
    if not root.is_dir():
        return []
    return sorted(p for name in SCHEMA_FILES for p in root.rglob(name) if p.is_file())


def validate_tree(root: str | os.PathLike) -> int:
    """Validate every results file below `root`; returns how many were checked (0 for a missing root).
    Raises jsonschema.ValidationError at the first invalid file."""
    files = results_files(root)
    for path in files:
        validate_file(path)
    return len(files)
