"""How the DeepSpeed rows name parameters: one model's expert prefix, its global names, labels and groups.

Every DeepSpeed row builds models.deepspeed_moe.TinyMoENet, whose experts are named
"moe.moe.deepspeed_moe.experts.deepspeed_experts.<local slot>.<rest>"; a rank's local slot is mapped to the
global expert by moebench.parity.layout (contiguous: ep rank e holds experts e*L .. e*L + L-1).
"""

from __future__ import annotations

from moebench.libraries.deepspeed.rowmath import param_group
from moebench.models.deepspeed_moe import TINY_EXPERT_PREFIX as EXPERT_PREFIX
from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER
from moebench.parity.layout import ExpertLayout

GATE_PREFIX = "moe.moe.deepspeed_moe.gate."


def global_name(name: str, layout: ExpertLayout, ep_rank: int) -> str:
    """A local expert's parameter name -> the same expert's name in the ep_size = 1 model."""
    return layout.global_name(name, EXPERT_PREFIX, ep_rank)


def local_slot(name: str) -> int | None:
    """The local slot of an expert parameter, None for any other parameter."""
    found = ExpertLayout.split_name(name, EXPERT_PREFIX)
    return None if found is None else found[0]


def label(name: str) -> str:
    """A parameter's name in comparisons: "expert 3.0.weight", "gate.wg.weight", "inp.weight"."""
    if name.startswith(EXPERT_PREFIX):
        return "expert " + name[len(EXPERT_PREFIX):]
    return name.replace(GATE_PREFIX, "gate.").replace("moe.moe.", "moe.")


def group(name: str) -> str:
    """The parameter group of a (global) name: experts, gate, dense (rowmath.param_group: the repro script's too)."""
    return param_group(name)


DIAGNOSIS_GROUP = {"experts": EXPERTS, "gate": ROUTER, "dense": REPLICATED}
"""A parameter group as the check-level diagnosis counts it (moebench.parity.diagnosis.GROUPS)."""
