"""transformers' release differences: which DistributedConfig generation is installed, the DistributedConfig a row's
users pass to from_pretrained in that generation, and what a release cannot run (the adapter's skip_reason).

Generations (read off the installed DistributedConfig's fields, never a version list):
- 5.23+: `ep_implementation` names the exchange (`EPImplementationInterface`); `fsdp_plan` exists.
- 5.20-5.22: `ep_size` / `ep_plan` but no `ep_implementation`: the default plan's `ep_dispatch_experts`
  rule is all-to-all; all-reduce is the plan {gate: "ep_router", experts: "moe_tp_experts"}. No
  `fsdp_plan`, so the data-parallel `all_to_all` rows are skipped (the block cannot be called alone).
- about 5.17-5.19: `DistributedConfig(tp_size=W, enable_expert_parallel=True)` (router masking +
  all-reduce); no all-to-all token dispatch, so the all-to-all rows are skipped with that reason.
- 5.0: no `tp_size` in DistributedConfig: every row skipped. 4.x: the adapter's unavailable().
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from moebench.libraries.spec import Row

BLOCK = "model.layers.0.mlp"
"""The MoE block every row drives (and the DistributedConfig plans name)."""


def hf_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def config_fields() -> set[str]:
    from transformers.distributed import DistributedConfig

    return {f.name for f in dataclasses.fields(DistributedConfig)}


def generation() -> str:
    """Which DistributedConfig generation is installed: "ep_implementation", "ep_plan", "enable_expert_parallel"
    (with tp_size) or "none" (5.0: a bare enable_expert_parallel flag)."""
    fields = config_fields()
    if "ep_implementation" in fields:
        return "ep_implementation"
    if "ep_size" in fields:
        return "ep_plan"
    if "tp_size" in fields:
        return "enable_expert_parallel"
    return "none"


def distributed_config(row: Row):
    """The DistributedConfig a user passes to from_pretrained for this row, in the installed release's API."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(**distributed_kwargs(row))


def distributed_kwargs(row: Row) -> dict[str, Any]:
    """The keyword arguments of the row's DistributedConfig (JSON values), in the installed release's API."""
    w, api = row.world_size, generation()
    block_rule = {f"{BLOCK.replace('.0.', '.*.')}": "free_full_weight"}
    if api == "enable_expert_parallel":  # 5.0-5.19: router masking and all-reduce only
        return dict(tp_size=w, enable_expert_parallel=True)
    kwargs: dict[str, Any]
    if row.ep_mode == "all_to_all":
        kwargs = dict(fsdp_size=w, ep_size=w, fsdp_plan=block_rule)
    else:
        kwargs = dict(tp_size=w, ep_size=w)
    implementation = "all_reduce" if row.ep_mode == "all_reduce" else "all_to_all"
    if api == "ep_implementation":
        kwargs["ep_implementation"] = implementation
    elif implementation == "all_reduce":  # 5.20-5.22: the router-masking plan
        prefix = BLOCK.replace(".0.", ".*.")
        kwargs["ep_plan"] = {f"{prefix}.gate": "ep_router", f"{prefix}.experts": "moe_tp_experts"}
    return kwargs


def shares_batch(row: Row) -> bool:
    """True when every rank holds the same (global) batch; False when each has its own part of it."""
    return row.ep_mode != "all_to_all"
