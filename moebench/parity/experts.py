"""Experts spread over ranks: each rank runs a share of the experts on everyone's tokens.

Contract (the one `verify-parity --impl experts=...` checks):
- `Experts(list_of_expert_modules)`; `forward(x)` with x of shape (batch, experts, tokens, dim),
  slot e of every sample goes through expert e; the output has x's shape.
- Distributed (the default when a process group with > 1 rank is up): ranks may hold different
  batch sizes. Every rank gathers all inputs, runs its share, and gathers the outputs back.
  `is_distributed=False` runs every expert on this process's x (the single-process reference).
- Expert parameter gradients are partial per rank (an expert's gradient lives on the rank(s) that
  ran it): average them over ranks as DDP(find_unused_parameters=True) would.

Sharing (world size W, E experts):
- W <= E: contiguous blocks of experts, sizes as even as possible (W need not divide E);
- W > E: each expert gets W // E ranks, each running a contiguous chunk of the gathered batch;
  the W % E leftover ranks run nothing but stay in the autograd graph, because the backward of
  every all-gather is a collective that all ranks must join.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moebench.distributed.collectives import all_gather_variable


def even_split(total: int, parts: int) -> list[int]:
    """`total` items over `parts` buckets, the first `total % parts` buckets one larger."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def rank_share(rank: int, world_size: int, experts: int, batch: int) -> tuple[range, range]:
    """(experts this rank runs, rows of the gathered batch it runs them on)."""
    if world_size <= experts:
        counts = even_split(experts, world_size)
        start = sum(counts[:rank])
        return range(start, start + counts[rank]), range(0, batch)
    ranks_per_expert = world_size // experts
    if rank >= ranks_per_expert * experts:
        return range(0), range(0)  # idle rank
    expert, chunk = divmod(rank, ranks_per_expert)
    rows = even_split(batch, ranks_per_expert)
    start = sum(rows[:chunk])
    return range(expert, expert + 1), range(start, start + rows[chunk])


class Experts(nn.Module):
    """Run expert e on slot e of every sample, the experts shared out over ranks."""

    # The collective used for both gathers; a subclass may swap it (tests feed broken ones).
    all_gather = staticmethod(all_gather_variable)

    def __init__(self, experts: list[nn.Module], is_distributed: bool | None = None) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.is_distributed = is_distributed

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _distributed(self, flag: bool | None) -> bool:
        if flag is None:
            flag = self.is_distributed
        if flag is None:
            flag = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return bool(flag)

    def share(self, rank: int, world_size: int, batch: int) -> tuple[range, range]:
        """(experts `rank` runs, rows of the gathered batch it runs them on); see `rank_share`."""
        return rank_share(rank, world_size, self.num_experts, batch)

    def idle_piece(self, gathered: torch.Tensor) -> torch.Tensor:
        """A (0, tokens, dim) slice of the gathered input: empty, but part of the graph."""
        return gathered[:0, 0]

    def forward(self, x: torch.Tensor, is_distributed: bool | None = None) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.num_experts:
            raise ValueError(f"expected (batch, {self.num_experts}, tokens, dim), got {tuple(x.shape)}")
        if not self._distributed(is_distributed):
            return torch.stack([expert(x[:, e]) for e, expert in enumerate(self.experts)], dim=1)

        rank, world_size = dist.get_rank(), dist.get_world_size()
        gathered, batch_sizes = self.all_gather(x, dim=0)
        total_batch = gathered.shape[0]

        # Every rank's share is computable everywhere, so the output gather needs no size exchange.
        shares = [rank_share(r, world_size, self.num_experts, total_batch) for r in range(world_size)]
        my_experts, my_rows = self.share(rank, world_size, total_batch)
        pieces = [self.experts[e](gathered[my_rows.start:my_rows.stop, e]) for e in my_experts]
        if pieces:
            mine = torch.cat(pieces, dim=0)  # (experts_here * rows, tokens, dim)
        else:
            # Idle rank: an empty piece that still hangs off the graph (input and parameters), so
            # this rank's backward reaches the gathers' collectives like everyone else's.
            anchor = sum((p.sum() for p in self.parameters()), torch.zeros((), device=x.device)) * 0
            mine = self.idle_piece(gathered) + anchor
        sizes = [len(e) * len(rows) for e, rows in shares]
        outs, _ = self.all_gather(mine, dim=0, sizes=sizes)

        # Reassemble (experts, total_batch, tokens, dim) from the rank-ordered pieces.
        full = [[None] * world_size for _ in range(self.num_experts)]
        offset = 0
        for r, (expert_ids, rows) in enumerate(shares):
            for e in expert_ids:
                full[e][r] = outs[offset:offset + len(rows)]
                offset += len(rows)
        per_expert = [torch.cat([p for p in full[e] if p is not None], dim=0) for e in range(self.num_experts)]
        out = torch.stack(per_expert, dim=1)  # (total_batch, experts, tokens, dim)
        start = int(torch.as_tensor(batch_sizes)[:rank].sum())
        return out[start:start + x.shape[0]]
