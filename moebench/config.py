"""What every run config shares: named presets under experiments/, and flag validation helpers.

Each variant keeps its own typed `kw_only` dataclass (fastmoe_run.FastMoERunConfig,
deepspeed_run.DeepSpeedRunConfig) with a docstring per field and validation in `__post_init__`;
this module holds the parts that would otherwise be written twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

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


SEED_LIMIT = 2**63
"""Seeds are 0 <= seed < 2**63: torch.Generator.manual_seed takes 64 bits, and every derived seed
(seed + offset, seed * prime + epoch) is reduced modulo this so it stays in range too."""


def require_seed(seed: object, flag: str = "--seed") -> None:
    """UserError unless `seed` is an int with 0 <= seed < 2**63."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise UserError(f"must be an integer from 0 to 2**63-1 ({SEED_LIMIT - 1}), got {seed!r}", flag=flag)


def derived_seed(value: int) -> int:
    """A seed computed from the user's seed (offsets, products), kept inside [0, 2**63)."""
    return value % SEED_LIMIT


def seed_rank_randomness(seed: int, rank: int) -> None:
    """Seed torch's global generator for what a rank draws while training (gate noise, random
    routing): reproducible for a seed, and a different stream on every rank."""
    torch.manual_seed(derived_seed(seed + 1 + rank))


def require_finite(values_by_flag: dict[str, object]) -> None:
    """UserError naming the first flag whose value is not a finite real number (no nan/inf, no bool)."""
    for flag, value in values_by_flag.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"must be a finite number, got {value!r}", flag=flag)


def gpu_shortfall(count: int, *, need_nccl: bool) -> str | None:
    """Why `count` local ranks cannot each have a CUDA GPU (and NCCL, when `need_nccl`), or None."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "needs CUDA GPUs and torch sees none here"
    found = torch.cuda.device_count()
    if found < count:
        return f"needs {count} CUDA GPUs (one per local rank) and torch sees {found}"
    if need_nccl and not dist.is_nccl_available():
        return "needs NCCL and this torch build has none"
    return None


def require_gpus(count: int, *, flag: str, why: str, need_nccl: bool, fix: str) -> None:
    """UserError `<why> <shortfall>; <fix>` unless `gpu_shortfall` finds nothing missing."""
    shortfall = gpu_shortfall(count, need_nccl=need_nccl)
    if shortfall is not None:
        raise UserError(f"{why} {shortfall}; {fix}", flag=flag)
