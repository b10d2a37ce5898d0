"""`verify-parity --library NAME --repro DIR`: a standalone reproduction script per failing row.

An adapter's `repro_script(row, seed)` returns the whole source of a script that imports only the stdlib, torch
and the library, starts its own gloo ranks on CPU, reproduces the row against the same mathematics on one
process, prints the first diverging quantity and exits 1 when the bug shows, 0 when it does not, 2 on a setup
error. What a user attaches to an upstream bug report.

Each script `fill` makes opens as an upstream report would (write_scripts adds it after the first line): the
environment the row ran in (the library and its version, torch, Python, the backend, the ranks), what was expected,
what moebench measured (the row's diagnosis), and how to run it.

After the run, each FAILING row whose adapter writes one becomes `DIR/<row key, / -> __>.py` (written
atomically; rank 0 alone). The summary gains "repro": [{"check", "path"}] and "no_repro": [check names]
(and "repro_error" when DIR could not be written: the run then exits 1).

One template mechanism for every script (`fill`): a template is a file in templates/, with exactly one line
marked `# @SETTINGS@` (replaced by the row's settings as a JSON literal) and optionally lines marked with the
INSERTS below (each replaced by a file of moebench: the harness most scripts share, the expert layout, the
DeepSpeed rows' and the AutoEP rows' model and mathematics, the stand-in triton), so a script reproduces its row with
the tool's own code. A template outside templates/ (megatron's repro_main.py) names its package.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

HEAD = "# Reproduces moebench verify-parity row"
"""The first line of every script `fill` makes begins so (then the row's key and moebench's version)."""
SETTINGS_MARKER = "# @SETTINGS@"
"""The one template line replaced by `SETTINGS = json.loads('<the row's settings>')`."""
INSERTS = {"@HARNESS@": ("moebench.libraries.repro", "templates/harness.py"),
           "@ENGINEREADING@": ("moebench.libraries.repro", "templates/engine_reading.py"),
           "@LAYOUT@": ("moebench.parity", "layout.py"),
           "@TINYMOE@": ("moebench.models", "deepspeed_moe.py"),
           "@NOISEMATH@": ("moebench.parity", "noisemath.py"),
           "@ROWMATH@": ("moebench.libraries.deepspeed", "rowmath.py"),
           "@HALFMATH@": ("moebench.libraries.deepspeed", "halfmath.py"),
           "@AUTOEPSHAPE@": ("moebench.libraries.autoep", "shape.py"),
           "@AUTOEPMATH@": ("moebench.libraries.autoep", "rowmath.py"),
           "@AUTOEPRESUME@": ("moebench.libraries.autoep", "resumemath.py"),
           "@RESTORE@": ("moebench.parity", "restore.py"),
           "@RESUMEDRIVER@": ("moebench.libraries.repro", "templates/resume_driver.py"),
           "@TRITON@": ("moebench.libraries", "triton_standin.py"),
           "@TTIMPORTS@": ("moebench.libraries.torchtitan", "imports.py"),
           "@STANDINS@": ("moebench.libraries.megatron", "standins.py"),
           "@STEP@": ("moebench.libraries.megatron", "step.py"),
           "@REFERENCE@": ("moebench.libraries.megatron", "reference.py"),
           "@TTEXCHANGE@": ("moebench.libraries.torchtitan", "exchange.py")}
"""Marker -> the file pasted in its place (at most one line each): the parts of moebench a script shares with the
tool, so both build the same model from the same seed and read it the same way. A pasted file imports only the
stdlib, torch and the library; its `from __future__` line is left out (it must open a file), and so is a line
marked PASTED (an import of moebench whose names a file pasted above it defines)."""
PASTED = "# @PASTED@"


def script_name(key: str) -> str:
    """A row key as a file name: "deepspeed/engine/zero1/ep=2/w4" -> "deepspeed__engine__zero1__ep=2__w4.py"."""
    return key.replace("/", "__") + ".py"


def _text(package: str, path: str) -> str:
    return resources.files(package).joinpath(path).read_text("utf-8")


def template(name: str) -> str:
    """The text of templates/<name>.py (package data)."""
    return _text("moebench.libraries.repro", f"templates/{name}.py")


def fill(name: str, settings: dict[str, Any], *, key: str, package: str = "moebench.libraries.repro") -> str:
    """Template `name` (templates/<name>.py, or <name>.py of `package` outside this one) with its SETTINGS line
    holding `settings` (JSON scalars), each insert marker replaced by its file, the lines marked PASTED left out,
    and a first line naming the row."""
    lines = (template(name) if package == "moebench.libraries.repro" else _text(package, f"{name}.py")
             ).splitlines(keepends=True)
    if sum(SETTINGS_MARKER in line for line in lines) != 1:
        raise ValueError(f"repro template {name} must mark exactly one line with {SETTINGS_MARKER}")
    for marker in INSERTS:
        if sum(marker in line for line in lines) > 1:
            raise ValueError(f"repro template {name} marks more than one line with {marker}")
    literal = json.dumps(settings, sort_keys=True)
    out = []
    for line in lines:
        marker = next((m for m in INSERTS if m in line), None)
        if SETTINGS_MARKER in line:
            out.append(f"SETTINGS = json.loads({literal!r})\n")
        elif marker is not None:
            source, path = INSERTS[marker]
            text = "".join(t for t in _text(source, path).splitlines(keepends=True)
                           if not t.startswith("from __future__ import") and PASTED not in t)
            out.append(f"# ---- pasted from {source.replace('.', '/')}/{path}\n{text}# ----\n")
        elif PASTED not in line:
            out.append(line)
    from moebench.version import __version__

    head = f"{HEAD} {key.replace(chr(10), ' ')} (moebench {__version__}).\n"
    return head + "".join(out)


def _is_writer() -> bool:
    from moebench.distributed.launch import under_torchrun

    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def write_scripts(directory: str, summary: dict[str, Any], rows: dict[str, Any], seed: int) -> dict[str, Any]:
    """The summary with "repro" (each script written: check, path) and "no_repro" (failing rows with none).

    `rows` maps a check name to its matrix.RowCheck (adapter and row). Only failing rows get a script."""
    from moebench.libraries.registry import one_line
    from moebench.results import write_text_atomic

    failing = [c["name"] for c in summary.get("checks", ()) if c.get("status") == "fail" and c["name"] in rows]
    written, without, broken = [], [], []
    for name in failing:
        adapter = rows[name].adapter
        try:  # an adapter's code: what it raises or returns wrongly is named, the verdicts stand
            source = adapter.repro_script(rows[name].row, seed)
        except Exception as exc:  # noqa: BLE001
            why = f"{type(exc).__name__}: {one_line(str(exc), 200)}"
            broken.append((name, f"{adapter.name}.repro_script raised {why}"))
            continue
        if source is not None and not isinstance(source, str):
            broken.append((name, f"{adapter.name}.repro_script returned a {type(source).__name__}; it must return the "
                                 "script's source (a string) or None"))
            continue
        if source is None:
            without.append(name)
            continue
        row = next((r for r in summary.get("rows", ()) if r.get("check") == name), {})
        package = getattr(adapter, "dist_name", "") or getattr(adapter, "import_name", "")
        source = with_report(source, row, summary, script_name(name), package)
        path = Path(directory) / script_name(name)
        if _is_writer():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, source)
            except OSError as exc:  # the verdicts stand; the scripts not written are named
                error = "; ".join([*_grouped(broken), f"could not write {path}: {exc.strerror or exc}"])
                return {**summary, "repro": written, "no_repro": without, "repro_error": error}
        written.append({"check": name, "path": str(path)})
    return {**summary, "repro": written, "no_repro": without,
            **({"repro_error": "; ".join(_grouped(broken))} if broken else {})}


REPORT_WIDTH = 100
"""The report header's lines wrap at this many characters."""


