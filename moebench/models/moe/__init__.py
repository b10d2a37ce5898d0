"""fastmoe-style MoE MLPs: the `reference` port (any device) and the real `fmoe` (CUDA).

`build_moe_mlp(...)` is the one entry point; `resolve_moe_impl("auto", ...)` picks fmoe where it
can run and the reference port elsewhere.
"""

from __future__ import annotations

from torch import nn

from moebench.errors import UserError
from moebench.models.moe import fmoe_adapter
from moebench.models.moe.gates import GATES
from moebench.models.moe.layer import FMoEReference

MOE_IMPLS = ("auto", "fmoe", "reference")


def resolve_moe_impl(requested: str, *, device: str, world_size: int = 1) -> str:
    """"auto" -> "fmoe" when usable here, else "reference"; "fmoe" where unusable -> UserError."""
    if requested not in MOE_IMPLS:
        raise UserError(f"unknown implementation {requested!r}; use one of {', '.join(MOE_IMPLS)}", flag="--moe-impl")
    reason = fmoe_adapter.unusable_reason(device=device, world_size=world_size)
    if requested == "fmoe" and reason is not None:
        raise UserError(f"fmoe cannot run here: {reason}; use --moe-impl reference", flag="--moe-impl")
    if requested == "auto":
        return "reference" if reason is not None else "fmoe"
    return requested


def build_moe_mlp(*, backend: str, experts: int, d_model: int, d_hidden: int, top_k: int,
                  gate: str = "naive", world_size: int = 1, group=None, device: str = "cpu") -> nn.Module:
    """One MoE MLP holding `experts // world_size` experts; forward returns (y, aux_loss)."""
    if backend == "fmoe":
        return fmoe_adapter.build_fmoe_mlp(num_expert=experts // world_size, d_model=d_model,
                                           d_hidden=d_hidden, top_k=top_k, gate=gate,
                                           world_size=world_size, group=group, device=device)
    if backend != "reference":
        raise UserError(f"unknown implementation {backend!r}", flag="--moe-impl")
    return FMoEReference(num_expert=experts // world_size, d_model=d_model, d_hidden=d_hidden,
                         world_size=world_size, group=group, top_k=top_k, gate=GATES[gate],
                         return_aux=True)


__all__ = ["MOE_IMPLS", "FMoEReference", "GATES", "build_moe_mlp", "resolve_moe_impl"]
