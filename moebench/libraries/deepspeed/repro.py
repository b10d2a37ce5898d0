"""The settings of a DeepSpeed row's standalone reproduction script (libraries/repro: templates
deepspeed_engine.py, deepspeed_half.py and deepspeed_resume.py).

An engine row's script trains the row's engine and the one-process reference step by step and prints the
first quantity that differs; a resume row's saves, loads into a fresh engine built from another seed (in the
row's load layout) and compares every expert slot's and dense parameter's weights, fp32 master and Adam state
bit for bit with the state at the save point. Each exits 1 when the bug shows, 0 when it does not, 2 on a setup
error or a refused load, and never hangs (process-group timeout, and an overall deadline).
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.deepspeed import resume
from moebench.libraries.repro import fill
from moebench.libraries.spec import RESUME, Row

DEADLINE_S = 300
"""A resume script's overall deadline (seconds): its ranks are killed after it, and it exits 2."""


def script(row: Row, seed: int) -> str | None:
    """The script of an engine or a resume row (a half-precision engine row's judges by the noise model, as the
    tool does: templates/deepspeed_half.py); None for the layer row."""
    if row.kind == RESUME:
        return _resume_script(row, seed)
    if row.kind != "engine":
        return None
    settings = {**dataclasses.asdict(row.settings), "world_size": row.world_size, "seed": seed}
    return fill("deepspeed_engine" if row.settings.precision == "fp32" else "deepspeed_half", settings, key=row.key())


def _resume_script(row: Row, seed: int) -> str:
    from importlib.metadata import version

    spec: resume.Spec = row.settings
    settings = {
        "key": row.key(), "version": version("deepspeed"), "world": row.world_size, "seed": seed,
        "zero_stage": spec.zero_stage, "ep_size": spec.ep_size, "load_zero_stage": spec.load_zero_stage,
        "load_ep_size": spec.load_ep_size, "load_optimizer_states": spec.load_optimizer_states,
        "elastic": spec.elastic, "data_before_expert": spec.data_before_expert, "universal": spec.universal,
        "save_steps": spec.save_steps, "experts_per_rank": resume.EXPERTS_PER_RANK,
        "d_model": resume.D_MODEL, "d_hidden": resume.D_HIDDEN, "micro": list(resume.MICRO),
        "lr": resume.LR, "fresh_offset": resume.FRESH_SEED_OFFSET, "deadline_s": DEADLINE_S,
    }
    return fill("deepspeed_resume", settings, key=row.key())
