"""Softmax top-2 (renormalised), stacked experts, all-gather dispatch, sum-over-ranks-keep-mine combine."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _Gather(torch.autograd.Function):
    """Every rank's rows, in rank order; the backward sums the gradient over the ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, world, reduce_backward):
        ctx.world, ctx.reduce_backward = world, reduce_backward
        if world == 1:
            return x.clone()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        if ctx.world == 1:
            return grad, None, None
        grad = grad.contiguous().clone()
        if ctx.reduce_backward:
            dist.all_reduce(grad)
        rank, _ = _world()
        return grad.chunk(ctx.world)[rank], None, None


class _SumKeepMine(torch.autograd.Function):
    """Sum every rank's partial outputs and keep this rank's rows; the backward hands every rank all the rows."""

    @staticmethod
    def forward(ctx, y, world):
        ctx.world = world
        if world == 1:
            return y.clone()
        y = y.contiguous().clone()
        dist.all_reduce(y)
        rank, _ = _world()
        return y.chunk(world)[rank].clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.world == 1:
            return grad, None
        parts = [torch.empty_like(grad) for _ in range(ctx.world)]
        dist.all_gather(parts, grad.contiguous())
        return torch.cat(parts), None


class GatherMoE(nn.Module):
    def __init__(self, d_model, d_hidden, num_experts, rank=0, world_size=1, bug=None):
        super().__init__()
        self.num_experts, self.rank, self.world, self.bug = num_experts, rank, world_size, bug
        self.local = num_experts // world_size
        self.router = nn.Parameter(torch.zeros(d_model, num_experts))
        self.w1 = nn.Parameter(torch.zeros(self.local, d_model, d_hidden))
        self.w2 = nn.Parameter(torch.zeros(self.local, d_hidden, d_model))

    def expert_of(self, slot: int) -> int:
        if self.bug == "wrong-expert-map" and self.world > 1:
            return self.rank + slot * self.world  # strided, while the weights are laid out contiguously
        return self.rank * self.local + slot

    def forward(self, x):
        probs = (x @ self.router).softmax(-1)
        top, index = probs.topk(2, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        if self.bug == "weights-detached" and self.world > 1:  # the expert-parallel path's own bug
            weights = weights.detach()
        reduce = self.bug != "exchange-backward-local"
        tokens = _Gather.apply(x, self.world, reduce)
        weights = _Gather.apply(weights, self.world, reduce)
        index = _Gather.apply(index.float(), self.world, True).long()
        y = torch.zeros_like(tokens)
        for slot in range(self.local):
            chosen = index == self.expert_of(slot)
            rows = chosen.any(-1)
            if rows.any():
                h = torch.nn.functional.gelu(tokens[rows] @ self.w1[slot]) @ self.w2[slot]
                y = y.index_add(0, rows.nonzero()[:, 0], h * (weights[rows] * chosen[rows]).sum(-1, keepdim=True))
        return _SumKeepMine.apply(y, self.world)


def sync(layer: GatherMoE) -> None:
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        if name == "router":
            if layer.bug != "router-not-reduced":
                dist.all_reduce(p.grad)
            p.grad /= layer.world
        elif layer.bug != "expert-grads-summed":
            p.grad /= layer.world


def clip(layer: GatherMoE, max_norm: float) -> None:
    """Clip by the global norm: the experts' squares summed over the ranks, the router's counted once. The bug
    "clip-per-rank" takes each rank's own norm instead."""
    experts = sum(float((p.grad.double() ** 2).sum()) for p in (layer.w1, layer.w2) if p.grad is not None)
    total = torch.tensor([experts], dtype=torch.float64)
    if layer.world > 1 and layer.bug != "clip-per-rank":
        dist.all_reduce(total)
    norm = (float(total) + float((layer.router.grad.double() ** 2).sum())) ** 0.5
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    for p in layer.parameters():
        if p.grad is not None:
            p.grad *= coefficient
