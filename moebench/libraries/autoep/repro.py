"""The settings of an AutoEP row's standalone reproduction script (libraries/repro: templates autoep_engine.py and
autoep_resume.py).

An engine row's script trains the row's model through deepspeed.initialize with AutoEP on W gloo ranks and the
one-process reference step by step, and prints the first quantity that differs; a resume row's saves, loads into a
fresh engine and continues as the tool does, and prints the tool's slot-by-slot finding. Each exits 1 when the bug
shows (deepspeed.initialize raising included: the as-shipped row's incompatibility), 0 when it does not, 2 on a
setup error, and never hangs.
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.repro import fill
from moebench.libraries.spec import RESUME, Row


def script(row: Row, seed: int) -> str | None:
    """The script of a resume row, or of an fp32 AutoEP row; None for a half-precision row (its judge is the noise
    model: a per-element tolerance is meaningless there)."""
    if row.kind == RESUME:
        from moebench.libraries.autoep.resume import FRESH_SEED_OFFSET

        settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed,
                    "fresh_offset": FRESH_SEED_OFFSET}
        return fill("autoep_resume", settings, key=row.key())
    if row.settings.precision != "fp32":
        return None
    settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed}
    if row.settings.hf_config:  # the shrunk config itself: the script does not read the user's file
        from moebench.libraries.autoep.run import model_kwargs

        settings["config"] = model_kwargs(row.settings)
    return fill("autoep_engine", settings, key=row.key())
