"""Megatron-core's release differences, read off the installed package (never a version list), and what --list needs
without importing it.

- 0.16: the GPT layer specs hold ModuleSpecs (`build_module`); `GroupedMLP` (the grouped_gemm extension) exists;
  its router calls `te_general_gemm`, which moe_utils.py defines only when Transformer Engine imports (standins.py).
- 0.17+: the specs hold builders called with the config (step.build_moe); no `GroupedMLP` (grouped experts are
  TEGroupedMLP, Transformer Engine's); triton imported at module level (the import stand-in, standins.py); they
  require Python >= 3.12 (their wheels' code runs on 3.11 here: tests/libraries/test_megatron_releases.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from moebench.libraries.megatron.step import MODULES, NUM_EXPERTS, SHARED_FFN  # noqa: F401 - sizes, imports


def mc_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def core_folder() -> str | None:
    """The folder of the megatron.core that imports first (megatron is a namespace package: a side-installed release
    first on PYTHONPATH and the venv's are both in its path; megatron.core is the first one's). Finding it imports
    only the namespace package, no code."""
    try:
        spec = importlib.util.find_spec("megatron.core") if importlib.util.find_spec("megatron") else None
    except (ImportError, ValueError):
        return None
    return next(iter(spec.submodule_search_locations or ()), None) if spec is not None else None


def _moe_file(name: str) -> str | None:
    folder = core_folder()
    path = os.path.join(folder, "transformer", "moe", name) if folder else ""
    return path if path and os.path.isfile(path) else None


def has_moe() -> bool:
    """Whether the installed megatron-core has its MoE layer (read off disk: nothing imported)."""
    return _moe_file("moe_layer.py") is not None


def has_grouped_mlp() -> bool:
    """Whether the installed megatron-core has GroupedMLP (0.16; removed in 0.17+), read off its source."""
    path = _moe_file("experts.py")
    if path is None:
        return False
    with open(path, encoding="utf-8") as f:
        return "\nclass GroupedMLP(" in f.read()


SETTING_FIELDS = {"shared_gate": "moe_shared_expert_gate", "expert_bias": "moe_router_enable_expert_bias",
                  "per_token": "calculate_per_token_loss", "groups": "moe_router_num_groups",
                  "capacity": "moe_expert_capacity_factor", "pad": "moe_pad_expert_input_to_capacity",
                  "z": "moe_z_loss_coeff", "scaling": "moe_router_topk_scaling_factor",
                  "pre_softmax": "moe_router_pre_softmax", "score": "moe_router_score_function",
                  "etp": "expert_tensor_parallel_size"}
"""A row setting -> the TransformerConfig field it needs (when the setting is on)."""


def config_fields() -> set[str]:
    """The installed TransformerConfig's fields (its own and ModelParallelConfig's), read off their source (nothing
    imported)."""
    import re

    found: set[str] = set()
    folder = core_folder()
    for parts in (("transformer", "transformer_config.py"), ("model_parallel_config.py",)):
        path = os.path.join(folder, *parts) if folder else ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found |= set(re.findall(r"^    ([a-z_0-9]+): ", f.read(), flags=re.M))
    return found


def lacks(settings: dict) -> list[str]:
    """The TransformerConfig fields a row's settings need that the installed release does not have."""
    fields = config_fields()
    return [field for key, field in SETTING_FIELDS.items()
            if settings.get(key) not in (None, False, 0, "softmax") and field not in fields]
