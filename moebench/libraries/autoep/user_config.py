"""verify-parity --ds-config for the AutoEP rows: what the engine rows take from a user's DeepSpeed config (the
DeepSpeed package's reader: ZeRO stage, clipping, accumulation, precision, each key not honoured named in one line),
plus what an AutoEP config adds: `expert_parallel.autoep_size` and `use_data_before_expert_parallelism`.

A clip larger than the small models' gradient norm would not bind; as on the engine rows, the loss is then
multiplied (engine and reference alike) so that it does, and a note says by how much.
"""

from __future__ import annotations

from typing import Any

from moebench.errors import UserError
from moebench.libraries.autoep.rows import CLIP
from moebench.libraries.deepspeed import user_config as ds_user_config
from moebench.variants.deepspeed.ds_config import load_ds_config

FLAG = ds_user_config.FLAG
AUTOEP_KEYS = ("expert_parallel", "use_data_before_expert_parallelism")
"""Top-level keys the AutoEP rows read (the engine rows' reader lists them as not passed on)."""
EXPERT_PARALLEL_READ = ("enabled", "autoep_size")
"""expert_parallel keys the rows take; its others (preset_model, use_grouped_mm, ...) are named in a note."""


def read_user_config(path: str) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) for the AutoEP rows: the engine rows' settings plus autoep_size (None: W),
    data_before_expert and loss_multiplier; bad values are a UserError naming --ds-config."""
    settings, notes = ds_user_config.read_user_config(path)
    user = load_ds_config(path)
    notes = [kept for n in notes if not n.startswith("gradient_clipping ") and (kept := _without_autoep_keys(n))]
    section = user.get("expert_parallel", {})
    if not isinstance(section, dict):
        raise UserError(f"expert_parallel in {path} must be a JSON object, got {type(section).__name__}; fix the file",
                        flag=FLAG)
    size = section.get("autoep_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise UserError(f"expert_parallel.autoep_size={size!r} in {path}: must be a whole number >= 1; fix the file",
                        flag=FLAG)
    if section.get("enabled") is not True:
        notes.append("expert_parallel.enabled is not true in the file: the AutoEP rows turn it on")
    notes.append(f"expert_parallel.autoep_size={size}: used where it divides the world size and the 8 experts, "
                 "else autoep_size = the world size" if size else
                 "expert_parallel.autoep_size not set: verifying autoep_size = the world size")
    others = [f"expert_parallel.{k}" for k in section if k not in EXPERT_PARALLEL_READ]
    if others:
        notes.append(f"not passed on (AutoEP's defaults are used): {', '.join(others)}")
    data_before = user.get("use_data_before_expert_parallelism", False)
    if not isinstance(data_before, bool):
        raise UserError(f"use_data_before_expert_parallelism={data_before!r} in {path}: must be true or false; fix "
                        "the file", flag=FLAG)
    multiplier = settings["clip"] / CLIP if settings["clip"] > CLIP else 1.0
    if multiplier > 1:
        notes.append(f"gradient_clipping {settings['clip']:g}: the small models' gradient norm (1.1-1.8) never "
                     f"reaches it, so each AutoEP row multiplies its loss by {multiplier:g}, engine and reference "
                     "alike: your clip then binds at every step, as on a real model")
    return {**settings, "autoep_size": size if size and size > 1 else None, "data_before_expert": data_before,
            "loss_multiplier": multiplier}, notes


def _without_autoep_keys(note: str) -> str:
    """The engine rows' "not passed on" note without the keys the AutoEP rows do read."""
    head = "not passed on (DeepSpeed's defaults are used): "
    if not note.startswith(head):
        return note
    keys = [k for k in note[len(head):].split(", ") if k not in AUTOEP_KEYS]
    return head + ", ".join(keys) if keys else ""
