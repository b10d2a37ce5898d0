"""The shape of the house, checked: no import circles anywhere in moebench (function-level imports included), the
layers of pyproject.toml kept (lint-imports), no module over MAX_LINES without a one-line reason in its docstring,
none over HARD_MAX_LINES at all, and no adapter probed for members the protocol does not declare."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "moebench"
MAX_LINES = 400
"""A module longer than this says why in its docstring: a line starting "Over 400 lines:"."""
LONG_REASON = "Over 400 lines:"
HARD_MAX_LINES = 600
"""No module is longer than this, whatever its docstring says: split it by concern."""


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_in_moebench():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    graph = grimp.build_graph("moebench", cache_dir=None)
    assert _cycles(graph) == []


def test_a_cycle_is_found_when_there_is_one():
    """The finder itself, on a graph with one circle and one chain."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

    class Graph:
        modules = set(edges)

        @staticmethod
        def find_modules_directly_imported_by(m):
            return edges[m]

    assert _cycles(Graph()) == [["a", "b", "c"]]


def test_the_layers_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("lint-imports is not installed (the test extra: pip install 'moebench[test]')")
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_long_modules_say_why():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if not any(line.strip().startswith(LONG_REASON) for line in doc.splitlines()):
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not too_long, too_long


def _over(limit: int) -> list[str]:
    """"path: N lines" for each module under moebench/ longer than `limit` (lines counted as test_long_modules_say_why
    counts them)."""
    return [f"{path.relative_to(REPO)}: {lines} lines" for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := path.read_text(encoding="utf-8").count("\n")) > limit]


def test_no_module_is_over_600_lines():
    too_long = _over(HARD_MAX_LINES)
    assert not too_long, f"over {HARD_MAX_LINES} lines (split by concern): {too_long}"


def test_the_line_count_names_a_long_module():
    """The counter itself: every module is over 0 lines, each named with its count."""
    named = _over(0)
    assert any(n.startswith("moebench/__init__.py: ") for n in named), named[:3]
    assert all(n.endswith(" lines") for n in named)


PROBES = ("getattr(adapter", "hasattr(adapter", "inspect.signature", ".args[", "getattr(self.adapter")
"""How an adapter's members were once guessed at: every member the runner uses is declared in spec.Adapter."""


def test_no_adapter_is_probed():
    room = PACKAGE / "libraries"
    # The modules that handle an adapter (hf_config.py reads a transformers config class's own signature: no adapter).
    handling = [p for p in sorted(room.glob("*.py")) if "adapter" in p.read_text(encoding="utf-8").lower()]
    assert len(handling) >= 5, handling
    found = [f"{p.relative_to(REPO)}: {probe}" for p in handling for probe in PROBES
             if probe in p.read_text(encoding="utf-8")]
    assert not found, found
