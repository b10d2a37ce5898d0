"""The settings of an AutoEP row's standalone reproduction script (libraries/repro: template autoep_engine.py).

The script trains the row's model through deepspeed.initialize with AutoEP on W gloo ranks and the one-process
reference step by step, and prints the first quantity that differs; it exits 1 when the bug shows (deepspeed.initialize
raising included: the as-shipped row's incompatibility), 0 when it does not, 2 on a setup error, and never hangs.
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.repro import fill
from moebench.libraries.spec import Row


def script(row: Row, seed: int) -> str | None:
    """The script of an fp32 AutoEP row; None for a half-precision row (its judge is the noise model: a per-element
    tolerance is meaningless there)."""
    if row.settings.precision != "fp32":
        return None
    settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed}
    return fill("autoep_engine", settings, key=row.key())