def report_header(row: dict[str, Any], summary: dict[str, Any], filename: str, package: str = "") -> list[str]:
    """The comment block a script opens with, shaped as an upstream report: the environment the row ran in (`package`:
    the library's distribution, when its name is not moebench's), what was expected and what moebench measured (the
    row's diagnosis), and how to run it."""
    import textwrap

    def block(label: str, text: str) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), REPORT_WIDTH - 2, initial_indent=f"{label}: ",
                             subsequent_indent="    ", break_on_hyphens=False) or [f"{label}:"]

    name = package or row.get("library") or "the library"
    library = f"{name} {row.get('version') or '(version unknown)'}"
    if row.get("library") and row["library"] != name:
        library += f" (moebench's {row['library']} rows)"
    ranks = f"{row['world_size']} ranks" if row.get("world_size") else "its ranks"
    environment = (f"{library}, torch {summary.get('torch', '?')}, Python {summary.get('python', '?')}; CPU, "
                   f"{summary.get('comm_backend') or 'gloo'}, {ranks}.")
    expected = ("the library's run agrees with the row's reference: the same model, data and optimizer in one "
                "process (for a resume row, the run that never stopped), every checked quantity within the row's "
                "tolerance.")
    actual = row.get("diagnosis") or "the row failed (no diagnosis recorded)."
    run = f"python {filename}: exit 1 when the bug shows, 0 when it does not, 2 on a setup error."
    body = [*block("Environment", environment), *block("Expected", expected),
            *block("Actual (measured by moebench)", actual), *block("Run", run)]
    return ["#", *(f"# {line}" for line in body), "#"]


def with_report(source: str, row: dict[str, Any], summary: dict[str, Any], filename: str, package: str = "") -> str:
    """A script made by `fill` (its first line names the row) with the report header after that line; any other
    source (an adapter's own) as it is."""
    first, sep, rest = source.partition("\n")
    if not (first.startswith(HEAD) and sep):
        return source
    return first + sep + "".join(f"{line}\n" for line in report_header(row, summary, filename, package)) + rest


def _grouped(broken: list[tuple[str, str]]) -> list[str]:
    """One message per distinct failure of an adapter's repro_script, with the first row it failed on."""
    by_why: dict[str, list[str]] = {}
    for name, why in broken:
        by_why.setdefault(why, []).append(name)
    return [f"{why} (row {names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
            for why, names in by_why.items()]


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
