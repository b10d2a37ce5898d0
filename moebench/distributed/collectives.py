"""Autograd-aware collectives.

`all_gather_variable(t, dim=0, sizes=None) -> (gathered, sizes)`: every rank's `t` concatenated
along `dim` in rank order, where ranks may hold different sizes along `dim` (pad to the largest,
gather, drop the padding). Its backward is the true adjoint of the forward: rank r's input
gradient is the SUM over all ranks of their gradient rows that came from rank r (a
reduce-scatter). Returning only the local slice of the local gradient - as st-moe-pytorch's
AllGatherFunction does - is right only when each rank's loss depends on its own rows alone.

On NCCL the backward is a real reduce-scatter (padded to equal blocks). Gloo has no
reduce_scatter, so there the gradient is all-reduced and each rank keeps its rows: same result,
world_size times the traffic - fine for the CPU sizes gloo is used for here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_sizes(t: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Every rank's size along `dim`, as a long tensor in rank order (on t's device)."""
    size = torch.tensor([t.shape[dim]], device=t.device, dtype=torch.long)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    return torch.cat(sizes)


def _pad_to(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    pad = length - t.shape[dim]
    if pad == 0:
        return t
    trailing = t.ndim - dim - 1
    return F.pad(t, (0, 0) * trailing + (0, pad))


def _gather_padded(t: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """Forward without autograd: pad to max, all_gather, concatenate, drop padding."""
    world_size = len(sizes)
    max_size = max(sizes) if sizes else 0
    padded = _pad_to(t.contiguous(), max_size, dim).contiguous()
    blocks = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(blocks, padded, group=group)
    if len(set(sizes)) > 1:  # variable sizes: drop each block's padding
        blocks = [b.narrow(dim, 0, n) for b, n in zip(blocks, sizes)]
    return torch.cat(blocks, dim=dim)


def reduce_scatter_input(grad: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
    """The gathered gradient laid out for `reduce_scatter_tensor`, which splits its input into
    world_size equal blocks along dim 0: rank r's rows, padded to the largest size, become block r
    (`dim` moved to the front first, so this holds for any dim)."""
    max_size = max(sizes)
    rows = grad.movedim(dim, 0)
    return torch.cat([_pad_to(g, max_size, 0) for g in rows.split(sizes, dim=0)], dim=0).contiguous()


def reduce_scatter_output(block: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """This rank's reduced block back in the input's layout: padding dropped, `dim` put back."""
    return block.narrow(0, 0, size).movedim(0, dim)


def _sum_own_rows(grad: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """Adjoint of the gather: sum over ranks of the rows that came from this rank."""
    rank = dist.get_rank(group)
    grad = grad.contiguous()
    if dist.get_backend(group) == "nccl":
        stacked = reduce_scatter_input(grad, sizes, dim)
        block = stacked.new_empty((max(sizes), *stacked.shape[1:]))
        dist.reduce_scatter_tensor(block, stacked, group=group)
        return reduce_scatter_output(block, sizes[rank], dim)
    summed = grad.clone()
    dist.all_reduce(summed, group=group)  # gloo: no reduce_scatter
    return summed.split(sizes, dim=dim)[rank]


class _AllGatherVariable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, sizes: list[int], group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _gather_padded(t, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_own_rows(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


def all_gather_variable(t: torch.Tensor, dim: int = 0, sizes=None, group=None):
    """Concatenate every rank's `t` along `dim` (sizes may differ per rank); differentiable.

    Returns (gathered, sizes) with sizes a long tensor of every rank's size along `dim`.
    Pass `sizes` when every rank already knows them, to skip one collective."""
    dim = dim % t.ndim
    if sizes is None:
        sizes = gather_sizes(t, dim=dim, group=group)
    sizes_t = torch.as_tensor(sizes, dtype=torch.long, device=t.device)
    sizes_list = [int(s) for s in sizes_t.tolist()]
    if len(sizes_list) != dist.get_world_size(group):
        raise ValueError(f"sizes has {len(sizes_list)} entries, world size is {dist.get_world_size(group)}")
    if sizes_list[dist.get_rank(group)] != t.shape[dim]:
        raise ValueError(f"sizes[{dist.get_rank(group)}]={sizes_list[dist.get_rank(group)]} "
                         f"but this rank's tensor has {t.shape[dim]} along dim {dim}")
    return _AllGatherVariable.apply(t, dim, sizes_list, group), sizes_t


def collectives_issued() -> int | None:
    """How many collectives this process has issued so far, over every process group it knows
    (c10d's per-group sequence numbers); None when this torch does not expose them. Subtract two
    readings to learn whether some code exchanged anything at all in between."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
        return sum(int(g._get_sequence_number_for_group()) for g in groups)
    except (AttributeError, RuntimeError, TypeError):
        return None
