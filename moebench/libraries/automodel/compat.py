"""Which torch NeMo Automodel's own code runs on: what a release of it needs of torch that the installed torch lacks,
read from the sources (never by importing Automodel). The rows it touches skip with the reason."""

from __future__ import annotations

from moebench.libraries.automodel.api import am_version

FSDP_PATCH = ("components", "distributed", "fsdp_patches.py")
"""Automodel's module of FSDP2 patches, which its parallelizer applies before `fully_shard`."""
FSDP_PATCHED = "FSDPParam.to_accumulated_grad_if_needed"
"""The FSDP2 method 0.7.0's `patch_fsdp_accumulated_grad_guard` wraps (torch 2.15 no longer has it)."""


def fsdp_patch_breaks() -> str | None:
    """Why Automodel's parallelizer cannot run on the installed torch (None: it can). NeMo Automodel 0.7.0's
    `fsdp_patches.patch_fsdp_accumulated_grad_guard`, called by its parallelizer, reads
    `FSDPParam.to_accumulated_grad_if_needed`, which torch 2.15 removed: every row that parallelizes through it
    raises AttributeError in Automodel's own code (measured on torch 2.15.0). Read from the sources, never by
    importing Automodel."""
    import importlib.util
    from pathlib import Path

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # a torch without FSDP2's module: Automodel's parallelizer fails there on its own terms
        return None
    if hasattr(FSDPParam, FSDP_PATCHED.split(".")[1]):
        return None
    spec = importlib.util.find_spec("nemo_automodel")
    if spec is None or not spec.submodule_search_locations:
        return None
    patches = Path(next(iter(spec.submodule_search_locations)), *FSDP_PATCH)
    try:
        needs = FSDP_PATCHED in patches.read_text(encoding="utf-8")
    except OSError:
        return None
    if not needs:
        return None
    import torch

    return (f"nemo-automodel {am_version()} does not run on torch {torch.__version__}: its FSDP patch "
            f"(fsdp_patches.patch_fsdp_accumulated_grad_guard, applied by its parallelizer) reads {FSDP_PATCHED}, "
            "which this torch no longer has, so the row would raise in Automodel's own code")
