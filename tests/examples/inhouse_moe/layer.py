"""An in-house expert-parallel MoE layer, as a team would write it: a softmax router picks one expert per token
(top-1, scaled by its probability), the E experts are spread over the W ranks (E / W each, contiguous), and the
tokens travel to their experts' ranks and back by all_to_all_single with uneven splits, made differentiable by
hand (the backward of an all-to-all is the all-to-all of the gradients the other way).

`sync_gradients` is the layer's data-parallel step: the router's gradient is every rank's own, all-reduced and
averaged; an expert's gradient already holds every rank's tokens' contribution (the backward all-to-all brought
them), so it is only divided by W, as the global loss is the mean of the W ranks' losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward sends the gradients back the way the tokens came."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x, send_splits, recv_splits, group=None):
    return _AllToAll.apply(x, send_splits, recv_splits, group)


class Expert(nn.Module):
    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class InHouseMoE(nn.Module):
    """top-1 MoE over `world_size` ranks; with world_size 1 every expert is local (the one-process layer)."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.num_experts, self.rank, self.world_size = num_experts, rank, world_size
        self.local = num_experts // world_size
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(self.local))

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)
        score, expert = probs.max(dim=-1)
        if self.world_size == 1:
            out = torch.zeros_like(x)
            for e, module in enumerate(self.experts):
                mask = expert == e
                out[mask] = module(x[mask])
            return out * score[:, None]
        order = torch.argsort(expert, stable=True)
        owner = expert[order] // self.local
        send = torch.bincount(owner, minlength=self.world_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # how many tokens each rank sends me
        send_splits, recv_splits = send.tolist(), recv.tolist()
        tokens = all_to_all(x[order], send_splits, recv_splits)
        which = all_to_all(expert[order][:, None].float(), send_splits, recv_splits)[:, 0].long() % self.local
        done = torch.zeros_like(tokens)
        for j, module in enumerate(self.experts):
            mask = which == j
            done[mask] = module(tokens[mask])
        back = all_to_all(done, recv_splits, send_splits)
        out = torch.empty_like(back)
        out[order] = back
        return out * score[:, None]


def sync_gradients(layer: InHouseMoE) -> None:
    """The layer's gradient sync (see the module docstring)."""
    w = layer.world_size
    for p in layer.router.parameters():
        dist.all_reduce(p.grad)
        p.grad /= w
    for p in layer.experts.parameters():
        if p.grad is not None:
            p.grad /= w
