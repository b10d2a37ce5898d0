"""DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`) as the shared Transformer block's MLP.

The adapter keeps DeepSpeed's layer intact (TopKGate, capacity, noisy gating, residual expert,
expert parallelism) and only:
- returns (y, l_aux) as the block's MLP contract asks (DeepSpeed returns (y, l_aux, exp_counts));
- records what the gate decided on every forward, read from the gate's own outputs through a
  forward hook: `exp_counts` (demand per expert, BEFORE capacity drops), the capacity of each
  expert's buffer, the routes kept per expert, the routes dropped at capacity (DeepSpeed marks
  an evicted route with expert index -1 in the sparse routing it hands to the dispatcher; releases
  before 0.19.x hand it a dense dispatch mask instead, read the same way) and the tokens that lost
  all k routes;
- gives every global expert its own seeded initial weights. DeepSpeed deep-copies ONE expert
  module into every local slot, so out of the box all experts start identical, and expert g's
  weights would depend on which rank holds it. Seeding by (seed, layer, global expert index)
  makes the model the same for every ep_size, so runs with ep_size 1 and 2 are comparable.

Parameter categories (for `count_params`): experts, gate (wg), residual (the residual MLP),
coefficient (the residual mixing Linear).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch import nn


@dataclasses.dataclass(kw_only=True)
class RoutingRecord:
    """What the gate decided in one forward on this rank (detached tensors)."""

    exp_counts: torch.Tensor
    """Routes each expert was asked to take, before capacity (int64, [experts])."""
    kept_per_expert: torch.Tensor
    """Routes each expert actually took (int64, [experts])."""
    capacity: int
    """Slots in every expert's buffer (the same for all experts of the layer)."""
    routes: int
    """Token-to-expert routes requested: tokens x k."""
    dropped: int
    """Routes evicted at capacity."""
    tokens: int
    """Tokens routed (this rank's batch x seq)."""
    dropped_tokens: int
    """Tokens all of whose k routes were evicted: their MoE output is zero."""


SPARSE_GATE_OUTPUT = 7
"""Items of the sparse routing the gate returns when MOELayer asks for it (DeepSpeed 0.19.x onward, and
older releases on their Tutel path): (l_aux, capacity, experts, indices [k, s], locations [k, s],
gates [k, s], exp_counts); a route evicted at capacity has index -1."""
DENSE_GATE_OUTPUT = 4
"""Items of the dense routing older releases' MOELayer uses: (l_aux, combine_weights [s, e, c],
dispatch_mask [s, e, c], exp_counts); a kept route is one True slot of dispatch_mask."""


def routing_record(output: tuple, *, top_k: int) -> RoutingRecord:
    """What the gate decided, from either form of its output (see SPARSE_GATE_OUTPUT and
    DENSE_GATE_OUTPUT); `top_k` is the gate's k (the dense form does not carry it)."""
    if len(output) == SPARSE_GATE_OUTPUT:
        _l_aux, capacity, num_experts, indices, _locations, _gates, exp_counts = output
        if isinstance(indices, (list, tuple)):  # the Tutel path of older releases: one [s] tensor per k
            indices = torch.stack(list(indices))
        routes = indices.detach().long().reshape(-1, indices.shape[-1])  # [k, tokens]
        kept = torch.bincount(routes[routes >= 0], minlength=int(num_experts))
        dropped_tokens = int((routes < 0).all(dim=0).sum())
        tokens, requested, capacity = int(routes.shape[-1]), int(routes.numel()), int(capacity)
    elif len(output) == DENSE_GATE_OUTPUT:
        _l_aux, _combine_weights, dispatch_mask, exp_counts = output
        mask = dispatch_mask.detach().bool()  # [tokens, experts, capacity]
        kept = mask.sum(dim=(0, 2))
        dropped_tokens = int((~mask.flatten(1).any(dim=1)).sum())
        tokens, capacity = int(mask.shape[0]), int(mask.shape[2])
        requested = tokens * top_k
    else:
        raise TypeError(f"DeepSpeed's gate returned {len(output)} items; moebench reads the sparse "
                        f"({SPARSE_GATE_OUTPUT}) or the dense ({DENSE_GATE_OUTPUT}) routing")
    kept_routes = int(kept.sum())
    return RoutingRecord(exp_counts=exp_counts.detach().to("cpu", torch.int64),
                         kept_per_expert=kept.to("cpu", torch.int64), capacity=capacity, routes=requested,
                         dropped=requested - kept_routes, tokens=tokens, dropped_tokens=dropped_tokens)


def make_expert(d_model: int, d_hidden: int) -> nn.Module:
    """One expert: Linear -> GELU -> Linear (also the residual MLP's shape)."""
    return nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_model))


def _reset_linear(linear: nn.Linear, gen: torch.Generator) -> None:
    """nn.Linear's own default init (kaiming-uniform a=sqrt(5), uniform bias), from `gen`."""
    nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5), generator=gen)
    if linear.bias is not None:
        bound = 1.0 / math.sqrt(linear.in_features)
        nn.init.uniform_(linear.bias, -bound, bound, generator=gen)


