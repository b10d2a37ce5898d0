"""Experts by layout, whatever the framework calls them.

- per-expert keys: `<layer>.experts.3.w1.weight` (Mixtral, Qwen3-MoE), `<layer>.experts.deepspeed_experts.3.w1.weight`
  (DeepSpeed), `<layer>.experts.local_experts.3.linear_fc1.weight` (Megatron's SequentialMLP),
  `<layer>.experts.linear_fc1.weight3` (Megatron's grouped GEMM), `<layer>.experts.w1.3` (DeepSpeed AutoEP's
  per-expert files: a stacked parameter's name, then the global expert);
- a stacked expert dimension: `<layer>.experts.w1`, `<layer>.experts.gate_up_proj` or torchtitan 0.3's
  `<layer>.routed_experts.inner_experts.w1_EFD`, experts along dim 0;
- the router: a 2-D `gate` / `router` weight under the layer (its output size is the expert count), and a routing
  bias (`expert_bias`, torchtitan 0.3's `expert_bias_E`, `e_score_correction_bias`) whose length is too.
"""

from __future__ import annotations

import dataclasses
import re

from moebench.checkpoint_audit.stream import BUFFER, PARAM, Stored

PER_EXPERT = re.compile(r"^(?:(?P<layer>.+?)\.)?experts\.(?:(?:deepspeed_experts|local_experts)\.)?"
                        r"(?P<index>\d+)\.(?P<rest>.+)$")
GROUPED = re.compile(r"^(?:(?P<layer>.+?)\.)?experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))(?P<index>\d+)$")
INDEX_LAST = re.compile(r"^(?:(?P<layer>.+?)\.)?experts\.(?P<rest>[A-Za-z_]\w*)\.(?P<index>\d+)$")
"""DeepSpeed AutoEP's layer_<l>_expert_<e> files: each grouped parameter's slice for one global expert, named
`<stacked name>.<expert>` (deepspeed/module_inject/auto_ep_layer.py, checkpoint_format per_expert_files)."""
STACKED = re.compile(r"^(?:(?P<layer>.+?)\.)?(?:routed_experts\.inner_experts|experts)\."
                     r"(?P<rest>(?:[A-Za-z_][^.]*)(?:\.[A-Za-z_][^.]*)*)$")
ROUTER = re.compile(r"(?:^|\.)(?:gate|router|wg)(?:\.[A-Za-z_]\w*)*\.weight$")
ROUTING_BIAS = re.compile(r"(?:^|\.)(?:expert_bias(?:_E)?|e_score_correction_bias)$")


@dataclasses.dataclass(kw_only=True)
class Layer:
    """One MoE layer's tensors, by how they hold experts."""

    name: str
    per_expert: dict[str, dict[int, list[Stored]]] = dataclasses.field(default_factory=dict)
    """rest of the name ("w1.weight") -> global expert index -> every tensor stored under that name (one, if sound)."""
    stacked: list[Stored] = dataclasses.field(default_factory=list)
    routers: list[Stored] = dataclasses.field(default_factory=list)
    biases: list[Stored] = dataclasses.field(default_factory=list)

    def indices(self) -> set[int]:
        return {i for by_index in self.per_expert.values() for i in by_index}


def per_expert(name: str) -> re.Match | None:
    """The match of a per-expert tensor's name (groups layer, index, rest), whichever framework's naming."""
    return PER_EXPERT.match(name) or GROUPED.match(name) or INDEX_LAST.match(name)


def layers_of(tensors: list[Stored]) -> dict[str, Layer]:
    """The MoE layers among `tensors` (parameters and buffers; optimizer state is the audit's), in stored order."""
    layers: dict[str, Layer] = {}
    model = [t for t in tensors if t.role in (PARAM, BUFFER)]
    for t in model:
        m = per_expert(t.name)
        if m:
            layer = layers.setdefault(m.group("layer") or "", Layer(name=m.group("layer") or ""))
            layer.per_expert.setdefault(m.group("rest"), {}).setdefault(int(m.group("index")), []).append(t)
            continue
        m = STACKED.match(t.name)
        if m and len(t.shape) >= 2:
            layers.setdefault(m.group("layer") or "", Layer(name=m.group("layer") or "")).stacked.append(t)
    for t in model:
        if per_expert(t.name) or STACKED.match(t.name):
            continue
        layer = _owner(t.name, layers)
        if layer is None:
            continue
        if ROUTER.search(t.name) and len(t.shape) == 2:
            layer.routers.append(t)
        elif ROUTING_BIAS.search(t.name) and len(t.shape) == 1:
            layer.biases.append(t)
    return layers


def locate(names) -> tuple[str, list[int]]:
    """(the MoE layer, the global experts) that lost tensors named `names` belong to ("" and [] when none)."""
    layers, experts = [], set()
    for name in names:
        m = per_expert(name)
        if m:
            layers.append(m.group("layer") or "")
            experts.add(int(m.group("index")))
        elif STACKED.match(name):
            layers.append(STACKED.match(name).group("layer") or "")
    return (layers[0] if layers else ""), sorted(experts)


def _owner(name: str, layers: dict[str, Layer]) -> Layer | None:
    """The layer whose name is the longest prefix of `name` (the router sits beside the experts)."""
    best = None
    for layer_name, layer in layers.items():
        inside = not layer_name or name.startswith(layer_name + ".")
        if inside and (best is None or len(layer_name) > len(best.name)):
            best = layer
    return best


def natural(name: str) -> list:
    """Sort key: numbers compare as numbers (layers.10 after layers.9)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
