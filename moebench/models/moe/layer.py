"""The `reference` backend: fastmoe's FMoETransformerMLP in plain PyTorch (CPU or GPU).

A port of fmoe/transformer.py (FMoETransformerMLP, _Expert), fmoe/layers.py (FMoE and its
scatter / expert / gather forward), fmoe/linear.py (FMoELinear) and fmoe/functions.py
(MOEScatter / MOEGather), with the same state_dict keys and shapes, the same initialisation and
the same random draw order, so one seed gives the same weights and checkpoints move between
this and the real `fmoe` backend:

  experts.<i>.htoh4.weight [1, d_hidden, d_model]   experts.<i>.htoh4.bias [1, d_hidden]
  experts.<i>.h4toh.weight [1, d_model, d_hidden]   experts.<i>.h4toh.bias [1, d_model]
  gate.gate.weight [E_total, d_model]               gate.gate.bias [E_total]   (NaiveGate)

drawn in that order: expert 0 (htoh4, then h4toh), expert 1, ..., then the gate.

Build a single-process layer:
    moe = FMoEReference(num_expert=8, d_model=64, d_hidden=128, top_k=2)

Build the expert-parallel equivalent on `ep_size` ranks (inside an initialised process group),
with the same weights as the single-process one:
    local = FMoEReference(num_expert=8 // ep_size, d_model=64, d_hidden=128, top_k=2,
                          world_size=ep_size, group=None)        # None = the default group
    local.load_state_dict(shard_state_dict(moe.state_dict(), rank, 8 // ep_size))
(`moebench.distributed.expert_parallel.shard_state_dict`). Feed each rank its slice of the batch;
after backward call `expert_parallel.sync_gradients(local)` to get the one-process gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moebench.distributed import expert_parallel
from moebench.models.moe.gates import BaseGate, NaiveGate, make_gate


class FMoELinear(nn.Module):
    """fmoe/linear.py FMoELinear: weight [num_expert, out, in], zero bias, kaiming-uniform(a=√5)
    over the 3-D weight (fan_in = out·in, so the bound is 1/sqrt(in·out))."""

    def __init__(self, num_expert: int, in_feat: int, out_feat: int, bias: bool = True, rank: int = 0) -> None:
        super().__init__()
        self.num_expert, self.in_feat, self.out_feat, self.rank = num_expert, in_feat, out_feat, rank
        self.weight = nn.Parameter(torch.empty(num_expert, out_feat, in_feat))
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_expert, out_feat))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        # One expert per module (num_expert == 1, as FMoETransformerMLP builds them). A view, not
        # weight[0]: select's backward allocates and zero-fills a weight-sized buffer per expert per step.
        weight = self.weight.view(self.out_feat, self.in_feat)
        return F.linear(inp, weight, None if self.bias is None else self.bias.view(self.out_feat))

    def extra_repr(self) -> str:
        return (f"num_expert={self.num_expert}, in_features={self.in_feat}, "
                f"out_features={self.out_feat}, bias={self.bias is not None}, rank={self.rank}")


class Expert(nn.Module):
    """fmoe/transformer.py _Expert: htoh4 -> activation -> h4toh."""

    def __init__(self, d_model: int, d_hidden: int, activation: nn.Module) -> None:
        super().__init__()
        self.htoh4 = FMoELinear(1, d_model, d_hidden, bias=True)
        self.h4toh = FMoELinear(1, d_hidden, d_model, bias=True)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h4toh(self.activation(self.htoh4(x)))


class FMoEReference(nn.Module):
    """fastmoe's FMoETransformerMLP, same constructor shape.

    `num_expert` is the number of experts on THIS rank; the gate scores `num_expert * world_size`.
    `group` is fastmoe's `moe_group` (None: the default process group).
    forward(x[..., d_model]) -> y of the same shape, or (y, aux_loss) with `return_aux=True`
    (the MLP contract of moebench.models.transformer). The gate's aux loss is also left in
    `self.gate` (`gate.get_loss()`), as in fastmoe.
    """

    def __init__(
        self,
        num_expert: int = 32,
        d_model: int = 1024,
        d_hidden: int = 4096,
        activation: nn.Module | None = None,
        world_size: int = 1,
        group=None,
        top_k: int = 2,
        gate: type[BaseGate] = NaiveGate,
        gate_bias: bool = True,
        return_aux: bool = False,
    ) -> None:
        super().__init__()
        self.num_expert = num_expert
        self.d_model = d_model
        self.world_size = world_size
        self.group = group
        self.top_k = top_k
        self.return_aux = return_aux
        activation = activation if activation is not None else nn.GELU()
        # Draw order as fastmoe's FMoE.__init__: every expert first, then the gate.
        self.experts = nn.ModuleList([Expert(d_model, d_hidden, activation) for _ in range(num_expert)])
        self.gate = make_gate(gate, d_model, num_expert, world_size, top_k, gate_bias)
        self.gate.group = group
        self.tokens_per_expert: torch.Tensor | None = None
        """Slots this rank routed to each global expert in the last forward (dropped ones excluded)."""
        self.mark_parallel_comm()

    def mark_parallel_comm(self, expert_dp_comm: str = expert_parallel.EXPERT_DP_COMM) -> None:
        """fastmoe's mark_parallel_comm: experts are not data-parallel, the gate is. Call again
        after anything that replaces the Parameter objects (e.g. `to_empty`), which drops marks."""
        for p in self.experts.parameters():
            p.dp_comm = expert_dp_comm
        for p in self.gate.parameters():
            p.dp_comm = "gate"

    @staticmethod
    def param_category(local_name: str) -> str:
        """Category of a parameter for count_params (expert categories are EP shards)."""
        if local_name.startswith("experts."):
            return "experts"
        if local_name.startswith("gate."):
            return "gate"
        return "other"

    def forward(self, inp: torch.Tensor):
        original_shape = inp.shape
        x = inp.reshape(-1, self.d_model)
        topk_idx, topk_score = self.gate(x)
        y = self.moe_forward(x, topk_idx, topk_score).reshape(original_shape)
        if not self.return_aux:
            return y
        aux = self.gate.get_loss()
        return y, (aux.reshape(()) if aux is not None else y.new_zeros(()))

    def moe_forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_score: torch.Tensor) -> torch.Tensor:
        """Scatter slots to experts (sorted, contiguous), run them, gather, weight by the scores."""
        tokens, k = topk_idx.shape
        tot_expert = self.num_expert * self.world_size
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        # Sort slots by global expert; dropped slots (-1) sort last and are cut off.
        order = torch.argsort(torch.where(valid, flat, tot_expert), stable=True)
        local_expert_count = torch.bincount(flat[valid], minlength=tot_expert)
        self.tokens_per_expert = local_expert_count.detach()
        pos = order[: int(valid.sum())]
        token_of_slot = torch.div(pos, k, rounding_mode="floor")
        slots = x.index_select(0, token_of_slot)  # MOEScatter
        if self.world_size > 1:
            plan = expert_parallel.plan_exchange(local_expert_count, self.num_expert, self.group)
            expert_in = expert_parallel.dispatch(slots, plan, self.group)
            expert_out = self.run_experts(expert_in, plan.tokens_per_local_expert)
            slots_out = expert_parallel.combine(expert_out, plan, self.group)
        else:
            slots_out = self.run_experts(slots, local_expert_count.tolist())
        # MOEGather and the score-weighted sum in one pass: every kept slot adds score x output to its
        # token's row, a dropped slot adds nothing (its output counts as zero, as in fastmoe). No
        # [tokens * k, d] buffer and no bmm: both cost as much as the gather itself.
        scores = topk_score.reshape(-1).index_select(0, pos).to(slots_out.dtype)
        return x.new_zeros(tokens, x.shape[-1]).index_add(0, token_of_slot, slots_out * scores[:, None])

    def run_experts(self, expert_in: torch.Tensor, tokens_per_local_expert: list[int]) -> torch.Tensor:
        """fmoe/layers.py FMoE.expert_fn: each expert on its own contiguous slice."""
        outputs = [expert(chunk) for expert, chunk in zip(self.experts, expert_in.split(tokens_per_local_expert))]
        return torch.cat(outputs, dim=0)
