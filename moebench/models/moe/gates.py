"""fastmoe's gates in plain PyTorch: Naive, GShard, Switch and Noisy.

Each gate follows fastmoe's interface (fmoe/gates/base_gate.py): it is built as
`Gate(d_model, num_expert, world_size, top_k)` where `num_expert` is the number of experts on ONE
rank and the gate scores all `num_expert * world_size` experts; `forward(x[N, d_model])` returns
`(topk_idx[N, k], topk_score[N, k])` with -1 marking a slot dropped by a capacity limit, and the
auxiliary (balance) loss is left in the gate: `get_loss()`.

Points where moebench differs from fastmoe on purpose (each said where it happens):
- top-k is taken `sorted=True`: fastmoe asks for `sorted=False` (the same set of experts) but
  GShard reads column 0 as the top-1 expert and column 1 as the second, which only holds when the
  values come back sorted.
- capacity pruning keeps, for each expert, the first slots in token order (fastmoe's CUDA kernels
  keep whichever slots win an atomic race): same counts, but deterministic.
- NoisyGate returns `[N, k]` indices and scores like the other gates. fastmoe's returns indices
  flattened to `[N * k]`, which its layer then treats as k = 1, pairing slot i with token i
  instead of token i // k: wrong for k > 1. In eval mode fastmoe's noise scale is 0 and its load
  estimate divides by it; here eval uses the exact load (count of tokens per expert) instead. The
  eval-mode noise is still drawn (and unused), so the random stream matches fastmoe's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributions.normal import Normal


class BaseGate(nn.Module):
    """fmoe/gates/base_gate.py: holds the expert counts and the last auxiliary loss."""

    def __init__(self, num_expert: int, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.num_expert = num_expert
        self.tot_expert = world_size * num_expert
        self.loss: torch.Tensor | None = None
        self.group = None  # the expert-parallel process group, set by the layer

    def set_loss(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def get_loss(self, clear: bool = True) -> torch.Tensor | None:
        loss = self.loss
        if clear:
            self.loss = None
        return loss

    @property
    def has_loss(self) -> bool:
        return self.loss is not None


class NaiveGate(BaseGate):
    """fmoe/gates/naive_gate.py: Linear(d_model, E_total) logits, top-k, softmax over the k."""

    def __init__(self, d_model: int, num_expert: int, world_size: int, top_k: int = 2,
                 gate_bias: bool = True) -> None:
        super().__init__(num_expert, world_size)
        self.gate = nn.Linear(d_model, self.tot_expert, bias=gate_bias)
        self.top_k = top_k

    def forward(self, inp: torch.Tensor, return_all_scores: bool = False):
        logits = self.gate(inp)
        topk_val, topk_idx = torch.topk(logits, k=self.top_k, dim=-1, largest=True, sorted=True)
        topk_score = F.softmax(topk_val.view(-1, self.top_k), dim=-1)
        self.set_loss(inp.new_zeros(()))  # fastmoe's "dummy loss"
        if return_all_scores:
            return topk_idx, topk_score, logits
        return topk_idx, topk_score


class GShardGate(NaiveGate):
    """fmoe/gates/gshard_gate.py: top-2, capacity (1.2 train, 2.4 eval) per rank, random routing of
    the second expert, balance loss mean(c_e * m_e) * num_expert**2.

    As in fastmoe, capacity is computed from this rank's tokens and `num_expert` in the loss is the
    per-rank expert count, so on several ranks this gate is not the one-process gate."""

    def __init__(self, d_model: int, num_expert: int, world_size: int, topk: int = 2,
                 capacity: tuple[float, float] = (1.2, 2.4), random_routing: bool = True,
                 gate_bias: bool = True) -> None:
        if topk != 2:
            raise ValueError("the GShard gate routes every token to exactly 2 experts (top_k=2)")
        super().__init__(d_model, num_expert, world_size, top_k=2, gate_bias=gate_bias)
        self.capacity = capacity
        self.random_routing = random_routing

    def forward(self, x: torch.Tensor):
        topk_idx, topk_val, logits = super().forward(x, return_all_scores=True)
        tokens = logits.shape[0]
        top1_idx = topk_idx[:, 0]
        c_e = torch.bincount(top1_idx, minlength=self.tot_expert).to(logits.dtype) / tokens
        m_e = torch.mean(F.softmax(logits, dim=1), dim=0)
        self.set_loss(torch.mean(c_e * m_e) * (self.num_expert ** 2))

        cap_rate = self.capacity[0 if self.training else 1]
        capacity = math.ceil(cap_rate * x.shape[0]) * self.top_k // (self.world_size * self.num_expert)
        allowance = torch.full((self.tot_expert,), capacity, dtype=torch.long, device=x.device)
        topk_idx = prune_by_allowance(topk_idx, allowance)

        if self.random_routing:
            rand_routing_prob = torch.rand(tokens, device=x.device)
            drop_second = 2 * topk_val[:, 1] < rand_routing_prob
            topk_idx[:, 1].masked_fill_(drop_second, -1)
        return topk_idx, topk_val


class SwitchGate(NaiveGate):
    """fmoe/gates/switch_gate.py: top-1 of softmax(logits + U[1-eps, 1+eps] jitter in training),
    capacity ceil(rate * N / num_expert) per expert shared across ranks, switch loss
    sum(fraction_e * prob_e) * E_total."""

    def __init__(self, d_model: int, num_expert: int, world_size: int, topk: int = 1,
                 switch_eps: float = 0.1, capacity: tuple[float, float] = (1.2, 2.4),
                 gate_bias: bool = True) -> None:
        if topk != 1:
            raise ValueError("the Switch gate routes every token to exactly 1 expert (top_k=1)")
        super().__init__(d_model, num_expert, world_size, top_k=1, gate_bias=gate_bias)
        self.switch_eps = switch_eps
        self.capacity = capacity

    def forward(self, inp: torch.Tensor):
        score = self.gate(inp)
        if self.training:
            noise = torch.rand_like(score) * 2 * self.switch_eps + 1.0 - self.switch_eps
            score = score + noise
        score = F.softmax(score.float(), dim=-1)
        top1_score, top1_idx = torch.topk(score, k=1, dim=-1, largest=True)
        top1_score = top1_score.to(dtype=inp.dtype)

        cap_rate = self.capacity[0 if self.training else 1]
        capacity = math.ceil(cap_rate * inp.shape[0] / self.num_expert)
        top1_idx = limit_by_capacity(top1_idx, self.tot_expert, capacity, self.world_size, self.group)

        valid_idx = top1_idx[top1_idx > -1]
        fraction_expert = torch.bincount(valid_idx, minlength=self.tot_expert).float() / valid_idx.numel()
        prob_expert = score.sum(dim=0) / valid_idx.numel()
        self.set_loss((fraction_expert * prob_expert).sum() * self.tot_expert)
        return top1_idx, top1_score


class NoisyGate(BaseGate):
    """fmoe/gates/noisy_gate.py (Shazeer et al. 2017): logits x @ w_gate plus Gaussian noise of
    scale softplus(x @ w_noise) + 0.01 in training; top-k, softmax over the k; loss
    cv²(importance) + cv²(load) with the smooth load estimate. Correct for k > 1 (see module doc)."""

    def __init__(self, d_model: int, num_expert: int, world_size: int, top_k: int = 2) -> None:
        super().__init__(num_expert, world_size)
        self.w_gate = nn.Parameter(torch.zeros(d_model, self.tot_expert))
        self.w_noise = nn.Parameter(torch.zeros(d_model, self.tot_expert))
        self.top_k = top_k
        self.noise_epsilon = 1e-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.w_gate, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.w_noise, a=math.sqrt(5))

    def _prob_in_top_k(self, clean_values, noisy_values, noise_stddev, noisy_top_values):
        """Probability that each expert stays in the top k under fresh noise (differentiable)."""
        threshold_if_in = noisy_top_values[:, self.top_k:self.top_k + 1]
        threshold_if_out = noisy_top_values[:, self.top_k - 1:self.top_k]
        is_in = noisy_values > threshold_if_in
        normal = Normal(clean_values.new_zeros(()), clean_values.new_ones(()))
        prob_if_in = normal.cdf((clean_values - threshold_if_in) / noise_stddev)
        prob_if_out = normal.cdf((clean_values - threshold_if_out) / noise_stddev)
        return torch.where(is_in, prob_if_in, prob_if_out)

    @staticmethod
    def cv_squared(x: torch.Tensor) -> torch.Tensor:
        eps = 1e-10
        if x.shape[0] == 1:
            return x.new_zeros((), dtype=torch.float)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def forward(self, inp: torch.Tensor):
        clean_logits = inp @ self.w_gate
        # Drawn in eval too, as fastmoe does (its noise is scaled by `training` = 0 there): the
        # random stream then advances the same way whether or not an eval pass ran in between.
        noise = torch.randn_like(clean_logits)
        if self.training:
            noise_stddev = F.softplus(inp @ self.w_noise) + self.noise_epsilon
            logits = clean_logits + noise * noise_stddev
        else:
            logits = clean_logits
        top_logits, top_indices = logits.topk(min(self.top_k + 1, self.tot_expert), dim=1)
        topk_idx = top_indices[:, :self.top_k]
        topk_score = F.softmax(top_logits[:, :self.top_k], dim=1)
        gates = torch.zeros_like(logits).scatter(1, topk_idx, topk_score)
        if self.training and self.top_k < self.tot_expert:
            load = self._prob_in_top_k(clean_logits, logits, noise_stddev, top_logits).sum(0)
        else:
            load = (gates > 0).sum(0)
        importance = gates.sum(0)
        self.set_loss(self.cv_squared(importance) + self.cv_squared(load))
        return topk_idx.contiguous(), topk_score.contiguous()


GATES: dict[str, type[BaseGate]] = {
    "naive": NaiveGate, "gshard": GShardGate, "switch": SwitchGate, "noisy": NoisyGate,
}
"""Gate names accepted by `--gate`."""

FIXED_TOP_K = {"gshard": 2, "switch": 1}
"""Gates whose k is fixed by their algorithm."""


def make_gate(gate_cls: type[BaseGate], d_model: int, num_expert: int, world_size: int,
              top_k: int, gate_bias: bool = True) -> BaseGate:
    """Build a gate the way fastmoe's FMoE does (fmoe/layers.py): NaiveGate subclasses get gate_bias."""
    if issubclass(gate_cls, NaiveGate):
        return gate_cls(d_model, num_expert, world_size, top_k, gate_bias=gate_bias)
    return gate_cls(d_model, num_expert, world_size, top_k)


