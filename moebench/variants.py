"""The registry of trainable variants, as data.

`moebench run <name>`, `make all` (via `moebench run --list-names`) and env-check's
"what can run here" all iterate over `VARIANTS`; adding a variant is adding one entry here.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    """Sub-command name and results kind: `moebench run <name>` writes results/<name>/."""
    description: str
    """One line for --help."""
    command: str
    """"module:function" of the thin Typer command (imported lazily)."""
    requires: tuple[str, ...]
    """Python modules the variant needs on every path (for env-check)."""
    default_preset: str
    """Preset under experiments/<name>/ used when no --preset is given."""


VARIANTS: tuple[Variant, ...] = (
    Variant(
        name="fastmoe",
        description="Train the fastmoe Transformer-MoE (real fmoe on CUDA, else moebench's port).",
        command="moebench.cli.run_fastmoe:run_fastmoe",
        requires=("torch",),
        default_preset="quick",
    ),
    Variant(
        name="deepspeed",
        description="Train the DeepSpeed-MoE Transformer through DeepSpeed's own engine.",
        command="moebench.cli.run_deepspeed:run_deepspeed",
        requires=("torch", "deepspeed"),
        default_preset="chapter",
    ),
)


def get(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KeyError(name)


def load_command(variant: Variant) -> Callable:
    module, func = variant.command.split(":")
    return getattr(importlib.import_module(module), func)
