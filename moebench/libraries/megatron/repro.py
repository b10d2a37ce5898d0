"""The standalone reproduction script of a float32 Megatron row (`--repro DIR`): repro_main.py with the shared harness
(libraries/repro/templates/harness.py), triton_standin.py, standins.py, step.py and reference.py pasted in
(libraries/repro's `fill`, markers in its INSERTS), and the row's settings.

The script imports only the standard library, torch and megatron-core, starts its own W gloo ranks and one reference
process, runs what the row runs (the same files), compares every quantity in the row's order and prints the first that
differs; it exits 1 when the bug shows, 0 when it does not, 2 on a setup error, and never hangs. Every stand-in the
ranks run with is in it (pasted standins.py) and named in its header. bf16 rows have none (their judge is the noise
model: a per-element script would be wrong there).
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.repro import fill
from moebench.libraries.spec import PARITY, Row


def script(row: Row, seed: int) -> str | None:
    """The script of a float32 row; None for a bf16 row."""
    if row.kind != PARITY:
        return None
    settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed}
    return fill("repro_main", settings, key=row.key(), package="moebench.libraries.megatron")
