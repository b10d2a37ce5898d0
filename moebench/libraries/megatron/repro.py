"""The standalone reproduction script of a float32 Megatron row (`--repro DIR`): repro_main.py with the shared harness
(libraries/repro/templates/harness.py), standins.py, step.py and reference.py pasted in, and the row's settings.

The script imports only the standard library, torch and megatron-core, starts its own W gloo ranks and one reference
process, runs what the row runs (the same files), compares every quantity in the row's order and prints the first that
differs; it exits 1 when the bug shows, 0 when it does not, 2 on a setup error, and never hangs. Every stand-in the
ranks run with is in it (pasted standins.py) and named in its header. bf16 rows have none (their judge is the noise
model: a per-element script would be wrong there).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from moebench.libraries.spec import PARITY, Row

PASTES = {"@HARNESS@": ("moebench.libraries.repro", "templates/harness.py"),
          "@STANDINS@": ("moebench.libraries.megatron", "standins.py"),
          "@STEP@": ("moebench.libraries.megatron", "step.py"),
          "@REFERENCE@": ("moebench.libraries.megatron", "reference.py")}
"""Marker -> the file pasted in its place (the repro mechanism's convention: `from __future__` lines and lines marked
PASTED left out)."""
SETTINGS_MARKER = "# @SETTINGS@"
PASTED = "# @PASTED@"


def _text(package: str, path: str) -> str:
    return resources.files(package).joinpath(path).read_text("utf-8")


def script(row: Row, seed: int) -> str | None:
    """The script of a float32 row; None for a bf16 row."""
    if row.kind != PARITY:
        return None
    from moebench.version import __version__

    settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed}
    out = [f"# Reproduces moebench verify-parity row {row.key()} (moebench {__version__}).\n"]
    for line in _text("moebench.libraries.megatron", "repro_main.py").splitlines(keepends=True):
        marker = next((m for m in PASTES if m in line), None)
        if SETTINGS_MARKER in line:
            out.append(f"SETTINGS = json.loads({json.dumps(settings, sort_keys=True)!r})\n")
        elif marker is not None:
            package, path = PASTES[marker]
            text = "".join(t for t in _text(package, path).splitlines(keepends=True)
                           if not t.startswith("from __future__ import") and PASTED not in t)
            out.append(f"# ---- pasted from {package.replace('.', '/')}/{path}\n{text}# ----\n")
        elif PASTED not in line:
            out.append(line)
    return "".join(out)
