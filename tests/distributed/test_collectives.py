"""moebench.distributed.collectives.all_gather_variable and the distributed Experts, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moebench.distributed.collectives import all_gather_variable, reduce_scatter_input, reduce_scatter_output
from moebench.distributed.launch import launch
from moebench.parity.experts import Experts, rank_share


def _rows(rank: int) -> int:
    return [2, 0, 3, 1][rank % 4]  # includes a rank with no rows at all


def _gather_case(ctx, dim: int, equal: bool, pass_sizes: bool):
    w = ctx.world_size
    rows = [2] * w if equal else [_rows(r) for r in range(w)]
    inputs = []
    for r in range(w):
        shape = [3, 2]
        shape.insert(dim % 3, rows[r])
        inputs.append(torch.randn(*shape, generator=torch.Generator().manual_seed(r)))
    x = inputs[ctx.rank].clone().requires_grad_(True)
    gathered, sizes = all_gather_variable(x, dim=dim, sizes=rows if pass_sizes else None)
    # Each rank's own cotangent; the adjoint must sum them over ranks for each rank's rows.
    cotangents = [torch.randn(gathered.shape, generator=torch.Generator().manual_seed(100 + r)) for r in range(w)]
    (gathered * cotangents[ctx.rank]).sum().backward()
    expected_grad = sum(cotangents).split(rows, dim=dim)[ctx.rank]
    return (torch.equal(gathered, torch.cat(inputs, dim=dim)), sizes.tolist() == rows,
            torch.allclose(x.grad, expected_grad, rtol=1e-6, atol=1e-6))


@pytest.mark.multirank
@pytest.mark.parametrize(
    "dim,equal,pass_sizes", [(0, False, False), (1, False, True), (0, True, False), (-1, False, False)]
)
def test_all_gather_variable_forward_and_adjoint(dim, equal, pass_sizes):
    result = launch(_gather_case, 3, args=(dim, equal, pass_sizes), backend="gloo", timeout_s=30)
    assert result.ok, result.describe()
    for rank, (rows_ok, sizes_ok, grad_ok) in enumerate(result.returns):
        assert rows_ok, f"rank {rank}: gathered rows are not every rank's rows in rank order"
        assert sizes_ok, f"rank {rank}: wrong sizes"
        assert grad_ok, f"rank {rank}: backward is not the sum over ranks (reduce-scatter)"


def _wrong_sizes(ctx):
    x = torch.zeros(ctx.rank + 1, 2)
    all_gather_variable(x, sizes=[5] * ctx.world_size)


@pytest.mark.multirank
def test_all_gather_variable_rejects_sizes_that_do_not_match():
    result = launch(_wrong_sizes, 2, backend="gloo", timeout_s=30)
    assert result.status == "failed"
    # (the other rank may die in init when its peer exits first: at least one says why)
    assert any("ValueError" in e and "sizes[" in e for e in result.errors.values()), result.describe()


def test_rank_share_covers_every_expert_and_row_once():
    for world_size in range(1, 17):
        for experts in (1, 3, 8, 10):
            for batch in (1, 7, 18):
                seen = torch.zeros(experts, batch, dtype=torch.long)
                for rank in range(world_size):
                    ids, rows = rank_share(rank, world_size, experts, batch)
                    for e in ids:
                        seen[e, rows.start:rows.stop] += 1
                assert bool((seen == 1).all()), (world_size, experts, batch)


def test_experts_single_process_runs_each_expert_on_its_slot():
    torch.manual_seed(0)
    experts = [nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(2, 3, 5, 4)
    out = Experts(experts)(x, is_distributed=False)
    for e in range(3):
        assert torch.equal(out[:, e], experts[e](x[:, e]))
    with pytest.raises(ValueError, match="expected"):
        Experts(experts)(torch.randn(2, 4, 5, 4), is_distributed=False)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_nccl_backward_layout_is_the_adjoint_along_any_dim(dim):
    """The NCCL backward's layout, with reduce_scatter_tensor simulated exactly as NCCL defines it
    (sum the ranks' inputs, split into world_size equal blocks along dim 0, rank r gets block r)."""
    sizes = [2, 0, 3, 1]
    shape = [4, 3, 5]
    shape[dim] = sum(sizes)
    grads = [torch.randn(*shape, generator=torch.Generator().manual_seed(r)) for r in range(len(sizes))]
    reduced = sum(reduce_scatter_input(g, sizes, dim) for g in grads)
    assert reduced.shape[0] == len(sizes) * max(sizes)
    for rank, block in enumerate(reduced.chunk(len(sizes), dim=0)):
        got = reduce_scatter_output(block, sizes[rank], dim)
        expected = sum(grads).split(sizes, dim=dim)[rank]
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), (dim, rank)
