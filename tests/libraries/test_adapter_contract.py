"""Every adapter moebench knows (the built-in ones and the worked example) meets the protocol of
moebench/libraries/spec.py: unique row keys, JSON-able settings, a runner for every row kind, `rows(1)` empty or
skipped with a reason, `repro_script` None or a script that compiles and imports nothing but the stdlib, torch and
its library (tests/libraries/test_repro.py runs the scripts). No rank is started here."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.libraries import registry
from moebench.libraries.spec import Adapter, problems

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STANDALONE = {"torch", "deepspeed", "fairscale", "transformers", "megatron", "torchtitan", "spmd_types"}


def _adapters() -> list[Adapter]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from inhouse_moe.adapter import ADAPTER as example
    finally:
        sys.path.remove(str(EXAMPLES))
    found = [registry.load(name) for name in registry.BUILTIN]
    return [a for a in found if a is not None] + [example]


ADAPTERS = _adapters()


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a.name for a in ADAPTERS])
def test_the_adapter_meets_the_protocol(adapter):
    assert problems(adapter, 2) == [] and problems(adapter, 4) == []
    if adapter.unavailable():
        pytest.skip(f"{adapter.name} cannot run here: {adapter.unavailable()}")
    assert all(adapter.skip_reason(r) for r in adapter.rows(1)), "a row at 1 rank must say why it cannot run"
    for w in (2, 4):
        rows = adapter.rows(w, resume=adapter.name in ("deepspeed", "transformers", "fairscale"))
        keys = [r.key() for r in rows]
        assert len(keys) == len(set(keys))
        for row in rows:
            json.dumps(row.labels(adapter.version() or "?"))  # every field a JSON value
            assert callable(adapter.runner(row.kind)), row.key()
            reason = adapter.skip_reason(row)
            assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason)


def _undefined_names(sources: dict[str, str], folder: Path) -> dict[str, list[str]]:
    """For each script (name -> source), the names it uses and never defines (ruff's F821), read without running
    it: one ruff over every script (a ruff per script cost 7 s for DeepSpeed's)."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this interpreter")
    files = {name: f"script{i}.py" for i, name in enumerate(sources)}
    for name, file in files.items():
        (folder / file).write_text(sources[name])
    # run in the folder: ruff names a file relative to its working directory when it can
    done = subprocess.run([str(ruff), "check", "--isolated", "--no-cache", "--select", "F821", "--output-format",
                           "concise", *files.values()], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return {name: [line for line in done.stdout.splitlines() if line.startswith(f"{file}:") and "F821" in line]
            for name, file in files.items()}


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a.name for a in ADAPTERS])
def test_a_repro_script_is_none_or_standalone(adapter, tmp_path):
    if adapter.unavailable():
        pytest.skip(f"{adapter.name} cannot run here: {adapter.unavailable()}")
    scripts = {}
    for row in adapter.rows(2, resume=adapter.name in ("deepspeed", "transformers", "fairscale")):
        source = adapter.repro_script(row, 0) if adapter.skip_reason(row) is None else None
        if source is None:
            continue
        scripts[row.key()] = source
        tree = ast.parse(source, f"{row.key()}.py")  # a syntax error raises here
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {n.name.split(".")[0] for n in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert imported - set(sys.stdlib_module_names) <= STANDALONE, (row.key(), imported)
        compile(tree, f"{row.key()}.py", "exec")
    undefined = _undefined_names(scripts, tmp_path)  # a pasted file renamed a name the template still calls
    assert not any(undefined.values()), {key: names for key, names in undefined.items() if names}
    assert scripts or adapter.name in ("torchtitan", "automodel", "inhouse-moe")