# --------------------------------------------------------------------------- capacity


def rank_within_expert(flat_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each slot, how many earlier slots (in token order) chose the same expert; -1 slots get 0."""
    key = torch.where(flat_idx >= 0, flat_idx, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty_like(flat_idx)
    ranks[order] = torch.arange(flat_idx.numel(), device=flat_idx.device) - starts[key[order]]
    return ranks


def prune_by_allowance(topk_idx: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
    """fastmoe's prune_gate_by_capacity: keep the first `allowance[e]` slots of expert e, -1 the rest."""
    flat = topk_idx.reshape(-1)
    ranks = rank_within_expert(flat, allowance.numel())
    keep = (flat >= 0) & (ranks < allowance[flat.clamp(min=0)])
    return torch.where(keep, flat, torch.full_like(flat, -1)).view_as(topk_idx)


def limit_by_capacity(topk_idx: torch.Tensor, tot_expert: int, capacity: int, world_size: int,
                      group=None) -> torch.Tensor:
    """fmoe/gates/utils.py limit_by_capacity: each expert takes at most `capacity` slots from all
    ranks together. Ranks are served in rank order (fastmoe: atomic race), so on N ranks the kept
    slots are exactly those one process would keep on the concatenated batch."""
    with torch.no_grad():
        local_count = torch.bincount(topk_idx[topk_idx >= 0], minlength=tot_expert)
        if world_size > 1:
            counts = [torch.empty_like(local_count) for _ in range(world_size)]
            dist.all_gather(counts, local_count, group=group)
            counts = torch.stack(counts)                       # [ranks, experts]
            before = torch.cumsum(counts, 0) - counts          # slots earlier ranks send
            allowed = (capacity - before).clamp(min=0).minimum(counts)
            allowance = allowed[dist.get_rank(group)]
        else:
            allowance = local_count.clamp(max=capacity)
        return prune_by_allowance(topk_idx, allowance)
