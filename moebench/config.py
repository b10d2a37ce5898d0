"""What every run config shares: named presets under experiments/, and flag validation helpers.

Each variant keeps its own typed `kw_only` dataclass (fastmoe_run.FastMoERunConfig,
deepspeed_run.DeepSpeedRunConfig) with a docstring per field and validation in `__post_init__`;
this module holds the parts that would otherwise be written twice.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moebench.errors import UserError

EXPERIMENTS_DIR = Path(__file__).resolve().parents[1] / "experiments"
"""experiments/<variant>/<preset>.json, in the checkout (moebench is installed editable)."""


def preset_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (EXPERIMENTS_DIR / kind).glob("*.json"))


def load_preset(kind: str, name: str, config_cls: type) -> dict:
    """experiments/<kind>/<name>.json: a flat dict of `config_cls` fields ("description" allowed)."""
    path = EXPERIMENTS_DIR / kind / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown preset {name!r}; available: {', '.join(preset_names(kind)) or 'none'}",
                        flag="--preset")
    values = json.loads(path.read_text())
    values.pop("description", None)
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(config_cls)})
    if unknown:
        raise UserError(f"preset {path} has unknown keys {unknown}", flag="--preset")
    return values


def require_positive_ints(values_by_flag: dict[str, object]) -> None:
    """UserError naming the first flag whose value is not an int >= 1 (bools are not ints here)."""
    for flag, value in values_by_flag.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"must be a positive integer, got {value!r}", flag=flag)
