"""Sigmoid top-1, a ModuleList of bias-free SwiGLU experts laid out strided, all-to-all dispatch and combine."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, keep_own_only):
        ctx.send, ctx.recv, ctx.keep_own_only = send, recv, keep_own_only
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv)
        if ctx.keep_own_only:  # the bug: only the slots this rank exchanged with itself come back
            rank = dist.get_rank()
            keep = torch.zeros(back.shape[0], dtype=torch.bool)
            start = sum(ctx.send[:rank])
            keep[start:start + ctx.send[rank]] = True
            back = back * keep[:, None]
        return back, None, None, None


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.gate = nn.Linear(d_model, d_hidden, bias=False)
        self.up = nn.Linear(d_model, d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class SigmoidMoE(nn.Module):
    def __init__(self, d_model, d_hidden, num_experts, rank=0, world_size=1, bug=None):
        super().__init__()
        self.num_experts, self.rank, self.world, self.bug = num_experts, rank, world_size, bug
        self.local = num_experts // world_size
        self.scorer = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_hidden) for _ in range(self.local))

    def owner_slot(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bug == "wrong-expert-map":  # contiguous, while the weights are laid out strided
            return expert // self.local, expert % self.local
        return expert % self.world, expert // self.world

    def forward(self, x):
        scores = torch.sigmoid(self.scorer(x))
        score, expert = scores.max(-1)
        if self.bug == "weights-detached" and self.world > 1:  # the expert-parallel path's own bug
            score = score.detach()
        if self.world == 1:
            out = torch.zeros_like(x)
            for e, module in enumerate(self.experts):
                mask = expert == e
                out = out.index_put((mask.nonzero()[:, 0],), module(x[mask]))
            return out * score[:, None]
        owner, slot = self.owner_slot(expert)
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_l, recv_l = send.tolist(), recv.tolist()
        local_only = self.bug == "exchange-backward-local"
        tokens = _AllToAll.apply(x[order], send_l, recv_l, local_only)
        which = _AllToAll.apply(slot[order][:, None].float(), send_l, recv_l, False)[:, 0].long()
        done = torch.zeros_like(tokens)
        for j, module in enumerate(self.experts):
            mask = which == j
            done = done.index_put((mask.nonzero()[:, 0],), module(tokens[mask]))
        back = _AllToAll.apply(done, recv_l, send_l, local_only)
        out = torch.empty_like(back).index_put((order,), back)
        return out * score[:, None]


class ReloadsReversed(SigmoidMoE):
    """A resume bug: its load_state_dict puts the saved local experts into its slots in reverse order."""

    def load_state_dict(self, state_dict, strict=True, assign=False):
        moved = {}
        for key, value in state_dict.items():
            if key.startswith("experts."):
                slot, rest = key[len("experts."):].split(".", 1)
                key = f"experts.{self.local - 1 - int(slot)}.{rest}"
            moved[key] = value
        return super().load_state_dict(moved, strict=strict, assign=assign)


def sync(layer: SigmoidMoE) -> None:
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        if name.startswith("scorer"):
            if layer.bug != "router-not-reduced":
                dist.all_reduce(p.grad)
            p.grad /= layer.world
        elif layer.bug != "expert-grads-summed":
            p.grad /= layer.world
