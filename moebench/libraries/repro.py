"""`verify-parity --library NAME --repro DIR`: a standalone reproduction script per failing row.

An adapter may have `repro_script(row, seed) -> str | None`: the whole source of a script
that imports only the stdlib, torch and the library, starts its own gloo ranks on CPU, reproduces the row
against the same mathematics on one process, prints the first diverging quantity and exits 1 when the bug
shows, 0 when it does not, 2 on a setup error. What a user attaches to an upstream bug report.

After the run, each FAILING row whose adapter writes one becomes `DIR/<row key, / -> __>.py` (written
atomically; rank 0 alone). The summary gains "repro": [{"check", "path"}] and "no_repro": [check names]
(and "repro_error" when DIR could not be written: the run then exits 1).
Templates live in repro_templates/: one per library with one line marked `# @SETTINGS@`, replaced by the
row's settings as a JSON literal, and one `from harness import *` line marked @HARNESS@, replaced by
harness.py (the parent, deadline, comparison and report every script shares): `fill`.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from moebench.libraries.base import Row

SETTINGS_MARKER = "# @SETTINGS@"
"""The one template line replaced by `SETTINGS = json.loads('<the row's settings>')`."""
HARNESS_MARKER = "@HARNESS@"
"""The one template line (`from harness import *`) replaced by repro_templates/harness.py, the part every
script shares: spawning the ranks, the deadline, the comparison and the report."""


def script_name(key: str) -> str:
    """A row key as a file name: "deepspeed/engine/zero1/ep=2/w4" -> "deepspeed__engine__zero1__ep=2__w4.py"."""
    return key.replace("/", "__") + ".py"


def template(name: str) -> str:
    """The text of repro_templates/<name>.py (package data)."""
    return resources.files("moebench.libraries").joinpath("repro_templates", f"{name}.py").read_text("utf-8")


def fill(name: str, settings: dict[str, Any], *, key: str) -> str:
    """Template `name` with its SETTINGS line holding `settings` (JSON scalars) and a first line naming the row."""
    lines = template(name).splitlines(keepends=True)
    for marker in (SETTINGS_MARKER, HARNESS_MARKER):
        if sum(marker in line for line in lines) != 1:
            raise ValueError(f"repro template {name} must mark exactly one line with {marker}")
    literal = json.dumps(settings, sort_keys=True)
    harness = f"# ---- the shared harness (moebench repro_templates/harness.py)\n{template('harness')}# ----\n"
    lines = [f"SETTINGS = json.loads({literal!r})\n" if SETTINGS_MARKER in line
             else harness if HARNESS_MARKER in line else line for line in lines]
    from moebench import __version__

    head = f"# Reproduces moebench verify-parity row {key.replace(chr(10), ' ')} (moebench {__version__}).\n"
    return head + "".join(lines)


def deepspeed_engine_script(row: Row, seed: int) -> str | None:
    """The script of a DeepSpeed engine row (params: EngineSettings' fields), from row.params and row.world_size;
    None for a row that is not an engine row (the wrapped layer check, resume rows) or that needs a judge the
    script has not got (bf16: a per-element tolerance is meaningless there)."""
    params = dict(row.params)
    if "zero_stage" not in params or "ep_size" not in params or "load_ep_size" in params:
        return None
    if params.get("precision", "fp32") != "fp32":
        return None
    settings = {**params, "world_size": row.world_size, "seed": seed}
    return fill("deepspeed_engine", settings, key=row.key())


def _is_writer() -> bool:
    from moebench.distributed.launch import under_torchrun

    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def write_scripts(directory: str, summary: dict[str, Any], rows: dict[str, tuple[Any, Row]],
                  seed: int) -> dict[str, Any]:
    """The summary with "repro" (each script written: check, path) and "no_repro" (failing rows with none).

    `rows` maps a check name to (its adapter, its Row). Only failing rows get a script."""
    from moebench.results import write_text_atomic

    failing = [c["name"] for c in summary.get("checks", ()) if c.get("status") == "fail" and c["name"] in rows]
    written, without = [], []
    for name in failing:
        adapter, row = rows[name]
        make = getattr(adapter, "repro_script", None)
        source = make(row, seed) if make is not None else None
        if source is None:
            without.append(name)
            continue
        path = Path(directory) / script_name(name)
        if _is_writer():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, source)
            except OSError as exc:  # the verdicts stand; the scripts not written are named
                error = f"could not write {path}: {exc.strerror or exc}"
                return {**summary, "repro": written, "no_repro": without, "repro_error": error}
        written.append({"check": name, "path": str(path)})
    return {**summary, "repro": written, "no_repro": without}


def lines(summary: dict[str, Any]) -> list[str]:
    """What the console says about the scripts (each line a path or a row name: at most one per row)."""
    out = []
    if summary.get("repro_error"):
        out.append(f"error: --repro: {summary['repro_error']}")
    if summary.get("repro"):
        out.append(f"reproduction script(s), {len(summary['repro'])} (run each: python PATH):")
        out += [f"  {_shown(item['path'])}" for item in summary["repro"]]
    for name in summary.get("no_repro", ()):
        out.append(f"no reproduction script for {name}")
    if "repro" in summary and not summary["repro"] and not summary.get("no_repro") and not summary.get("repro_error"):
        out.append("no failing row: no reproduction script written")
    return out


def _shown(path: str) -> str:
    """A path as printed: relative to the working folder when that is shorter."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if len(relative) < len(path) else path
