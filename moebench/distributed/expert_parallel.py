"""Expert parallelism: where experts live, how token slots travel, how gradients are reduced.

Placement. With `experts` in total on `ep_size` ranks, each rank holds `num_local_experts =
experts // ep_size` of them: global expert g lives on rank g // num_local_experts as that rank's
local expert g % num_local_experts (fastmoe's layout: fmoe/layers.py, `num_expert` is per worker).

Exchange (fastmoe's global_scatter / global_gather, fmoe/functions.py, done here with
`all_to_all_single`, which gloo supports on CPU and NCCL on GPU). A rank's slots, sorted by global
expert, are already grouped by destination rank. The counts go first (one all_to_all of
`experts` integers), then the slots; what arrives is ordered by source rank, then local expert,
and is permuted to local-expert-major so each expert runs on one contiguous slice. The way back
is the reverse. `AllToAll` is an autograd function whose backward is the reverse exchange.

Gradients. Each rank computes the mean loss over its slice of the global batch. Then:
- replicated (non-expert) parameters: all-reduce and divide by ep_size, i.e. the gradient of the
  mean over the global batch (DDP's convention);
- expert parameters: the owner already holds the sum over every rank's tokens of d(local mean
  loss), which is ep_size x the gradient of the global-batch mean; it is divided by ep_size.
So N ranks train exactly like one process on the global batch (same loss curve, within float
tolerance). fastmoe's DistributedGroupedDataParallel (fmoe/distributed.py) averages parameters
marked `dp_comm` "dp"/"gate"/"world" but skips experts (`dp_comm="none"`): their gradients stay
summed, ep_size x the global-mean gradient, which Adam mostly hides but SGD does not.
Parameters are marked the fastmoe way: `p.dp_comm = "none"` on experts, "gate" on the gate.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

EXPERT_DP_COMM = "none"
"""`dp_comm` mark of expert-parallel parameters (fastmoe's name): not reduced, only rescaled."""


def owner_rank(global_expert: int, num_local_experts: int) -> int:
    """The rank that holds global expert g."""
    return global_expert // num_local_experts


class AllToAll(torch.autograd.Function):
    """all_to_all_single on dim 0 with uneven splits; backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    return AllToAll.apply(x, out_splits, in_splits, group)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangePlan:
    """Everything both directions of one layer's exchange need."""

    send_splits: list[int]
    """Slots this rank sends to each rank."""
    recv_splits: list[int]
    """Slots this rank receives from each rank."""
    to_expert_major: torch.Tensor
    """Permutation of the received buffer (source-major) into local-expert-major order."""
    to_source_major: torch.Tensor
    """Its inverse."""
    tokens_per_local_expert: list[int]
    """Slots each local expert processes (from every rank)."""


def plan_exchange(local_expert_count: torch.Tensor, num_local_experts: int, group=None) -> ExchangePlan:
    """`local_expert_count[g]`: this rank's slots for global expert g (fastmoe's local_expert_count)."""
    ep_size = dist.get_world_size(group)
    # global_expert_count[src, e]: slots rank `src` sends to my local expert e (fastmoe's expert_exchange).
    global_expert_count = torch.empty_like(local_expert_count)
    dist.all_to_all_single(global_expert_count, local_expert_count.contiguous(), group=group)
    global_expert_count = global_expert_count.view(ep_size, num_local_experts)
    send_splits = local_expert_count.view(ep_size, num_local_experts).sum(1)
    recv_splits = global_expert_count.sum(1)
    # Segment (src, e) starts at src_start[src, e] in the received buffer; emit segments e-major.
    flat = global_expert_count.reshape(-1)
    src_start = (torch.cumsum(flat, 0) - flat).view(ep_size, num_local_experts)
    lengths = global_expert_count.t().reshape(-1)
    out_start = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    to_expert_major = (torch.repeat_interleave(src_start.t().reshape(-1) - out_start, lengths)
                       + torch.arange(total, device=lengths.device))
    to_source_major = torch.empty_like(to_expert_major)
    to_source_major[to_expert_major] = torch.arange(total, device=lengths.device)
    return ExchangePlan(send_splits=send_splits.tolist(), recv_splits=recv_splits.tolist(),
                        to_expert_major=to_expert_major, to_source_major=to_source_major,
                        tokens_per_local_expert=global_expert_count.sum(0).tolist())


def dispatch(slots: torch.Tensor, plan: ExchangePlan, group=None) -> torch.Tensor:
    """Slots sorted by global expert -> this rank's local experts' slots, expert-contiguous."""
    received = all_to_all(slots, plan.recv_splits, plan.send_splits, group)
    return received.index_select(0, plan.to_expert_major)


def combine(expert_out: torch.Tensor, plan: ExchangePlan, group=None) -> torch.Tensor:
    """The reverse of `dispatch`: expert outputs back to the ranks (and order) they came from."""
    source_major = expert_out.index_select(0, plan.to_source_major)
    return all_to_all(source_major, plan.send_splits, plan.recv_splits, group)


# --------------------------------------------------------------------------- gradients


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return getattr(p, "dp_comm", None) == EXPERT_DP_COMM


def sync_gradients(model: torch.nn.Module, group=None, *, scale_expert_grads: bool = True) -> None:
    """After backward on each rank's slice: make every rank's gradients the global-batch gradients.

    `scale_expert_grads=False` reproduces fastmoe's DistributedGroupedDataParallel (expert
    gradients left summed); tests use it to show the equivalence check catches it.
    """
    ep_size = dist.get_world_size(group)
    if ep_size == 1:
        return
    replicated = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_expert_param(p):
            if scale_expert_grads:
                p.grad.div_(ep_size)
        else:
            replicated.append(p.grad)
    if replicated:
        flat = _flatten_dense_tensors(replicated)
        dist.all_reduce(flat, group=group)
        flat.div_(ep_size)
        for g, synced in zip(replicated, _unflatten_dense_tensors(flat, replicated)):
            g.copy_(synced)


# --------------------------------------------------------------------------- weights

_EXPERT_KEY = re.compile(r"(^|\.)experts\.(\d+)\.")


def shard_state_dict(full: dict, rank: int, num_local_experts: int) -> dict:
    """A one-process state_dict -> the one rank `rank` loads: its experts only, renumbered locally.

    Everything that is not an expert is kept as is (replicated on every rank)."""
    lo, hi = rank * num_local_experts, (rank + 1) * num_local_experts
    shard = {}
    for key, value in full.items():
        m = _EXPERT_KEY.search(key)
        if m is None:
            shard[key] = value
            continue
        g = int(m.group(2))
        if lo <= g < hi:
            shard[key[:m.start(2)] + str(g - lo) + key[m.end(2):]] = value
    return shard
