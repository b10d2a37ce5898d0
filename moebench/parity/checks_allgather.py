"""Check 7 `all-gather-variable` (seed 002, st-moe-pytorch distributed.py).

Forward: the gathered tensor is every rank's rows in rank order and the sizes are right, for
variable sizes along dim 0 and dim 1 and for the equal-size fast path.
Backward: every rank computes its own (different) loss on the gathered tensor; each rank's input
gradient must equal the single-process gradient of the summed loss - which is the sum over ranks
(a reduce-scatter), not the local slice of the local gradient.
"""

from __future__ import annotations

import torch

from moebench.distributed.collectives import all_gather_variable
from moebench.parity.compare import EXACT, STRICT, assertion, compare, pick
from moebench.parity.registry import Check, CheckOptions, impl_or_default, register

LOCAL_SLICE = "a backward that keeps only this rank's slice of its own gradient (no reduce-scatter)"
FEATURES = (3, 4)  # trailing dims of every rank's tensor: tiny on purpose


def _rank_rows(case: str, rank: int) -> int:
    if case == "equal":
        return 2
    return 1 + (rank * 2) % 5  # 1, 3, 5, 2, 4, 1, ... : varied, and differs between neighbours


def _tensor_of(rank: int, rows: int, dim: int, seed: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + salt * 100 + rank)
    shape = [FEATURES[0], FEATURES[1]]
    shape.insert(dim, rows)
    return torch.randn(*shape, generator=g)


def _weights_of(rank: int, shape, seed: int, salt: int) -> torch.Tensor:
    # Each rank's loss weights its view of the gathered tensor differently, so its gradient reaches
    # every other rank's rows with a different value: a local-slice backward cannot match.
    g = torch.Generator().manual_seed(seed * 1000 + salt * 100 + 50 + rank)
    return torch.randn(*shape, generator=g)


def _loss(gathered: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(gathered) * weights).sum()


def _rank(ctx, opts: CheckOptions) -> list:
    gather, label = impl_or_default(opts, "all-gather", all_gather_variable)
    # The seed asserts nothing about this function: seed mode reports but does not assert values.
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=None)
    r, w = ctx.rank, ctx.world_size
    results = []
    cases = [("variable", 0, 1), ("variable", 1, 2), ("equal", 0, 3)]
    for case, dim, salt in cases:
        tag = f"{case} sizes, dim {dim}"
        rows = [_rank_rows(case, s) for s in range(w)]
        inputs = [_tensor_of(s, rows[s], dim, opts.seed, salt) for s in range(w)]
        x = inputs[r].clone().requires_grad_(True)
        gathered, sizes = gather(x, dim=dim)
        sizes_list = [int(v) for v in torch.as_tensor(sizes).flatten().tolist()]
        results.append(compare(f"{tag}: sizes", torch.tensor(sizes_list, dtype=torch.float64),
                               torch.tensor(rows, dtype=torch.float64), EXACT, rank=r,
                               note=f"impl {label}"))
        reference = torch.cat(inputs, dim=dim).requires_grad_(True)
        results.append(compare(f"{tag}: gathered rows in rank order", gathered, reference, EXACT, rank=r))
        if not gathered.requires_grad:  # e.g. a plain dist.all_gather: no gradient reaches x at all
            results.append(assertion(f"{tag}: gathered tensor is differentiable", False,
                                     note="no grad_fn: the all-gather has no autograd backward"))
            continue
        weights = [_weights_of(s, reference.shape, opts.seed, salt) for s in range(w)]
        _loss(gathered, weights[r]).backward()
        sum(_loss(reference, weights[s]) for s in range(w)).backward()
        expected = reference.grad.split(rows, dim=dim)[r]
        got = x.grad if x.grad is not None else torch.zeros_like(x)
        # What a backward that keeps only this rank's slice of its OWN gradient gives (st-moe's bug):
        # offered to the diagnosis so such a failure is named "local slice".
        own = reference.detach().clone().requires_grad_(True)
        _loss(own, weights[r]).backward()
        local_slice = own.grad.split(rows, dim=dim)[r]
        results.append(compare(f"{tag}: input grad = sum over ranks' losses", got, expected, tol,
                               rank=r, asserted=asserted, world_size=w,
                               alternatives={"local slice": (local_slice, LOCAL_SLICE)}))
    return results


register(Check(
    name="all-gather-variable", order=70, seed_source="002 st-moe-pytorch distributed.py",
    description="variable-size all-gather: rows in rank order, sizes, equal-size path; backward = sum over ranks",
    catches="an all-gather that pads/trims or sizes wrongly, misorders ranks, "
            "or whose backward does not sum over ranks",
    rank_fn=_rank, impl_keys=("all-gather",),
))