def expert_seed(seed: int, layer_index: int, global_expert: int) -> int:
    """Seed of global expert `global_expert` of layer `layer_index` (independent of ep_size)."""
    return (seed * 1_000_003 + layer_index * 10_007 + global_expert) % (2**63 - 1)


class DeepSpeedMoEMLP(nn.Module):
    """`deepspeed.moe.layer.MoE` behind the block's MLP contract: forward(x) -> (y, l_aux)."""

    def __init__(self, moe, *, d_model: int, experts: int, layer_index: int = 0, seed: int = 0,
                 ep_rank: int = 0, top2_2nd_expert_sampling: bool = True) -> None:
        """`moe` is the variant's DeepSpeedMoEConfig (passed whole: d_hidden, ep_size, top_k,
        capacity factors, min_capacity, noisy_gate_policy, use_residual, drop_tokens, use_rts);
        `experts` is this layer's global count, `layer_index` and `seed` seed its experts;
        `top2_2nd_expert_sampling` False makes top-2 deterministic (parity checks)."""
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.layer_index, self.seed = layer_index, seed
        self.moe = MoE(
            hidden_size=d_model,
            expert=make_expert(d_model, moe.d_hidden),
            num_experts=experts,
            ep_size=moe.ep_size,
            k=moe.top_k,
            capacity_factor=moe.capacity_factor,
            eval_capacity_factor=moe.eval_capacity_factor,
            min_capacity=moe.min_capacity,
            use_residual=moe.use_residual,
            noisy_gate_policy=None if moe.noisy_gate_policy == "none" else moe.noisy_gate_policy,
            drop_tokens=moe.drop_tokens,
            use_rts=moe.use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
        )
        self.num_local_experts = self.moe.num_local_experts
        self.ep_rank = ep_rank
        self._seed_experts()
        self.last: RoutingRecord | None = None
        self.moe.deepspeed_moe.gate.register_forward_hook(self._record_routing)

    @property
    def local_experts(self) -> nn.ModuleList:
        """This rank's experts; local index j is global expert ep_rank * num_local_experts + j."""
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    @property
    def gate_weight(self) -> nn.Parameter:
        return self.moe.deepspeed_moe.gate.wg.weight

    def _seed_experts(self) -> None:
        for j, expert in enumerate(self.local_experts):
            g = self.ep_rank * self.num_local_experts + j
            gen = torch.Generator().manual_seed(expert_seed(self.seed, self.layer_index, g))
            with torch.no_grad():
                for module in expert.modules():
                    if isinstance(module, nn.Linear):
                        _reset_linear(module, gen)

    def _record_routing(self, gate, _inputs, output) -> None:
        self.last = routing_record(output, top_k=int(gate.k))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _exp_counts = self.moe(x)
        return y, l_aux

    @staticmethod
    def param_category(local_name: str) -> str:
        """Category of a parameter named relative to this module (see models/transformer.py)."""
        if ".deepspeed_experts." in local_name:
            return "experts"
        if ".gate.wg." in local_name:
            return "gate"
        if local_name.startswith("moe.mlp."):
            return "residual"
        if local_name.startswith("moe.coefficient."):
            return "coefficient"
        return "moe-other"


TINY_EXPERT_PREFIX = "moe.moe.deepspeed_moe.experts.deepspeed_experts."
"""How TinyMoENet names its experts' parameters: "<prefix><local slot>.<rest>"."""


class TinyMoENet(nn.Module):
    """The parity checks' small model: Linear -> tanh -> DeepSpeedMoEMLP (experts seeded by global index,
    deterministic top-2) -> Linear; forward(x) -> (y, l_aux). The same weights for every ep_size; its experts'
    parameters are named TINY_EXPERT_PREFIX + "<local slot>.<rest>"."""

    def __init__(self, moe, experts: int, seed: int, ep_rank: int, d_model: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d_model, d_model)
        self.moe = DeepSpeedMoEMLP(moe, d_model=d_model, experts=experts, seed=seed, ep_rank=ep_rank,
                                   top2_2nd_expert_sampling=False)
        torch.manual_seed(seed + 1)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        y, aux = self.moe(torch.tanh(self.inp(x)))
        return self.out(y), aux


def moe_layers(model: nn.Module) -> list[DeepSpeedMoEMLP]:
    """Every DeepSpeed MoE MLP of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, DeepSpeedMoEMLP)]


def create_expert_groups(ep_size: int) -> None:
    """Create DeepSpeed's expert / expert-data groups for `ep_size` now, as `deepspeed.initialize`
    would, but without its "No existing process group found" print on every rank (needs
    `deepspeed.init_distributed` first)."""
    from deepspeed.utils import groups

    if f"ep_size_{ep_size}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)


def set_accelerator_env(device: str) -> None:
    """Tell DeepSpeed its accelerator before it is imported (here and in forked ranks): with no
    DS_ACCELERATOR it probes, and on CPU every rank logs "Setting accelerator to CPU"."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
